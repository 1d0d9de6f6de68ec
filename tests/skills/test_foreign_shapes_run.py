"""Foreign-shape changes run: a GradScaler loop whose model lives in a sibling model.py gets
loss-guard, gradient-checkpointing and mixed-precision, then trains 3 steps on CPU with a NaN loss
on the second (the guard skips it, and GradScaler.update() stays valid with and without an
unscale_ before the step)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from skills import apply_skill
from tests.skills.test_foreign_shapes import MODEL_PY, write

SCRIPT = '''
import torch
from model import GPT


class Config:
    width = 8
    n_layer = 2


torch.manual_seed(0)
model = GPT(Config())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", enabled=True)
dtypes = []
model.h[0].fc.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
for step in range(3):
    x = torch.randn(4, 8)
    logits, loss = model(x)
    if step == 1:
        loss = loss * float("nan")
    scaler.scale(loss).backward()
    if GRAD_CLIP != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"done {dtypes[0]}")
'''


@pytest.mark.slow
@pytest.mark.parametrize("clip", ["1.0", "0.0"])
def test_guarded_scaler_loop_with_checkpointing_and_autocast_trains(clip: str, tmp_path: Path, capsys, monkeypatch):
    path = write(tmp_path, SCRIPT.replace("GRAD_CLIP", clip), **{"model.py": MODEL_PY})
    for skill in ("loss-guard", "gradient-checkpointing", "mixed-precision"):
        assert apply_skill(skill, path).changed

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "model", raising=False)
    runpy.run_path(str(path), run_name="__main__")
    sys.modules.pop("model", None)

    printed = capsys.readouterr().out
    assert "gradient-checkpointing: wrapped 2 of 2 blocks of GPT.h" in printed
    assert printed.count("loss-guard: skipped an optimizer step: loss is nan (1 in a row)") == 1
    assert "done torch.bfloat16" in printed
