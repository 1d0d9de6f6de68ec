"""The ``Engine`` base class: a visible lifecycle and the training loop.

A recipe subclasses ``Engine`` and overrides the ``prepare_*`` methods and ``compute_loss``;
the engine owns everything that is the same for every experiment:

    run()
      before_train()   seed, prepare_model/optimizer/scheduler/data, resume from a checkpoint
      do_train()       the loop: gradient accumulation, clipping, LR schedule, metrics,
                       periodic evaluation and checkpoints
      after_train()    final checkpoint, close the metric backends

Losses are normalised by the number of supervised tokens in the *global* batch, so a run on N
data-parallel ranks computes the same gradients as one process with the same global batch.
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from engine.optimizers import check_optimizer_choice
from engine.checkpoint import Checkpointer, ModelOptimizerState, RNGState, SchedulerState, load_checkpoint
from engine.config import ConfigError, EngineConfig
from engine.data_files import DataListing
from engine.distributed import DistInfo, dp_all_reduce_sum
from engine.flops import non_embedding_params, peak_flops
from engine.fsdp import DTYPES, has_tensor_parallel_params
from engine.grad_clip import clip_grad_norm
from engine.memory import busiest_peak_mb, gathered_peaks
from engine.sequence_parallel import check_sequence_parallel_config, has_sequence_parallel_attention
from engine.metrics import MetricBackend, MetricLogger
from engine.metrics.console import ConsoleBackend
from engine.metrics.jsonl import JsonlBackend
from engine.metrics.optional import open_backends
from engine.metrics.tensorboard import TensorBoardBackend, tensorboard_available

IGNORE_INDEX = -100

Batch = dict[str, torch.Tensor]


@dataclass
class TrainState(Stateful):
    """Progress that a checkpoint carries besides model, optimizer, scheduler and data."""

    step: int = 0
    tokens_seen: int = 0  # tokens the model read (padding left out)
    loss_tokens_seen: int = 0  # the tokens of those that the loss is over
    # False while a checkpoint saved before loss_tokens_seen existed is loaded (DCP loads only
    # the keys the state names, and refuses one the checkpoint lacks).
    with_loss_tokens: bool = field(default=True, repr=False, compare=False)

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "tokens_seen": self.tokens_seen}
        return {**state, "loss_tokens_seen": self.loss_tokens_seen} if self.with_loss_tokens else state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        # Before loss_tokens_seen, tokens_seen counted the loss's tokens: it is that count.
        self.loss_tokens_seen = int(state_dict.get("loss_tokens_seen", state_dict["tokens_seen"]))


@dataclass
class StepContext:
    """What one optimizer step produced; handed to hooks such as ``before_optimizer_step``."""

    step: int  # the step being taken (1-based: the first step is 1)
    num_tokens: int  # tokens the model read in the global batch: positions less padding
    num_positions: int  # token positions processed in the global batch (padding included)
    loss: torch.Tensor  # global mean loss of the step (a 0-d tensor, not yet synchronised)
    grad_norm: torch.Tensor | None = None  # total gradient norm, after backward
    timings: dict[str, float] = field(default_factory=dict)
    num_padding: int = 0  # padding positions in the global batch (``Engine.count_padding``)
    num_loss_tokens: int = 0  # tokens the loss is over in the global batch (``Engine.count_loss_tokens``)


@dataclass
class Window:
    """The training steps since the last logged one, summed; what ``log_step`` reports."""

    elapsed: float = 0.0  # their seconds, evaluations and saves inside the window left out
    steps: int = 0
    tokens: int = 0  # tokens read (``StepContext.num_tokens``)
    loss_tokens: int = 0  # tokens the loss was over (``StepContext.num_loss_tokens``)
    positions: int = 0  # positions computed, padding included (what MFU counts)

    def add(self, ctx: StepContext) -> None:
        self.steps += 1
        self.tokens += ctx.num_tokens
        self.loss_tokens += ctx.num_loss_tokens
        self.positions += ctx.num_positions

    def per_second(self, count: int) -> float:
        return count / self.elapsed if self.elapsed > 0 else 0.0


class Engine:
    """Base class of every recipe. Override the ``prepare_*`` methods and ``compute_loss``."""

    config_class: ClassVar[type[EngineConfig]] = EngineConfig

    def __init__(
        self,
        config: EngineConfig,
        dist_info: DistInfo,
        run_dir: Path | None = None,
        resume_from: Path | None = None,
    ):
        self.config = config
        self.dist = dist_info
        self.device = dist_info.device
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.resume_from = Path(resume_from) if resume_from is not None else None
        self.state = TrainState()
        self.model: nn.Module
        self.optimizer: torch.optim.Optimizer
        self.scheduler: torch.optim.lr_scheduler.LRScheduler
        self.train_batches: Iterator[Batch]
        self.eval_batches: list[Batch] | None = None
        self.logger = MetricLogger([])
        self.checkpointer: Checkpointer | None = None
        # The data files this run's loaders listed (they pass it to the readers), checked
        # against the launch check's count by confirm_data.
        self.data_listing = DataListing()
        self._warned: set[str] = set()

    # ----------------------------------------------------------------------------------------
    # What a recipe overrides
    # ----------------------------------------------------------------------------------------

    def prepare_model(self) -> nn.Module:
        """Build the model, apply parallelism (``engine.fsdp.apply_fsdp`` last) and return it."""
        raise NotImplementedError("a recipe must define prepare_model()")

    def prepare_data(self) -> Iterator[Batch]:
        """This rank's training micro-batches: an endless, ``Stateful`` iterator of dicts.

        Each micro-batch holds ``micro_batch_size`` sequences; ``state_dict()`` must capture
        the data position so that a resumed run continues with the very next batch.
        """
        raise NotImplementedError("a recipe must define prepare_data()")

    def prepare_eval_data(self) -> list[Batch] | None:
        """This rank's fixed evaluation batches, or None for no evaluation."""
        return None

    def prepare_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        optim = self.config.optim
        return torch.optim.AdamW(
            model.parameters(),
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=True,  # one kernel for the whole update (CPU and CUDA)
        )

    def prepare_scheduler(
        self, optimizer: torch.optim.Optimizer
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """Linear warm-up, then cosine decay to ``optim.min_lr_ratio`` of the peak."""
        warmup = self.config.optim.warmup_steps
        total = self.config.train.max_steps
        floor = self.config.optim.min_lr_ratio

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    def compute_loss(self, batch: Batch) -> torch.Tensor:
        """The *sum* of per-token losses of a micro-batch (the engine normalises it)."""
        raise NotImplementedError("a recipe must define compute_loss()")

    def count_loss_tokens(self, batch: Batch) -> int:
        """Tokens the loss is over in a micro-batch: labels that are not ``IGNORE_INDEX``. What
        ``loss_tokens_per_s`` and ``loss_tokens_seen`` count (``tokens_per_s`` and ``tokens_seen``
        count every position that is not padding: an SFT prompt is read, not learnt)."""
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def count_padding(self, batch: Batch) -> int:
        """Padding positions of a micro-batch (what ``padding_frac`` counts): positions that hold
        the tokenizer's pad token and are not learnt; without a known pad token, the zeros of the
        ``attention_mask``. Masked prompt tokens are not padding: they are computed, only not
        learnt."""
        ids, labels = batch.get("input_ids"), batch.get("labels")
        # The recipe's tokenizer as it built it (a cached ``tokenizer``, or a ``processor``'s).
        tokenizer = self.__dict__.get("tokenizer") or getattr(self.__dict__.get("processor"), "tokenizer", None)
        pad = getattr(tokenizer, "pad_token_id", None)
        if isinstance(pad, int) and isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor) \
                and labels.shape == ids.shape:
            return int(((ids == pad) & (labels == IGNORE_INDEX)).sum())
        mask = batch.get("attention_mask")
        return int((mask == 0).sum()) if isinstance(mask, torch.Tensor) else 0

    def count_loss_units(self, batch: Batch) -> int:
        """What ``compute_loss`` sums over in a micro-batch; the engine divides the global sum by
        their global number. Default: the supervised tokens. A recipe whose loss is a sum over
        something else (preference pairs) overrides this, and ``count_loss_tokens`` still counts tokens."""
        return self.count_loss_tokens(batch)

    def flops_per_token(self) -> float | None:
        """Training FLOPs per token, for MFU. Recipes with attention should add its term."""
        return 6.0 * non_embedding_params(self.model)  # DTensor.numel() is the global size

    def before_optimizer_step(self, ctx: StepContext) -> bool:
        """Called after backward and clipping; return False to skip this optimizer step."""
        return True

    def hf_model(self):
        """The trained model as a Hugging Face ``PreTrainedModel`` (unwrapped), for ``export``,
        ``sample`` and ``evaluate`` (``python -m engine.model_io``). The default: ``self.model``
        when it is one; a recipe whose model is wrapped (a policy inside a DPO trainer, a
        hand-written module) overrides this."""
        from transformers import PreTrainedModel

        model = getattr(self.model, "_orig_mod", self.model)  # a whole-model torch.compile
        if isinstance(model, PreTrainedModel):
            return model
        raise ConfigError(
            f"the recipe's model is a {type(model).__name__}, not a transformers PreTrainedModel; "
            "define hf_model() in the recipe to return the Hugging Face model to export"
        )

    def hf_processing(self):
        """The tokenizer or processor saved beside the model (``save_pretrained``), or None."""
        return None

    def sample_inputs(self, index: int, prompt: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """``sample``'s ``generate()`` inputs for its ``index``-th prompt (``input_ids`` and
        more), for a model that needs more than the prompt's tokens (a vision-language recipe
        shows it a held-out image), and what the answer shows beside them: ``{"input": what
        was added, "expected": the answer the data holds}`` (strings; either may be left out).
        None (the default): the prompt is text for the tokenizer. A recipe that takes the user's
        image adds a keyword parameter ``image`` (a file's path; ``sample(images=[...])``)."""
        return None

    def task_metrics(self) -> dict[str, float]:
        """The recipe's task metrics on held-out data (``evaluate`` reports them beside the
        eval loss); each value a float. Called with the model in eval mode, under no_grad."""
        return {}

    def warn(self, message: str) -> None:
        """Tell the user once: a line in the console log and an entry in run.json's ``warnings``
        (``get_run`` shows them). For things the run works around, such as a GPU-only feature
        asked for on a CPU."""
        if message in self._warned:
            return
        self._warned.add(message)
        if self.dist.is_main:
            print(f"warning: {message}", flush=True)
            if self.run_dir is not None:
                rd.append_warning(self.run_dir, message)

    @classmethod
    def summarize_data(cls, config: EngineConfig) -> rd.DataSummary | None:
        """What a run of this config trains on — source, documents, tokens, train/eval split —
        counted before the run starts: ``launch_run`` returns it and run.json keeps it, so an
        agent sees the data it asked for; its ``fingerprint`` and ``skipped`` come from the
        :class:`~engine.data_files.DataListing` the count read through. Raise ``ConfigError`` (or let ``OSError`` through)
        for data that cannot be read; the launch is then refused."""
        return None

    @classmethod
    def validate_config(cls, config: EngineConfig, world_size: int) -> None:
        """Checks that need the world size; raise ``ConfigError`` with the key to change."""
        tp, sp = config.parallel.tp, config.parallel.sp
        if world_size % tp:
            raise ConfigError(
                f"parallel.tp={tp} does not divide the number of processes ({world_size})"
            )
        if sp > 1:
            check_sequence_parallel_config(config, world_size)
        dp = world_size // (tp * sp)
        per_step = dp * config.train.grad_accum
        if config.data.batch_size % per_step:
            raise ConfigError(
                f"data.batch_size={config.data.batch_size} must be a multiple of "
                f"data-parallel ranks × train.grad_accum = {dp} × {config.train.grad_accum}"
            )

    # ----------------------------------------------------------------------------------------
    # Derived values
    # ----------------------------------------------------------------------------------------

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch on this rank."""
        return self.config.data.batch_size // (self.dist.dp_size * self.config.train.grad_accum)

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.config.parallel.param_dtype]

    # ----------------------------------------------------------------------------------------
    # Lifecycle
    # ----------------------------------------------------------------------------------------

    def run(self) -> None:
        self.before_train()
        failed = True
        try:
            self.do_train()
            self.after_train()
            failed = False
        finally:
            self.logger.close(failed=failed)

    def before_train(self) -> None:
        torch.manual_seed(self.config.train.seed)
        self.model = self.prepare_model()
        if self.config.parallel.tp > 1 and not has_tensor_parallel_params(self.model):
            raise ConfigError(
                f"parallel.tp={self.config.parallel.tp} but prepare_model() applied no tensor "
                "parallelism; apply the tensor-parallel skill to the recipe, or set parallel.tp=1"
            )
        if self.config.parallel.sp > 1 and not has_sequence_parallel_attention(self.model):
            raise ConfigError(
                f"parallel.sp={self.config.parallel.sp} but prepare_model() applied no sequence "
                "parallelism; apply the sequence-parallel skill to the recipe, or set parallel.sp=1"
            )
        self.optimizer = self.prepare_optimizer(self.model)
        check_optimizer_choice(self.config.optim, self.optimizer)
        self.scheduler = self.prepare_scheduler(self.optimizer)
        self.train_batches = self.prepare_data()
        self.eval_batches = self.prepare_eval_data()
        self.confirm_data()
        self._flops_per_token = self.flops_per_token()
        self._peak_flops = peak_flops(
            self.device, self.compute_dtype, self.config.metrics.peak_tflops
        )

        if self.run_dir is not None:
            self.checkpointer = Checkpointer(
                self.run_dir / rd.CHECKPOINTS_DIRNAME,
                keep_last=self.config.checkpoint.keep_last,
                is_main=self.dist.is_main,
            )
        if self.resume_from is not None:
            self.load_checkpoint(self.resume_from)
        self.logger = MetricLogger(self.make_metric_backends())
        if self.dist.is_main and self.run_dir is not None:
            destinations = [getattr(b, "destination", None) for b in self.logger.backends]
            rd.update_run(self.run_dir, metrics_destinations=[d for d in destinations if d is not None])

    def confirm_data(self) -> None:
        """Make run.json's data summary the data this run loaded. The launch check counted the
        data files and fingerprinted them (:mod:`engine.data_files`); when the files the loader
        listed (``self.data_listing``) differ from that fingerprint, or changed while they were loaded, the data is
        counted again now, run.json records the new count and a warning says what changed."""
        if not self.dist.is_main or self.run_dir is None:
            return
        counted = rd.read_run(self.run_dir).data
        changed = self.data_listing.changed()
        loaded = self.data_listing.fingerprint()
        if not changed and (counted is None or loaded is None or loaded == counted.fingerprint):
            return
        summary = type(self).summarize_data(self.config)
        if summary is None:
            return
        if not changed and counted is not None and summary.fingerprint == counted.fingerprint:
            return  # the loader lists other files than the count does; the counted ones are unchanged
        rd.update_run(self.run_dir, data=summary)
        before = f"the launch check counted {counted.describe()}" if counted is not None else "nothing was counted"
        during = (
            f"; {changed[0].name} ({len(changed)} file(s) in all) changed while the run loaded it, so it may have "
            "read either version" if changed else ""
        )
        self.warn(f"the data changed after the launch check: {before}; the run counted again as it "
                  f"started: {summary.describe()}{during}")

    def make_metric_backends(self) -> list[MetricBackend]:
        """Rank 0's backends: the console, metrics.jsonl, TensorBoard when installed, and those
        of ``metrics.backends`` (W&B, MLflow, trackio); a backend's ``destination`` is recorded
        in run.json, where ``get_run`` shows it."""
        if not self.dist.is_main:
            return []
        backends: list[MetricBackend] = [ConsoleBackend(self.config.train.max_steps)]
        if self.run_dir is not None:
            backends.append(JsonlBackend(self.run_dir / rd.METRICS_JSONL))
            if self.config.metrics.tensorboard and tensorboard_available():
                backends.append(TensorBoardBackend(self.run_dir / "tensorboard"))
            backends += open_backends(self.config, self.run_dir)
        return backends

    def do_train(self) -> None:
        cfg = self.config
        self.model.train()
        window_start, window = time.perf_counter(), Window()
        # Evaluations and checkpoints inside a window are not training time (an evaluation of a
        # compiled model compiles its own graphs first): their seconds are left out of the
        # window's, and the steps around them keep theirs.
        window_paused = 0.0
        while self.state.step < cfg.train.max_steps:
            ctx = self.train_step()
            window.add(ctx)
            step = self.state.step

            if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
                self._synchronize()
                window.elapsed = time.perf_counter() - window_start - window_paused
                self.log_step(ctx, window)
                window_start, window = time.perf_counter(), Window()
                window_paused = 0.0

            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and self.eval_batches:
                self._synchronize()  # the step's own work is done before the pause is timed
                paused = time.perf_counter()
                self.logger.log({"step": step, "eval_loss": self.evaluate()})
                window_paused += time.perf_counter() - paused

            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                self._synchronize()
                paused = time.perf_counter()
                self.save_checkpoint()
                window_paused += time.perf_counter() - paused

    def after_train(self) -> None:
        if self.config.checkpoint.at_end and self.checkpointer is not None:
            final = run_checkpoints.checkpoint_dir_name(self.state.step)
            if not (self.checkpointer.root / final).exists():
                self.save_checkpoint()

    # ----------------------------------------------------------------------------------------
    # One step
    # ----------------------------------------------------------------------------------------

    def train_step(self) -> StepContext:
        timings: dict[str, float] = {}
        start = time.perf_counter()
        micro_batches = [
            self.to_device(next(self.train_batches)) for _ in range(self.config.train.grad_accum)
        ]
        counts = torch.tensor(
            [
                sum(self.count_loss_tokens(mb) for mb in micro_batches),
                sum(mb["input_ids"].numel() for mb in micro_batches),
                sum(self.count_loss_units(mb) for mb in micro_batches),
                sum(self.count_padding(mb) for mb in micro_batches),
            ],
            dtype=torch.int64,
            device=self.device,
        )
        num_loss_tokens, num_positions, loss_units, num_padding = (int(x) for x in dp_all_reduce_sum(counts, self.dist))
        timings["data_s"] = time.perf_counter() - start

        start = time.perf_counter()
        # Gradients of sum(loss)/global_loss_units. FSDP2 averages gradients over the dp (× sp)
        # ranks, so each rank scales by their number to turn that average back into a sum.
        scale = self.dist.fsdp_size / max(1, loss_units)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for micro_batch in micro_batches:
            micro_loss = self.compute_loss(micro_batch)
            (micro_loss * scale).backward()
            loss_sum += micro_loss.detach().float()
        loss = dp_all_reduce_sum(loss_sum, self.dist) / max(1, loss_units)
        timings["fwd_bwd_s"] = time.perf_counter() - start

        start = time.perf_counter()
        ctx = StepContext(
            step=self.state.step + 1,
            num_tokens=num_positions - num_padding,
            num_positions=num_positions,
            loss=loss,
            timings=timings,
            num_padding=num_padding,
            num_loss_tokens=num_loss_tokens,
        )
        ctx.grad_norm = clip_grad_norm(self.model.parameters(), self.config.train.max_grad_norm)
        if self.before_optimizer_step(ctx):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state.step += 1
        self.state.tokens_seen += ctx.num_tokens
        self.state.loss_tokens_seen += num_loss_tokens
        timings["optim_s"] = time.perf_counter() - start
        return ctx

    def to_device(self, batch: Batch) -> Batch:
        if self.device.type == "cpu":
            return batch
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the evaluation batches. Compiled modules run eagerly here: without
        gradients they would compile a graph of their own (a recompilation that stalls the run
        in its middle, tens of seconds on CPU) for a few batches."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        with torch.compiler.set_stance("force_eager"):
            for batch in self.eval_batches or []:
                batch = self.to_device(batch)
                totals[0] += self.compute_loss(batch).double()
                totals[1] += self.count_loss_units(batch)
        dp_all_reduce_sum(totals, self.dist)
        self.model.train()
        return float(totals[0] / totals[1].clamp(min=1))

    # ----------------------------------------------------------------------------------------
    # Metrics
    # ----------------------------------------------------------------------------------------

    def log_step(self, ctx: StepContext, window: Window) -> None:
        """Log the record of ``window``, whose last step is ``ctx``."""
        step_time = window.elapsed / max(1, window.steps)
        peaks = gathered_peaks(self.device, self.dist)
        record = run_metrics.MetricRecord(
            step=self.state.step,
            loss=float(ctx.loss),
            lr=self.scheduler.get_last_lr()[0],
            grad_norm=float(ctx.grad_norm) if ctx.grad_norm is not None else None,
            tokens_per_s=window.per_second(window.tokens),
            loss_tokens_per_s=window.per_second(window.loss_tokens),
            step_time_s=step_time,
            peak_mem_mb=busiest_peak_mb(peaks),
            **peaks,
            **{k: round(v, 6) for k, v in ctx.timings.items()},
            tokens_seen=self.state.tokens_seen,
            loss_tokens_seen=self.state.loss_tokens_seen,
            padding_frac=ctx.num_padding / max(1, ctx.num_positions),
            eta_s=step_time * (self.config.train.max_steps - self.state.step),
        )
        if self._flops_per_token and self._peak_flops and window.elapsed > 0:
            achieved = self._flops_per_token * window.per_second(window.positions)
            record.mfu = achieved / (self._peak_flops * self.dist.world_size)
        self.logger.log(record.model_dump(exclude_none=True))
        self.suggest_skills(record)

    def suggest_skills(self, record: run_metrics.MetricRecord) -> None:
        """Once per run, the skill that fits what a step measured: sequence-packing when over
        30% of the positions were padding, gradient-checkpointing when the peak memory is over
        85% of what the process may use (a warning: console and ``get_run``)."""
        hinted = self.__dict__.setdefault("_hinted", set())  # each hint once, whatever its numbers
        if (record.padding_frac or 0) > PACKING_HINT_PADDING and "packing" not in hinted:
            hinted.add("packing")
            if hint := self.packing_hint():
                self.warn(f"{record.padding_frac:.0%} of the positions of step {record.step} were padding: {hint}")
        limit = _memory_limit_mb(self.device)
        if limit and record.peak_mem_mb and record.peak_mem_mb > CHECKPOINTING_HINT_MEMORY * limit \
                and "checkpointing" not in hinted:
            hinted.add("checkpointing")
            self.warn(f"peak memory {record.peak_mem_mb:,.0f} MB is {record.peak_mem_mb / limit:.0%} of the "
                      f"{limit:,.0f} MB this process may use: the gradient-checkpointing skill trades compute "
                      "for activation memory (apply_skill gradient-checkpointing)")

    def packing_hint(self) -> str | None:
        """What a run with much padding is told to do (None: nothing); a template that packs by a
        config key of its own names that key instead of the skill."""
        return "the sequence-packing skill fills each row with whole examples (apply_skill sequence-packing)"

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ----------------------------------------------------------------------------------------
    # Checkpoints
    # ----------------------------------------------------------------------------------------

    def checkpoint_states(self) -> dict[str, Any]:
        """Everything a checkpoint holds; each value is ``Stateful``."""
        return {
            "model_optim": ModelOptimizerState(self.model, self.optimizer),
            "scheduler": SchedulerState(self.scheduler),
            "train": self.state,
            "data": self.train_batches,
            "rng": RNGState(self.config.train.seed, lambda: self.state.step),
        }

    def save_checkpoint(self) -> Path | None:
        if self.checkpointer is None:
            return None
        return self.checkpointer.save(self.state.step, self.checkpoint_states())

    def load_checkpoint(self, path: Path) -> None:
        def before_load(saved: set[str] | None) -> None:
            self.state.with_loss_tokens = saved is None or "train.loss_tokens_seen" in saved

        try:
            load_checkpoint(path, self.checkpoint_states(), before_load)
        finally:
            self.state.with_loss_tokens = True
        if self.dist.is_main:
            print(f"resumed from {path} at step {self.state.step}", flush=True)


PACKING_HINT_PADDING = 0.30
CHECKPOINTING_HINT_MEMORY = 0.85


def _memory_limit_mb(device: torch.device) -> float | None:
    """What a process may use: the GPU's memory, else the smaller of the address-space limit
    (runs.max_memory) and the machine's memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    limits = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft not in (resource.RLIM_INFINITY, -1) and soft > 0:
        limits.append(soft / 2**20)
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)
    except (ValueError, OSError):
        pass
    return min(limits) if limits else None


def is_compiled(model: nn.Module | None) -> bool:
    """Whether torch.compile compiles any of ``model``: a whole-model wrapper
    (``torch.compile(model)``) or a module compiled in place (``Module.compile``: the
    torch-compile skill's blocks, or its ``scope: model``). Such a model compiles a graph per
    input shape it meets (None: no model built yet, nothing compiled)."""
    if model is None:
        return False
    return hasattr(model, "_orig_mod") or any(
        getattr(module, "_compiled_call_impl", None) is not None for module in model.modules())
