"""``compare_runs``: what differs between two runs, and whether each difference in their
metrics is larger than the noise of their own logged windows.

Every verdict is b's against a's, with the numbers behind it:

- **loss / eval_loss** at equal tokens seen: each curve is interpolated linearly on a common
  grid of tokens seen (where both runs have been); the verdict is on the mean difference over
  the grid, against a noise bound of 2 × the two curves' noise together (each record's scatter
  about the line through its neighbours: :func:`_curve_noise`). The bound is not divided by the
  number of records: two seeds differ by about a record's noise all along the curve, and that is
  no difference. Bit-equal curves are said to be so.
- **reward** (a reinforcement-learning run's total reward, e.g. the grpo template's), the same
  way, where both runs log it; higher is better.
- **tokens_per_s / step_time_s**: the median over the logging windows after the first (the
  warm-up); the spread is the interquartile range. The noise bound is the sum of the two runs'
  half-IQRs relative to their medians, at least :data:`MIN_SPEED_NOISE`: a ratio inside
  1 ± bound is "no difference".
- **peak_mem_mb**: the largest figure any record measured (:mod:`engine.memory`); a change within
  :data:`MEMORY_NOISE` is "no difference" (allocators and page sizes move a peak a little).

The whole run, beside the steady state (a skill faster per step can make a short run slower):

- **first_step_s**: seconds from the process's start to the end of its first step (start-up,
  data, compilation): the first record's ``elapsed_s`` less its later steps at the steady step
  time. **wall_s**: the server's own times of a completed run, from launch to end, where both
  ran to the same step. One figure per run, so the noise bound is :data:`WHOLE_RUN_NOISE` (the
  spread of one run's time between rounds on a busy machine), or the sides' own spread where
  each has several runs.
- **steps_to_loss**: the first logged step at which each run's loss is at most the higher of
  the two runs' final losses (the mean of their last three records), and the seconds to it; a
  difference within the logging interval is "no difference".

What the runs do not share is left out and named: loss needs the same data (its fingerprint and
summary) and the same kind of recipe (the same config sections); step time needs steps of the
same work (``data.batch_size``, ``data.seq_len``, ``train.grad_accum``).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import math
import statistics
from pathlib import Path
from typing import Any

from engine import run_dir as rd
from engine import run_metrics
from runner import server_record as sr
from mcp_server.limits import AGENT_BUDGET_CHARS, json_chars
from mcp_server.models import CompareResult, MetricVerdict, Verdict
from mcp_server.operations import history
from mcp_server.operations.runs import known_run
from workspace import git as workspace_git
from workspace.workspace import Workspace

MIN_SPEED_NOISE = 0.03
MEMORY_NOISE = 0.03
WHOLE_RUN_NOISE = 0.15
FINAL_RECORDS = 3
GRID_POINTS = 16
MIN_WINDOWS = 2
MAX_DIFFERENCES = 25
MAX_DIFFERENCE_CHARS = 200
STEP_WORK_KEYS = ("data.batch_size", "data.seq_len", "train.grad_accum")


def compare_runs(ws: Workspace, run_a: str, run_b: str) -> CompareResult:
    return compare_groups(ws, [run_a], [run_b])


def compare_groups(ws: Workspace, runs_a: list[str], runs_b: list[str]) -> CompareResult:
    """b against a where each side is one run or several of the same config (the rounds of an
    A/B, :mod:`mcp_server.operations.ab`). The differences are those of each side's first run;
    a side's loss curve is the mean of its runs' (bit-equal runs: that curve, unchanged); its
    speed windows are pooled over its runs (each run's warm-up left out), so the noise bound
    holds the load's changes between rounds; its peak is the largest any of them measured."""
    known_a = [known_run(ws, run) for run in runs_a]
    known_b = [known_run(ws, run) for run in runs_b]
    (dir_a, record_a), (dir_b, record_b) = known_a[0], known_b[0]
    config_a, config_b = _flat(record_a.config or {}), _flat(record_b.config or {})
    differences = _code_differences(ws, record_a, record_b, dir_a, dir_b) + [
        f"{key}: {_shown(config_a.get(key, '(absent)'))} → {_shown(config_b.get(key, '(absent)'))}"
        for key in sorted(set(config_a) | set(config_b)) if config_a.get(key) != config_b.get(key)
    ]
    left_out: list[str] = []
    metrics: list[MetricVerdict] = []

    why_not_loss = _loss_incomparable(record_a, record_b, config_a, config_b)
    if why_not_loss:
        left_out.append(f"loss, eval_loss: {why_not_loss}")
    else:
        chains_a = [history.chain_records(ws, run)[0] for run in runs_a]
        chains_b = [history.chain_records(ws, run)[0] for run in runs_b]
        for metric in ("loss", "eval_loss", *HIGHER_IS_BETTER_CURVES):
            curve_a = _pooled_curve([_curve(r, metric) for r in chains_a])
            curve_b = _pooled_curve([_curve(r, metric) for r in chains_b])
            if metric in HIGHER_IS_BETTER_CURVES and not (curve_a or curve_b):
                continue  # not a reinforcement-learning run: nothing to say
            verdict = compare_curves(metric, curve_a, curve_b, higher_is_better=metric in HIGHER_IS_BETTER_CURVES)
            if verdict is None:
                left_out.append(f"{metric}: not logged by both runs over common tokens")
            else:
                metrics.append(verdict)

    own_a = [run_metrics.read_all_metrics(folder / rd.METRICS_JSONL) for folder, _ in known_a]
    own_b = [run_metrics.read_all_metrics(folder / rd.METRICS_JSONL) for folder, _ in known_b]

    def windows(own: list[list[dict[str, Any]]], key: str) -> list[float]:
        return [value for records in own for value in _windows(records, key)]

    kind = rd.SCRIPT if rd.SCRIPT in (record_a.kind, record_b.kind) else rd.RECIPE
    metrics.append(compare_windows("tokens_per_s", windows(own_a, "tokens_per_s"),
                                   windows(own_b, "tokens_per_s"), higher_is_better=True, kind=kind))
    differing_work = [key for key in STEP_WORK_KEYS if config_a.get(key) != config_b.get(key)]
    if differing_work:
        left_out.append(f"step_time_s: the steps hold different work ({', '.join(differing_work)} differ)")
    else:
        metrics.append(compare_windows("step_time_s", windows(own_a, "step_time_s"),
                                       windows(own_b, "step_time_s"), higher_is_better=False, kind=kind))
    metrics.append(compare_peaks(_peaks([r for records in own_a for r in records]),
                                 _peaks([r for records in own_b for r in records])))
    if differing_work:
        left_out.append("first_step_s, wall_s, steps_to_loss: the steps hold different work")
    else:
        _whole_run(known_a, known_b, own_a, own_b, metrics, left_out, loss=not why_not_loss)
    return _fit(CompareResult(run_a=", ".join(record.id for _, record in known_a),
                              run_b=", ".join(record.id for _, record in known_b),
                              differences=differences, metrics=metrics, left_out=left_out))


# ---------------------------------------------------------------------------------------------
# Verdicts (each takes plain numbers: the rules above, testable without a run)
# ---------------------------------------------------------------------------------------------


HIGHER_IS_BETTER_CURVES = ("reward",)  # compared at equal tokens seen, as the loss


def compare_curves(metric: str, curve_a: list[tuple[float, float]], curve_b: list[tuple[float, float]],
                   higher_is_better: bool = False) -> MetricVerdict | None:
    """Lower is better (higher with ``higher_is_better``). ``curve``: (tokens seen, value) in
    order; None without a common range."""
    if len(curve_a) < 1 or len(curve_b) < 1:
        return None
    low, high = max(curve_a[0][0], curve_b[0][0]), min(curve_a[-1][0], curve_b[-1][0])
    if high < low:
        return None
    grid = [low + (high - low) * i / (GRID_POINTS - 1) for i in range(GRID_POINTS)] if high > low else [low]
    values_a = [_interpolate(curve_a, x) for x in grid]
    values_b = [_interpolate(curve_b, x) for x in grid]
    mean_a, mean_b = statistics.fmean(values_a), statistics.fmean(values_b)
    difference = mean_b - mean_a
    where = f"over {_count(low)}-{_count(high)} tokens seen ({len(grid)} grid points)"
    in_range = min(sum(low <= t <= high for t, _ in curve_a), sum(low <= t <= high for t, _ in curve_b))
    if values_a == values_b:
        return MetricVerdict(metric=metric, verdict="no difference", a=_round(mean_a), b=_round(mean_b), ratio=1.0,
                             evidence=f"bit-equal {where}")
    noise = math.hypot(_curve_noise(curve_a), _curve_noise(curve_b))
    bound = 2 * noise
    verdict: Verdict = "no difference"
    if abs(difference) > bound:
        verdict = "better" if (difference > 0) == higher_is_better else "worse"
    return MetricVerdict(
        metric=metric, verdict=verdict, a=_round(mean_a), b=_round(mean_b), ratio=_ratio(mean_b, mean_a),
        evidence=f"mean difference {difference:+.4g} {where}; noise bound ±{bound:.3g} "
                 f"(noise about the trend {noise:.3g}, {in_range} records)",
    )


LOG_MORE = {rd.RECIPE: "log more often: train.log_every",
            rd.SCRIPT: "the script's metric lines are its windows: print one more often"}


def compare_windows(metric: str, windows_a: list[float], windows_b: list[float], higher_is_better: bool,
                    kind: rd.RunKind = rd.RECIPE) -> MetricVerdict:
    """Medians of the logging windows after the warm-up, against the IQR noise bound; too few
    windows are said how to get more for a run of ``kind``."""
    if len(windows_a) < MIN_WINDOWS or len(windows_b) < MIN_WINDOWS:
        return MetricVerdict(metric=metric, verdict="not compared", evidence=(
            f"{len(windows_a)} and {len(windows_b)} window(s) after the warm-up; at least {MIN_WINDOWS} each needed "
            f"({LOG_MORE[kind]})"))
    median_a, spread_a = _median_and_spread(windows_a)
    median_b, spread_b = _median_and_spread(windows_b)
    if median_a <= 0 or median_b <= 0:
        return MetricVerdict(metric=metric, verdict="not compared", evidence="a median of 0")
    bound = max(MIN_SPEED_NOISE, spread_a / 2 / median_a + spread_b / 2 / median_b)
    ratio = median_b / median_a
    verdict: Verdict = "no difference"
    if abs(math.log(ratio)) > math.log1p(bound):
        verdict = "better" if (ratio > 1) == higher_is_better else "worse"
    return MetricVerdict(
        metric=metric, verdict=verdict, a=_round(median_a), b=_round(median_b), ratio=_round(ratio),
        evidence=f"medians of {len(windows_a)} and {len(windows_b)} windows after the warm-up, IQR "
                 f"{spread_a:.4g} and {spread_b:.4g}; noise bound ±{bound:.1%}",
    )


def compare_totals(metric: str, values_a: list[float], values_b: list[float], what: str) -> MetricVerdict:
    """Lower is better: one figure per run, each side's median, against :data:`WHOLE_RUN_NOISE`
    or, where a side has several runs, its relative range."""
    median_a, median_b = statistics.median(values_a), statistics.median(values_b)
    if median_a <= 0 or median_b <= 0:
        return MetricVerdict(metric=metric, verdict="not compared", evidence="a figure of 0")
    spreads = [(max(v) - min(v)) / 2 / statistics.median(v) for v in (values_a, values_b) if len(v) > 1]
    bound = max([WHOLE_RUN_NOISE, sum(spreads)])
    ratio = median_b / median_a
    verdict: Verdict = "no difference"
    if abs(math.log(ratio)) > math.log1p(bound):
        verdict = "better" if ratio < 1 else "worse"
    runs = f"{len(values_a)} and {len(values_b)} runs" if len(values_a) + len(values_b) > 2 else "one run each"
    return MetricVerdict(metric=metric, verdict=verdict, a=_round(median_a), b=_round(median_b), ratio=_round(ratio),
                         evidence=f"{what}; {runs}, noise bound ±{bound:.0%}")


def compare_steps_to_loss(losses_a: list[tuple[int, float, float | None]], losses_b: list[tuple[int, float, float | None]]
                          ) -> MetricVerdict | None:
    """Lower is better. ``losses``: (step, loss, elapsed_s) in step order; None with too few."""
    if len(losses_a) < FINAL_RECORDS or len(losses_b) < FINAL_RECORDS:
        return None
    final = [statistics.fmean(loss for _, loss, _ in side[-FINAL_RECORDS:]) for side in (losses_a, losses_b)]
    target = max(final)
    reached = [next((step, seconds) for step, loss, seconds in side if loss <= target) for side in (losses_a, losses_b)]
    (step_a, seconds_a), (step_b, seconds_b) = reached
    resolution = max(_interval(losses_a), _interval(losses_b))
    verdict: Verdict = "no difference"
    if abs(step_b - step_a) > resolution:
        verdict = "better" if step_b < step_a else "worse"
    timed = f" (at {seconds_a:.1f} s and {seconds_b:.1f} s)" if seconds_a is not None and seconds_b is not None else ""
    return MetricVerdict(metric="steps_to_loss", verdict=verdict, a=step_a, b=step_b, ratio=_ratio(step_b, step_a),
                         evidence=f"first logged step with loss ≤ {target:.4g} (the higher final loss){timed}; "
                                  f"resolution ±{resolution} steps (the logging interval)")


def compare_peaks(peaks_a: tuple[float, list[float]] | None, peaks_b: tuple[float, list[float]] | None
                  ) -> MetricVerdict:
    """Lower is better. ``peaks``: (peak_mem_mb, each process's RSS peak)."""
    if peaks_a is None or peaks_b is None:
        return MetricVerdict(metric="peak_mem_mb", verdict="not compared", evidence="a run logged no peak memory")
    (peak_a, ranks_a), (peak_b, ranks_b) = peaks_a, peaks_b
    ratio = peak_b / peak_a if peak_a > 0 else math.inf
    verdict: Verdict = "no difference"
    if abs(ratio - 1) > MEMORY_NOISE:
        verdict = "better" if ratio < 1 else "worse"
    per_process = f"; RSS per process {_mb(ranks_a)} vs {_mb(ranks_b)}" if ranks_a and ranks_b else ""
    return MetricVerdict(metric="peak_mem_mb", verdict=verdict, a=_round(peak_a), b=_round(peak_b),
                         ratio=_round(ratio), evidence=f"busiest process's peak; noise bound ±{MEMORY_NOISE:.0%}{per_process}")


# ---------------------------------------------------------------------------------------------
# Reading the records
# ---------------------------------------------------------------------------------------------


def _windows(records: list[dict[str, Any]], key: str) -> list[float]:
    """The values of ``key`` in the logging windows after the first that has it (the warm-up)."""
    values = [run_metrics.finite_number(r.get(key)) for r in records]
    return [v for v in values if v is not None][1:]


def _whole_run(known_a: list[tuple[Path, sr.ServerRecord]], known_b: list[tuple[Path, sr.ServerRecord]],
               own_a: list[list[dict[str, Any]]], own_b: list[list[dict[str, Any]]], metrics: list[MetricVerdict],
               left_out: list[str], loss: bool) -> None:
    """The whole-run verdicts (module docstring), or why each is left out."""
    firsts_a, firsts_b = [_first_step_s(records) for records in own_a], [_first_step_s(records) for records in own_b]
    if None in firsts_a or None in firsts_b:
        left_out.append("first_step_s: a run's records carry no elapsed_s (it ran before they did)")
    else:
        metrics.append(compare_totals("first_step_s", firsts_a, firsts_b,  # type: ignore[arg-type]
                                      "seconds from the process's start to its first step's end (start-up, data, "
                                      "compilation)"))
    walls_a, walls_b = [_wall_s(record) for _, record in known_a], [_wall_s(record) for _, record in known_b]
    last_steps = {max((r["step"] for r in records), default=None) for records in own_a + own_b}
    if None in walls_a or None in walls_b:
        left_out.append("wall_s: a run has not completed")
    elif len(last_steps) != 1:
        left_out.append("wall_s: the runs ended at different steps")
    else:
        metrics.append(compare_totals("wall_s", walls_a, walls_b,  # type: ignore[arg-type]
                                      "seconds from launch to end, as the server recorded them"))
    rewarded = any(metric in r for records in own_a + own_b for r in records for metric in HIGHER_IS_BETTER_CURVES)
    if rewarded:
        left_out.append("steps_to_loss: a reinforcement-learning run's loss is no target (reward is compared)")
    elif loss and len(own_a) == len(own_b) == 1:
        verdict = compare_steps_to_loss(_losses(own_a[0]), _losses(own_b[0]))
        if verdict is None:
            left_out.append(f"steps_to_loss: fewer than {FINAL_RECORDS} loss records in a run")
        else:
            metrics.append(verdict)


def _first_step_s(records: list[dict[str, Any]]) -> float | None:
    """The first training record's ``elapsed_s`` less its steps after the first at the steady step time."""
    timed = [r for r in records if run_metrics.finite_number(r.get("elapsed_s")) is not None
             and run_metrics.finite_number(r.get("step_time_s")) is not None]
    if not timed:
        return None
    steady = _windows(timed, "step_time_s")
    step_time = statistics.median(steady) if steady else timed[0]["step_time_s"]
    return max(0.0, timed[0]["elapsed_s"] - max(0, timed[0]["step"] - 1) * step_time)


def _wall_s(record: sr.ServerRecord) -> float | None:
    if record.status != rd.COMPLETED:
        return None
    try:
        started, ended = (_dt.datetime.fromisoformat(stamp or "") for stamp in (record.created_at, record.ended_at))
    except ValueError:
        return None
    return (ended - started).total_seconds()


def _losses(records: list[dict[str, Any]]) -> list[tuple[int, float, float | None]]:
    found = [(r["step"], run_metrics.finite_number(r.get("loss")), run_metrics.finite_number(r.get("elapsed_s")))
             for r in records]
    return [(step, loss, seconds) for step, loss, seconds in found if loss is not None]


def _interval(losses: list[tuple[int, float, float | None]]) -> int:
    """The median number of steps between two loss records."""
    gaps = [b[0] - a[0] for a, b in zip(losses, losses[1:])]
    return int(statistics.median(gaps)) if gaps else 1


def _curve(records: list[dict[str, Any]], metric: str) -> list[tuple[float, float]]:
    """(tokens seen, value) of ``metric``; a record without ``tokens_seen`` (an evaluation) takes
    that of the training record of its step."""
    tokens_at = {r["step"]: r["tokens_seen"] for r in records if isinstance(r.get("tokens_seen"), int)}
    curve: dict[float, float] = {}
    for record in records:
        value, tokens = run_metrics.finite_number(record.get(metric)), tokens_at.get(record["step"])
        if value is not None and tokens is not None:
            curve[float(tokens)] = value
    return sorted(curve.items())


def _pooled_curve(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """One curve of a side's runs: the first when they are all equal, else their mean at every
    point of any of them inside the range they share."""
    if all(curve == curves[0] for curve in curves[1:]) or any(not curve for curve in curves):
        return curves[0] if all(curves) else []
    low, high = max(c[0][0] for c in curves), min(c[-1][0] for c in curves)
    grid = sorted({x for curve in curves for x, _ in curve if low <= x <= high})
    return [(x, statistics.fmean(_interpolate(curve, x) for curve in curves)) for x in grid]


def _peaks(records: list[dict[str, Any]]) -> tuple[float, list[float]] | None:
    peaks = [v for v in (run_metrics.finite_number(r.get("peak_mem_mb")) for r in records) if v is not None]
    if not peaks:
        return None
    per_rank: list[float] = []
    for record in records:
        ranks = record.get("rss_peak_mb")
        if isinstance(ranks, list) and all(run_metrics.finite_number(v) is not None for v in ranks):
            per_rank = [max(old, new) for old, new in zip(per_rank, ranks)] if len(per_rank) == len(ranks) else ranks
    return max(peaks), per_rank


def _loss_incomparable(a: rd.RunRecord, b: rd.RunRecord, config_a: dict[str, Any], config_b: dict[str, Any]
                       ) -> str | None:
    sections_a, sections_b = {k.split(".")[0] for k in config_a}, {k.split(".")[0] for k in config_b}
    if sections_a != sections_b or {k for k in config_a if k.startswith("model.")} != {
            k for k in config_b if k.startswith("model.")}:
        return "different kinds of recipe (their config keys differ)"
    data_a = a.data.model_dump(include={"source", "paths", "fingerprint", "tokenizer", "documents", "bytes"}) if a.data else None
    data_b = b.data.model_dump(include={"source", "paths", "fingerprint", "tokenizer", "documents", "bytes"}) if b.data else None
    if data_a != data_b:
        return "different data (the data summaries differ: source, paths, fingerprint, tokenizer, documents or bytes)"
    return None


def _code_differences(ws: Workspace, a: sr.ServerRecord, b: sr.ServerRecord, dir_a: Path, dir_b: Path) -> list[str]:
    lines = []
    if a.recipe != b.recipe:
        lines.append(f"recipe: {a.recipe} → {b.recipe}")
    if a.git_commit != b.git_commit:
        lines.append(f"commit: {(a.git_commit or 'none')[:12]} → {(b.git_commit or 'none')[:12]}")
    skills_a, skills_b = skills_of_run(ws, a), skills_of_run(ws, b)
    only_a, only_b = [s for s in skills_a if s not in skills_b], [s for s in skills_b if s not in skills_a]
    if only_a or only_b:
        lines.append(f"skills: only a: {', '.join(only_a) or 'none'}; only b: {', '.join(only_b) or 'none'}")
    if bool(a.recipe_dirty) != bool(b.recipe_dirty):
        lines.append(f"uncommitted changes: a {bool(a.recipe_dirty)}, b {bool(b.recipe_dirty)}")
    files_a, files_b = _snapshot_files(dir_a / rd.SNAPSHOT_DIRNAME), _snapshot_files(dir_b / rd.SNAPSHOT_DIRNAME)
    changed = sorted(name for name in set(files_a) | set(files_b) if files_a.get(name) != files_b.get(name))
    if changed:
        lines.append(f"code: {len(changed)} file(s) of the snapshots differ ({', '.join(changed[:5])})")
    start_a, start_b = _started_from(a), _started_from(b)
    if start_a != start_b:
        lines.append(f"started from: {start_a} → {start_b}")
    return lines


def _started_from(record: rd.RunRecord) -> str:
    """The checkpoint a run started from, as the server recorded it (a resume, or a launch that
    trains further from an earlier run's checkpoint), or that it started from scratch."""
    start = record.resumed_from or record.started_from
    return f"run {start.run_id} at step {start.step}" if start is not None else "scratch"


def skills_of_run(ws: Workspace, record: rd.RunRecord) -> list[str]:
    """Skills applied to the run's recipe, from the trailers of the commits up to its commit."""
    repo = workspace_git.open_repo(ws.root)
    if repo is None or not record.git_commit or not workspace_git.COMMIT_ID.fullmatch(record.git_commit) or not record.recipe:
        return []  # run.json is the run's to write: only a commit id is passed to git
    commits = workspace_git.path_commits(repo, ws.root / record.recipe, rev=record.git_commit)
    return [value for commit in reversed(commits) for key, value in commit.trailers
            if key == workspace_git.SKILL_APPLIED_TRAILER]


def _snapshot_files(folder: Path, limit: int = 200) -> dict[str, str]:
    found: dict[str, str] = {}
    if not folder.is_dir() or folder.is_symlink():
        return found
    for path in sorted(folder.rglob("*"))[:limit]:
        if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
            found[path.relative_to(folder).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _interpolate(curve: list[tuple[float, float]], x: float) -> float:
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[0][1] if x <= curve[0][0] else curve[-1][1]


def _curve_noise(curve: list[tuple[float, float]]) -> float:
    """The standard deviation of a curve's records about its local trend: each record's distance
    from the line through its two neighbours (for independent noise σ its spread is σ·√1.5), as a
    median absolute deviation (σ ≈ MAD / 0.6745), so a falling curve's slope is not noise."""
    residuals = []
    for (x0, y0), (x1, y1), (x2, y2) in zip(curve, curve[1:], curve[2:]):
        trend = y0 if x2 == x0 else y0 + (y2 - y0) * (x1 - x0) / (x2 - x0)
        residuals.append(abs(y1 - trend))
    return statistics.median(residuals) / 0.6745 / math.sqrt(1.5) if residuals else 0.0


def _median_and_spread(values: list[float]) -> tuple[float, float]:
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), quartiles[2] - quartiles[0]


def _ratio(b: float, a: float) -> float | None:
    return _round(b / a) if a else None


def _round(value: float) -> float:
    return float(f"{value:.5g}")


def _count(tokens: float) -> str:
    return f"{tokens:,.0f}"


def _mb(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:,.0f}" for v in values[:8]) + (", …" if len(values) > 8 else "") + "] MB"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _fit(result: CompareResult) -> CompareResult:
    """At most MAX_DIFFERENCES differences, each cut, so the result stays under 8 KB."""
    shown = [line if len(line) <= MAX_DIFFERENCE_CHARS else line[: MAX_DIFFERENCE_CHARS - 1] + "…"
             for line in result.differences[:MAX_DIFFERENCES]]
    if len(result.differences) > MAX_DIFFERENCES:
        shown.append(f"… {len(result.differences) - MAX_DIFFERENCES} more")
    result = result.model_copy(update={"differences": shown})
    while json_chars(result.model_dump()) > AGENT_BUDGET_CHARS and len(result.differences) > 1:
        result.differences = result.differences[: len(result.differences) // 2] + ["… (cut to fit 8 KB)"]
    return result
