"""A progress line per logged step: step, loss, learning rate, throughput and time left."""

from __future__ import annotations

import sys
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


# Keys the line shows in its own form, or leaves to metrics.jsonl (timings, counters).
SHOWN = frozenset({
    "step", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "loss_tokens_per_s", "loss_tokens_seen", "mfu", "peak_mem_mb", "eta_s", "step_time_s",
    "tokens_seen", "padding_frac", "data_s", "fwd_bwd_s", "optim_s", "time", "elapsed_s",
})
MAX_EXTRA = 6


class ConsoleBackend:
    def __init__(self, max_steps: int, stream: TextIO | None = None):
        self.max_steps = max_steps
        self.stream = stream or sys.stdout

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        width = len(str(self.max_steps))
        parts = [f"step {step:>{width}}/{self.max_steps}"]
        if "loss" in record:
            parts.append(f"loss {record['loss']:.4f}")
        if "eval_loss" in record:
            parts.append(f"eval_loss {record['eval_loss']:.4f}")
        if "lr" in record:
            parts.append(f"lr {record['lr']:.2e}")
        if "grad_norm" in record:
            parts.append(f"gnorm {record['grad_norm']:.3f}")
        if "tokens_per_s" in record:
            parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
            # Where the loss is over fewer tokens than were read (an SFT prompt), both are said.
            loss_rate = record.get("loss_tokens_per_s")
            if isinstance(loss_rate, (int, float)) and loss_rate < record["tokens_per_s"]:
                parts[-1] += f" ({loss_rate:,.0f} loss tok/s)"
        if record.get("mfu") is not None:
            parts.append(f"mfu {record['mfu']:.1%}")
        if "peak_mem_mb" in record:
            parts.append(f"mem {record['peak_mem_mb']:,.0f} MB")
        if "eta_s" in record:
            parts.append(f"eta {format_duration(record['eta_s'])}")
        extra = [f"{key} {value:.4g}" for key, value in record.items()
                 if key not in SHOWN and isinstance(value, (int, float)) and not isinstance(value, bool)]
        parts += extra[:MAX_EXTRA]  # a recipe's own values (DPO's rewards)
        if len(parts) == 1:
            return  # a record with nothing to show but its step
        print(" | ".join(parts), file=self.stream, flush=True)

    def close(self, failed: bool = False) -> None:
        pass
