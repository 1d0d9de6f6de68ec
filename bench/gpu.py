"""GPU kernels through the product: a ~0.85B Llama-style model, FSDP2 + bfloat16, plain against
liger-kernel + flash-attention (and + sequence-packing).

Each variant is a copy of the causal_lm template with skills applied by ``skills.apply_skill``,
trained by ``torchrun -m engine.launch`` (``python -m engine.launch`` for one process) on random
tokens (``data.source=random``: documents of 16 to 2 × seq_len tokens, so unpacked rows carry
padding). The engine logs tokens/s (tokens read, padding left out), MFU (known GPUs: engine/flops.py) and peak
memory to metrics.jsonl; this prints their medians after the warm-up steps, the ratios to the plain
variant, and every warning a run recorded (a kernel that stayed off says why). Then, with a CUDA
GPU and triton, the muon skill's Newton-Schulz: torch's matmuls against its Triton kernel on the
model's matrix shapes; and the grpo template's loss forward reading a group's prompt once against
each row read whole (difference and time), with what ``grpo.generation_engine=vllm`` says there.

    python bench/gpu.py                      # all GPUs of the machine, 30 steps
    python bench/gpu.py --nproc 1 --steps 40
    python bench/gpu.py --tiny               # CPU smoke run of this script: a tiny model, 3 steps

Model (default): hidden 2048, intermediate 5632, 16 layers, 16 heads, 4 KV heads, vocabulary
32000, untied (0.85B parameters); sequence 2048, 8 sequences per GPU per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import run_dir as rd  # noqa: E402  (torch-free)
from engine import run_metrics  # noqa: E402
from skills import apply_skill  # noqa: E402

TEMPLATE = REPO / "recipes_template" / "causal_lm"
VARIANTS = {
    "plain": [],
    "liger+flash": ["liger-kernel", "flash-attention"],
    "liger+flash+packing": ["liger-kernel", "flash-attention", "sequence-packing"],
}
MODEL = {
    "model.hidden_size": 2048, "model.intermediate_size": 5632, "model.num_layers": 16,
    "model.num_heads": 16, "model.num_kv_heads": 4, "data.vocab_size": 32000, "data.seq_len": 2048,
}
TINY_MODEL = {
    "model.hidden_size": 64, "model.intermediate_size": 160, "model.num_layers": 2, "model.num_heads": 4,
    "model.num_kv_heads": 2, "data.vocab_size": 512, "data.seq_len": 64, "data.random_documents": 400,
}


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def launch(recipe: Path, workdir: Path, nproc: int, settings: list[str], timeout: float) -> Path:
    """Train ``recipe`` in ``workdir``; return the run directory."""
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "engine.launch", str(recipe)]
    else:
        command = [sys.executable, "-m", "engine.launch", str(recipe)]
    command += [a for s in settings for a in ("--set", s)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "launch.log", "w") as log:
        result = subprocess.run(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if result.returncode != 0:
        tail = (workdir / "launch.log").read_text()[-3000:]
        raise RuntimeError(f"{recipe.name} failed ({result.returncode}):\n{tail}")
    (run,) = (workdir / rd.RUNS_DIRNAME).iterdir()
    return run


def summarize(run: Path, warmup: int) -> dict:
    records = [r for r in run_metrics.read_all_metrics(run / rd.METRICS_JSONL) if "tokens_per_s" in r]
    timed = [r for r in records if r["step"] > warmup] or records[-1:]
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(mfu) if mfu else None,
        "peak_mem_mb": max(r["peak_mem_mb"] for r in records),
        "padding_frac": statistics.mean(r["padding_frac"] for r in timed),
        "final_loss": records[-1]["loss"],
        "warnings": rd.read_run(run).warnings,
    }


def newton_schulz_timings(recipe: Path, shapes: list[tuple[int, int]], repeat: int = 10) -> list[str]:
    """Milliseconds per orthogonalization, torch's matmuls against the muon skill's Triton kernel."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return ["Newton-Schulz kernel: skipped (no CUDA GPU)"]
    spec = importlib.util.spec_from_file_location("muon_recipe", recipe / "recipe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if module.triton is None:
        return ["Newton-Schulz kernel: skipped (triton is not installed)"]
    lines = [f"{'Newton-Schulz (5 steps)':<26}{'torch ms':>10}{'triton ms':>11}{'ratio':>8}{'max diff':>10}"]
    for rows, cols in shapes:
        matrix = torch.randn(rows, cols, device="cuda")
        times = []
        for function in (module.newton_schulz_torch, module.newton_schulz_triton):
            function(matrix, 5)  # warm-up (and autotuning)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                function(matrix, 5)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / repeat)
        difference = (module.newton_schulz_torch(matrix, 5).float() - module.newton_schulz_triton(matrix, 5).float())
        lines.append(f"{f'{rows} x {cols}':<26}{times[0]:>10.3f}{times[1]:>11.3f}{times[0] / times[1]:>7.2f}x"
                     f"{difference.abs().max().item():>10.1e}")
    return lines


def grpo_prompt_sharing(device: str, tiny: bool, repeat: int = 10) -> list[str]:
    """The grpo template's loss forward reading a group's prompt once (``completion_logits``)
    against each row read whole, on ``device``: the largest logit difference and ms per forward +
    backward; and what ``grpo.generation_engine=vllm`` says on this machine."""
    import torch

    sys.path.insert(0, str(REPO))
    from recipes_template.grpo import recipe as grpo

    torch.manual_seed(0)
    tokenizer = grpo.byte_chat_tokenizer()
    shape = grpo.ModelConfig(hidden_size=64, intermediate_size=160, num_layers=2) if tiny else \
        grpo.ModelConfig(hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=4)
    model = grpo.build_model(shape, len(tokenizer), 256).to(device).train()
    prompts = [grpo.prompt_tokens(tokenizer, r) for _, r in grpo.builtin_prompts(2 if tiny else 16)]
    prompt_ids, prompt_mask = grpo.left_padded(prompts, tokenizer.pad_token_id)
    G, width = (4, 8) if tiny else (8, 128)
    input_ids = torch.cat([prompt_ids.repeat_interleave(G, 0), torch.randint(0, 256, (len(prompts) * G, width))], 1).to(device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, :prompt_mask.shape[1]] = prompt_mask.repeat_interleave(G, 0)

    def whole():
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits[:, -width - 1:-1]

    def shared():
        return grpo.completion_logits(model, input_ids, attention_mask, width)

    difference = (whole() - shared()).abs().max().item()
    times = []
    for forward in (whole, shared):
        forward().float().square().mean().backward()  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeat):
            forward().float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / repeat * 1000)
    return [f"grpo loss forward + backward on {device} ({len(input_ids)} rows, G {G}, {width} completion tokens): "
            f"rows whole {times[0]:.2f} ms, prompt once per group {times[1]:.2f} ms ({times[0] / times[1]:.2f}x), "
            f"largest logit difference {difference:.1e}",
            f"grpo.generation_engine=vllm here: {grpo.vllm_refusal()}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: every GPU, or 1)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the medians")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per process per step")
    parser.add_argument("--tiny", action="store_true", help="a tiny model for 3 steps: checks this script on CPU")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--keep", type=Path, help="keep the recipes and runs in this folder")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = parser.parse_args()

    if args.tiny:
        args.steps, args.warmup, args.micro_batch = 3, 1, 2
    elif gpu_count() == 0:
        print("no CUDA GPU here: this benchmark trains a 0.85B model; `--tiny` checks the script on CPU")
        return 2
    nproc = args.nproc or (1 if args.tiny else gpu_count())
    model = TINY_MODEL if args.tiny else MODEL
    settings = [f"{k}={v}" for k, v in model.items()] + [
        "data.source=random", f"data.batch_size={args.micro_batch * nproc}", f"train.max_steps={args.steps}",
        "train.log_every=1", "train.eval_every=0", "optim.warmup_steps=5", "checkpoint.every=0",
        "checkpoint.at_end=false", "metrics.tensorboard=false", "parallel.param_dtype=bfloat16",
        "parallel.reduce_dtype=float32", "parallel.fsdp_on_one_process=true",
    ]
    root = args.keep or Path(tempfile.mkdtemp(prefix="trainwright-gpu-bench-"))
    print(f"{'tiny model on CPU' if args.tiny else 'Llama-style 0.85B'}, {nproc} process(es), {args.steps} steps, "
          f"FSDP2 + bfloat16; work in {root}", flush=True)
    results = {}
    try:
        for name in args.variants:
            recipe = root / name / "recipe"
            shutil.rmtree(root / name, ignore_errors=True)
            shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__", "runs"))
            for skill in VARIANTS[name]:
                apply_skill(skill, recipe)
            start = time.perf_counter()
            run = launch(recipe, root / name / "work", nproc, settings, args.timeout)
            results[name] = summarize(run, args.warmup)
            print(f"  {name}: done in {time.perf_counter() - start:.0f} s", flush=True)
        muon_recipe = root / "muon" / "recipe"
        shutil.rmtree(root / "muon", ignore_errors=True)
        shutil.copytree(TEMPLATE, muon_recipe, ignore=shutil.ignore_patterns("__pycache__", "runs"))
        apply_skill("muon", muon_recipe, params={"triton": True})
        hidden, intermediate = model["model.hidden_size"], model["model.intermediate_size"]
        kv = hidden // model["model.num_heads"] * model["model.num_kv_heads"]
        kernel_lines = newton_schulz_timings(muon_recipe, [(hidden, hidden), (kv, hidden), (intermediate, hidden)])
        kernel_lines += grpo_prompt_sharing("cpu" if args.tiny else "cuda", args.tiny, repeat=2 if args.tiny else 10)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)

    base = results.get("plain")
    print()
    print(f"{'variant':<22}{'tokens/s':>12}{'MFU':>8}{'peak MB':>10}{'padding':>9}{'loss':>8}"
          f"{'tok/s ratio':>13}{'mem ratio':>11}")
    for name, r in results.items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        memory = f"{r['peak_mem_mb'] / base['peak_mem_mb']:.2f}x" if base else ""
        print(f"{name:<22}{r['tokens_per_s']:>12,.0f}{mfu:>8}{r['peak_mem_mb']:>10,.0f}{r['padding_frac']:>9.1%}"
              f"{r['final_loss']:>8.3f}{speed:>13}{memory:>11}")
    for name, r in results.items():
        for warning in r["warnings"]:
            print(f"warning in {name}: {warning}")
    print()
    print("\n".join(kernel_lines))
    print(json.dumps({"nproc": nproc, "steps": args.steps, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
