"""qlora, proven by runs of the template's tiny model on CPU: the blocks' linear layers are
4-bit, only the adapters train and are checkpointed, a resume is bit-exact, and the export loads
and generates (merged in the base dtype, and as an adapter); on two processes under FSDP2 (gloo)
the same run gives the same losses, resumes bit-exact and exports."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.skills.skill_helpers import (
    PYTHON,
    REPO,
    SMALL_RUN,
    final_checkpoint,
    launch,
    on_documents,
    run_dir,
    run_metrics,
    template_with,
)

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

SETTINGS = ("train.max_steps=6", "checkpoint.every=3", "checkpoint.keep_last=2", "optim.lr=1e-2",
            "optim.warmup_steps=0")


def losses(cwd: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run_metrics(cwd)}


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    from tests.skills.skill_helpers import write_documents

    root = tmp_path_factory.mktemp("qlora")
    documents = write_documents(root / "docs.jsonl", 400, 5, 60)
    recipe = template_with(["qlora"], root / "recipe", {"qlora": {"rank": 4}})
    (root / "run").mkdir()
    run = launch(recipe, root / "run", *SMALL_RUN, *SETTINGS, *on_documents(documents))
    assert run.returncode == 0, run.stderr[-3000:]
    return recipe, root, run


def test_qlora_quantises_the_blocks_and_trains_only_the_adapters(qlora_run, tmp_path: Path):
    recipe, root, run = qlora_run
    # 7 linear layers in each of the 2 decoder layers are 4-bit NF4, and each has an adapter.
    assert "qlora: quantised 14 linear layers of LlamaForCausalLM to 4-bit nf4 with double quantisation" in run.stdout
    assert "lora: adapted 14 linear layers" in run.stdout
    curve = losses(root / "run")
    assert sorted(curve) == [1, 2, 3, 4, 5, 6]
    assert curve[6] < curve[1]

    state = final_checkpoint(root / "run", tmp_path)["model_optim"]
    weights, optimizer = state["model"], state["optim"]
    # The checkpoint holds the adapters only: the 4-bit base is rebuilt by the recipe.
    assert weights and all(".lora_A." in n or ".lora_B." in n for n in weights), sorted(weights)[:5]
    assert len(weights) == 2 * 7 * 2  # (A, B) × 7 linear layers × 2 blocks
    assert set(optimizer["state"]) == set(weights)


def test_qlora_resumes_bit_exact_from_its_adapter_checkpoint(qlora_run, tmp_path: Path):
    recipe, root, _ = qlora_run
    from engine import run_checkpoints

    step_3 = dict(run_checkpoints.list_checkpoints(run_dir(root / "run")))[3]
    documents = root / "docs.jsonl"
    resumed = subprocess.run(
        [PYTHON, "-m", "engine.launch", str(recipe), "--resume-from", str(step_3),
         *[a for s in (*SMALL_RUN, *SETTINGS, *on_documents(documents)) for a in ("--set", s)]],
        cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    went_on = losses(root / "run")
    assert losses(tmp_path) == {step: went_on[step] for step in (4, 5, 6)}


@pytest.mark.parametrize("lora", ["merged", "adapter"])
def test_qlora_export_loads_and_generates(qlora_run, tmp_path: Path, lora: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import hf_export, model_io

    recipe, root, _ = qlora_run
    out = tmp_path / "export"
    engine = model_io.load_engine(run_dir(root / "run"), 6, recipe=recipe)  # the 4-bit model, adapters loaded
    probe = torch.arange(40).reshape(2, 20) * 3
    with torch.no_grad():
        trained = engine.model(input_ids=probe).logits
    written = hf_export.export(engine.hf_model(), engine.hf_processing(), out, lora=lora)
    assert written["lora"] == lora and written["lora_layers"] == 14
    if lora == "merged":
        model = AutoModelForCausalLM.from_pretrained(out)
        # A plain model in the base dtype: no 4-bit layer, no adapter is left.
        assert model.dtype == torch.float32
        assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith("q_proj"))
        # Dequantised exactly, the adapters' update added: the same function as the trained model.
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=probe).logits, trained, rtol=0, atol=1e-4)
    else:
        from peft import PeftModel

        assert (out / "adapter_model.safetensors").is_file() and (out / "base" / "config.json").is_file()
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out)
    tokenizer = AutoTokenizer.from_pretrained(out if lora == "merged" else out / "base")
    ids = tokenizer("def f(x):", return_tensors="pt")["input_ids"]
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > ids.shape[1]  # it generated (it may stop at the end-of-document token)


@pytest.fixture(scope="module")
def qlora_two_processes(qlora_run) -> Path:
    """qlora_run's run on two processes: FSDP2 shards the packed 4-bit weights and the adapters
    (engine/fsdp_quantized.py)."""
    recipe, root, _ = qlora_run
    (root / "two").mkdir()
    run = launch(recipe, root / "two", *SMALL_RUN, *SETTINGS, *on_documents(root / "docs.jsonl"), nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    return root / "two"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_qlora_under_fsdp2_on_two_processes_trains_as_one_process_does(qlora_run, qlora_two_processes, tmp_path,
                                                                        capsys):
    one, two = losses(qlora_run[1] / "run"), losses(qlora_two_processes)
    differences = [abs(one[step] - two[step]) for step in one]
    with capsys.disabled():
        print(f"\n[qlora] FSDP2 2 processes vs 1, {len(one)} steps: max |loss diff| {max(differences):.2e}")
    assert sorted(two) == [1, 2, 3, 4, 5, 6] and two[6] < two[1]
    assert max(differences) < 1e-4
    # The checkpoint of the sharded run holds the same adapters, and nothing of the 4-bit base.
    (tmp_path / "two").mkdir(), (tmp_path / "one").mkdir()
    sharded = final_checkpoint(qlora_two_processes, tmp_path / "two")["model_optim"]["model"]
    assert sorted(sharded) == sorted(final_checkpoint(qlora_run[1] / "run", tmp_path / "one")["model_optim"]["model"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_qlora_under_fsdp2_resumes_bit_exact_on_two_processes(qlora_run, qlora_two_processes, tmp_path: Path):
    recipe, root, _ = qlora_run
    from engine import run_checkpoints

    step_3 = dict(run_checkpoints.list_checkpoints(run_dir(qlora_two_processes)))[3]
    sets = [a for s in (*SMALL_RUN, *SETTINGS, *on_documents(root / "docs.jsonl")) for a in ("--set", s)]
    resumed = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "engine.launch",
         str(recipe), "--resume-from", str(step_3), *sets],
        cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    went_on = losses(qlora_two_processes)
    assert losses(tmp_path) == {step: went_on[step] for step in (4, 5, 6)}


def test_the_adapters_trained_under_fsdp2_export_merged_and_load(qlora_run, qlora_two_processes, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from engine import hf_export, model_io

    recipe, _, _ = qlora_run
    engine = model_io.load_engine(run_dir(qlora_two_processes), 6, recipe=recipe)  # one process, 4-bit again
    probe = torch.arange(40).reshape(2, 20) * 3
    with torch.no_grad():
        trained = engine.model(input_ids=probe).logits
    written = hf_export.export(engine.hf_model(), engine.hf_processing(), tmp_path / "export", lora="merged")
    assert written["lora_layers"] == 14
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=probe).logits, trained, rtol=0, atol=1e-4)


def mapped_file_kib(name: str = ".safetensors") -> int:
    """The resident KiB of this process's mappings of ``name`` files (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and fields[5].endswith(name)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_quantising_a_loaded_model_gives_back_the_file_pages_it_read(tmp_path: Path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from skills.qlora import helpers
    from tests.model_families import tiny_model_folder

    folder = tiny_model_folder(tmp_path / "llama", "llama", hidden_size=256, intermediate_size=688,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    ids = torch.arange(12).unsqueeze(0)
    logits, resident = [], []
    for drop in (True, False):  # the same model quantised with the pages dropped, and kept
        if not drop:
            monkeypatch.setattr(helpers, "drop_file_pages", lambda weight, mapped: None)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        helpers.quantize_4bit(model)
        resident.append(mapped_file_kib())
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
        del model
    quantised_kib = 2 * 4 * (4 * 256 * 256 - 2 * 256 * 128 + 3 * 256 * 688) // 1024  # fp32 bytes of the blocks' linears
    assert resident[1] - resident[0] > 0.9 * quantised_kib
    assert torch.equal(logits[0], logits[1])  # nothing the model still reads was dropped
