"""The code skills write, as real modules: run on their own, and copied into recipes by libcst.

``skills/muon/muon_optimizer.py``, ``skills/muon/muon_triton.py`` and ``engine/blocks.py`` (the
engine's own definition of the blocks, which FSDP2 shards by) are what the muon skill and every
skill acting on a model's blocks write into a recipe (``skills/codemod_kit/copied.py`` copies their definitions).
Here they are imported and run as they are; the golden diffs of ``test_skill_codemods.py`` check
what the copies look like in a recipe.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from skills.codemod_kit import copied
from engine.blocks import find_blocks
from skills.muon import muon_optimizer


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.norm(x).sum()


def test_the_muon_module_steps_as_torch_muon_on_the_block_matrices_and_adamw_on_the_rest():
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is not in this torch (2.9+)")
    torch.manual_seed(0)
    model = Tiny()
    reference = Tiny()
    reference.load_state_dict(model.state_dict())
    settings = dict(lr=0.02, weight_decay=0.1)
    optimizer = muon_optimizer.MuonWithAdamW(model, betas=(0.9, 0.95), eps=1e-8, **settings)
    matrices = [block.weight for block in reference.blocks]
    rest = [p for p in reference.parameters() if all(p is not m for m in matrices)]
    muon = torch.optim.Muon(matrices, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw",
                            **settings)
    adamw = torch.optim.AdamW(rest, betas=(0.9, 0.95), eps=1e-8, **settings)
    tokens = torch.randint(0, 16, (4, 5))
    for _ in range(2):
        for m in (model, reference):
            m.zero_grad()
            m(tokens).backward()
        optimizer.step()
        muon.step()
        adamw.step()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, msg=f"{name} differs from torch's optimizers")
    assert [len(group["params"]) for group in optimizer.param_groups] == [2, 5]


def test_newton_schulz_maps_a_matrix_near_the_orthogonal_one():
    torch.manual_seed(0)
    matrix = torch.randn(16, 48)
    singular = torch.linalg.svdvals(muon_optimizer.newton_schulz(matrix).float())
    assert 0.6 < float(singular.min()) and float(singular.max()) < 1.3  # Muon's quintic lands in ~[0.7, 1.2]


def test_find_blocks_takes_the_largest_module_list_and_refuses_a_model_without_blocks():
    where, blocks = find_blocks(Tiny(), "probe")
    assert (where, len(blocks)) == ("Tiny.blocks", 2)
    with pytest.raises(ValueError, match="probe: Linear has no repeated blocks"):
        find_blocks(torch.nn.Linear(2, 2), "probe")
    warned: list[str] = []
    assert find_blocks(torch.nn.Linear(2, 2), "probe", warn=warned.append) == ("", [])
    assert len(warned) == 1


def test_the_triton_module_imports_on_a_cpu_and_falls_back_to_torch():
    from skills.muon import muon_triton

    matrix = torch.randn(8, 12)
    torch.testing.assert_close(muon_triton.newton_schulz(matrix), muon_optimizer.newton_schulz_torch(matrix))


def test_copied_takes_the_named_definitions_in_file_order_and_leaves_imports_to_the_codemod(tmp_path: Path):
    module = tmp_path / "helpers.py"
    module.write_text(textwrap.dedent('''\
        """A module to copy."""

        from __future__ import annotations

        import math
        from typing import Callable

        from engine.blocks import find_blocks
        from .sibling import other

        try:  # optional
            import triton
        except ImportError:
            triton = None

        SCALE = 2.0


        def first(x: float) -> float:
            return math.sqrt(x) * SCALE


        class Second:
            pass
        '''))
    assert copied.imports(module) == [("math", None), ("typing", "Callable")]
    code = copied.definitions(module, ["Second", "SCALE"])
    assert code.index("SCALE = 2.0") < code.index("class Second")
    assert "def first" not in code and "import" not in code and "A module to copy" not in code
    assert "triton = None" in copied.definitions(module, ["triton"])
    with pytest.raises(LookupError, match="helpers.py defines no missing"):
        copied.definitions(module, ["first", "missing"])


def test_skills_copy_from_these_modules_not_from_strings():
    from skills.codemod_kit import definitions

    assert definitions.FIND_BLOCKS == copied.definitions(definitions.BLOCKS_MODULE, ["find_blocks"])
    source = (Path(definitions.__file__).parents[1] / "muon" / "codemod.py").read_text()
    assert "class MuonWithAdamW" not in source and "copied.definitions(OPTIMIZER_MODULE" in source


def _packing():
    import importlib.util

    path = Path(copied.__file__).parents[1] / "sequence-packing" / "packing.py"
    spec = importlib.util.spec_from_file_location("sequence_packing_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_fit_decreasing_fills_bins_to_capacity_and_places_every_item_once():
    packing = _packing()
    lengths = [7, 5, 4, 3, 3, 2, 1, 1]
    bins = packing.first_fit_decreasing(lengths, 8)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    assert len(bins) == 4  # 26 positions in bins of 8: the optimum
    with pytest.raises(ValueError, match="a sequence of 9 positions does not fit in rows of 8"):
        packing.first_fit_decreasing([9], 8)


def test_collated_pairs_restart_positions_per_piece_and_ignore_the_padding():
    packing = _packing()
    pieces = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7])]
    rows = packing.pack_pairs(pieces, 8)
    assert len(rows) == 1
    batch = packing.collate_pairs(rows, 8, 0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 5, 6, 0, 0, 0]]
    assert batch["labels"].tolist() == [[2, 3, 4, 6, 7, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


def test_copied_renames_names_not_text_in_strings(tmp_path: Path):
    module = tmp_path / "helpers.py"
    module.write_text('def collate(rows, seq_len):\n    """Rows of ``seq_len``."""\n    return rows.seq_len + seq_len\n')
    code = copied.definitions(module, renamed={"collate": "collate_packed", "seq_len": "max_len"})
    assert "def collate_packed(rows, max_len):" in code
    assert "rows.seq_len + max_len" in code and "Rows of ``seq_len``" in code


HELPER_MODULES = sorted(Path(copied.__file__).parents[1].glob("*/helpers.py"))


@pytest.mark.parametrize("path", HELPER_MODULES, ids=lambda p: p.parent.name)
def test_each_skills_helpers_module_imports_on_its_own_and_defines_what_it_copies(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"helpers_{path.parent.name.replace('-', '_')}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # every import it names resolves here
    code = copied.definitions(path)
    defined = [line.split("(")[0][4:] for line in code.splitlines() if line.startswith("def ")]
    assert defined and all(callable(getattr(module, name)) for name in defined)
