"""``wait_run``: wait, without blocking anything else, until a run reaches a step or ends.

One definition for the MCP tool (progress notifications) and the CLI (lines on stderr). The
wait sleeps with anyio between short reads of run.json and the end of metrics.jsonl, so the
server keeps answering other calls meanwhile; it is bounded by ``MAX_WAIT_S``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import anyio

from engine import run_dir as rd
from engine import run_metrics
from workspace.workspace import has_record
from mcp_server.limits import DEFAULT_WAIT_S, MAX_ERROR_CHARS, POLL_S
from mcp_server.models import WaitRunResult
from mcp_server.operations.runs import bounded_record
from runner import slurm as slurm_jobs
from sandbox.environment import run_environment
from workspace.workspace import Workspace

SLURM_POLL_S = 15.0  # squeue/sacct at most this often while waiting on a SLURM job


@dataclass(frozen=True)
class Observation:
    status: str
    ended: bool
    step: int | None
    max_steps: int | None
    latest: dict[str, Any] | None
    error: str | None
    preparing: str | None = None  # the run's first phase, tokenizing its data, while it lasts

    def progress_message(self) -> str:
        if self.preparing is not None and self.step is None and not self.ended:
            return self.preparing
        message = f"step {self.step if self.step is not None else 0}/{self.max_steps or '?'}"
        loss = run_metrics.finite_number((self.latest or {}).get("loss"))
        if loss is not None:
            message += f", loss {loss:.4f}"
        return message if not self.ended else f"{message} ({self.status})"


def observe(ws: Workspace, run_id: str) -> Observation:
    """The run as it is now. It has ended once its status is final and its supervisor has
    recorded the exit code (or is gone)."""
    from mcp_server.operations.runs import known_run

    run_dir = ws.run_dir(run_id)
    if has_record(ws.root, run_id):  # a SLURM job the server submitted; other runs: as is
        slurm_jobs.refresh(ws.record_dir(run_id), run_environment(), min_interval_s=SLURM_POLL_S)
    _, record = known_run(ws, run_id)
    status = record.effective_status()
    ended = status in rd.FINAL_STATUSES and (record.exit_code is not None or not record.supervisor_alive())
    latest = run_metrics.latest_metrics(run_dir / rd.METRICS_JSONL)
    step = latest.get("step") if latest else None
    error = record.error or record.reason
    return Observation(
        status=status, ended=ended, step=step if isinstance(step, int) else None,
        max_steps=record.max_steps, latest=latest,
        error=str(error)[:MAX_ERROR_CHARS] if error and status != rd.COMPLETED else None,
        preparing=record.data.preparing.describe() if record.data is not None and record.data.preparing else None,
    )


async def wait_run(
    ws: Workspace,
    run_id: str,
    until_step: int | None = None,
    timeout_s: float = DEFAULT_WAIT_S,
    on_progress: Callable[[Observation], Awaitable[None]] | None = None,
    poll_s: float = POLL_S,
) -> WaitRunResult:
    """Return when the run has logged ``until_step`` (reached_step), has ended (ended), or
    ``timeout_s`` has passed (timeout); ``on_progress`` hears of each new step on the way."""
    ws.run_dir(run_id)  # an unknown run fails at once
    started = anyio.current_time()
    reported: tuple[int | None, str | None] | None = None
    while True:
        now = await anyio.to_thread.run_sync(observe, ws, run_id)
        if on_progress is not None and (now.step, now.preparing) != reported:
            reported = (now.step, now.preparing)
            await on_progress(now)
        waited = anyio.current_time() - started
        if until_step is not None and now.step is not None and now.step >= until_step:
            reason = "reached_step"
        elif now.ended:
            reason = "ended"
        elif waited >= timeout_s:
            reason = "timeout"
        else:
            await anyio.sleep(min(poll_s, timeout_s - waited))
            continue
        return WaitRunResult(
            run_id=run_id, reason=reason, status=now.status, step=now.step, max_steps=now.max_steps,
            waited_s=round(waited, 2), latest=bounded_record(now.latest) if now.latest else None,
            error=now.error,
        )
