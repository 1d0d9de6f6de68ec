"""Hostile calls to export_checkpoint (and its rename into place), sample and evaluate.

The server's side of an export — checks, staging folder, rename, listing — runs here with the
sandboxed model process replaced by a stand-in that writes into the staging folder it is given
(tests/mcp/test_model_tools.py and tests/engine/test_model_io.py run the real one; recipe code
in the sandbox: tests/sandbox/test_attack_model_process.py). No process is started here.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine import run_checkpoints
from engine.errors import BadInput, NotFound
from engine.seams import ExportOutcome, GeneratedSample
from mcp_server.arguments import SampleArgs
from mcp_server.operations import model_tools
from workspace.workspace import Workspace
from tests.sandbox.helpers import fake_run, make_workspace, tree_hash


@pytest.fixture
def ws(tmp_path, monkeypatch) -> Workspace:
    """A workspace with run r1 (two fake checkpoints and a snapshot) and a stand-in model process."""
    workspace = make_workspace(tmp_path / "ws")
    run = fake_run(workspace, "r1")
    (run / rd.SNAPSHOT_DIRNAME).mkdir()
    (run / rd.SNAPSHOT_DIRNAME / "recipe.py").write_text("# the run's code\n")
    (tmp_path / "outside").mkdir()
    monkeypatch.setattr(model_tools, "run_model_io", stand_in)
    return Workspace.open(workspace)


DURING: list = []  # what the stand-in does while "exporting" (a test's attack)


def stand_in(root, run_dir, action, step, arguments, limits, timeout_s, writable=None):
    staging = Path(arguments[arguments.index("--to") + 1])
    assert writable == [staging]
    (staging / "config.json").write_text("{}")
    for attack in DURING:
        attack(staging)
    return ExportOutcome(step=step, lora=None, tokenizer=None, parameters=1)


@pytest.fixture(autouse=True)
def no_attack():
    DURING.clear()
    yield
    DURING.clear()


def staging_left(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if model_tools.STAGING_MARK in p.name] if folder.is_dir() else []


@pytest.mark.parametrize("to", ["exports/" + "a" * 256, "exports/" + "𝔁" * 64, "exports/" + "é" * 128 + "/m", "exports/\ud800"])
def test_a_name_too_long_for_the_filesystem_is_a_clear_refusal(ws, to):
    before = tree_hash(ws.root)
    with pytest.raises(BadInput, match="too long|cannot be resolved"):
        model_tools.export_checkpoint(ws, "r1", to)
    assert tree_hash(ws.root) == before


def test_a_long_name_that_fits_gets_a_staging_folder_that_fits(ws):
    name = "𝔁" * 63  # 252 bytes: a valid name, but not with a staging mark around it
    assert model_tools.export_checkpoint(ws, "r1", f"exports/{name}").path == f"exports/{name}"
    assert staging_left(ws.root / "exports") == []


@pytest.mark.parametrize("to", ["recipes/lm/export", "recipes/lm/sub/dir", "recipes/new"])
def test_an_export_is_never_written_into_recipe_code(ws, to):
    # A model inside a recipe folder would be copied into every run's code snapshot and would
    # leave the recipe with uncommitted changes.
    before = tree_hash(ws.root)
    with pytest.raises(BadInput, match="recipes/"):
        model_tools.export_checkpoint(ws, "r1", to)
    assert tree_hash(ws.root) == before


def test_concurrent_exports_to_the_same_folder_give_one_export_and_clear_refusals(ws):
    DURING.append(lambda staging: time.sleep(0.3))
    outcomes: list = []

    def export():
        try:
            outcomes.append(model_tools.export_checkpoint(ws, "r1", "exports/same").path)
        except BadInput as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=export) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outcomes) == 3 and outcomes.count("exports/same") == 1, outcomes
    assert all("was written meanwhile" in o for o in outcomes if o != "exports/same"), outcomes
    assert sorted(p.name for p in (ws.root / "exports" / "same").iterdir()) == ["config.json"]
    assert staging_left(ws.root / "exports") == []


def test_a_destination_swapped_for_a_link_during_the_export_is_not_followed(ws, tmp_path):
    outside = tmp_path / "outside"
    (outside / "private.txt").write_text("host file")
    before = tree_hash(outside)
    DURING.append(lambda staging: (ws.root / "exports" / "m").symlink_to(outside))
    with pytest.raises(BadInput, match="was written meanwhile"):
        model_tools.export_checkpoint(ws, "r1", "exports/m")
    assert tree_hash(outside) == before
    assert staging_left(ws.root / "exports") == [] and (ws.root / "exports" / "m").is_symlink()


def test_a_parent_swapped_for_a_link_during_the_export_receives_nothing(ws, tmp_path):
    outside = tmp_path / "outside"
    (ws.root / "exports").mkdir()

    def swap(staging):
        os.rename(ws.root / "exports", ws.root / "moved")
        (ws.root / "exports").symlink_to(outside)

    DURING.append(swap)
    result = model_tools.export_checkpoint(ws, "r1", "exports/m")
    # The export lands in the folder that was checked (now moved), never in the link's target.
    assert list(outside.iterdir()) == []
    assert result.files == {"config.json": 2} and (ws.root / "moved" / "m" / "config.json").is_file()


@pytest.mark.parametrize("prompts, temperature, message", [
    (["a\ud800b"], 0.0, "prompt 0 is not valid text"),  # JSON may carry a lone surrogate; argv cannot
    (["ok", "\udcff"], 0.0, "prompt 1 is not valid text"),
    (["x"], 1e-300, "temperature must be"),  # logits / 1e-300 overflow: not the recipe's failure
    (["x"], 0.001, "temperature must be"),
])
def test_sample_requests_the_model_process_cannot_take_are_refused_before_it_starts(prompts, temperature, message):
    """Refused where sample's arguments are declared (SampleArgs, which both faces validate), by the
    checks the model process applies to its own command line."""
    with pytest.raises(BadInput, match=message):
        SampleArgs.checked(run_id="r1", prompts=prompts, temperature=temperature)


def test_the_smallest_and_largest_temperatures_are_taken():
    from engine.model_io import MIN_TEMPERATURE, check_sample_request

    for temperature in (0, 0.0, MIN_TEMPERATURE, 1, 5):
        check_sample_request(["x"], 8, temperature)


# What the model process hands back is the recipe's to write (its code runs in that process and
# can replace the result file): the server reads it through engine.seams.read_model_result, which
# refuses anything that is not the engine's result, naming the field, before anything is kept.
SAMPLED = {"ok": True, "step": 4, "temperature": 0.0, "chat": False,
           "samples": [{"prompt": "p", "completion": "c", "new_tokens": 1, "stopped": "eos"}]}
EVALUATED = {"ok": True, "step": 4, "eval_loss": 1.5, "perplexity": 4.48, "batches": 1, "split": "held_out",
             "examples": 40, "tokens": 400, "loss_tokens": 400, "scored_tokens": 400, "data": None, "metrics": {"acc": 0.5}}
EXPORTED = {"ok": True, "step": 4, "lora": None, "lora_layers": 0, "tokenizer": "T", "parameters": 10}


def one_sample(**fields) -> dict:
    return {**SAMPLED, "samples": [{**SAMPLED["samples"][0], **fields}]}


FORGED_RESULTS = [  # (action, what the process wrote, what the refusal says)
    ("sample", {**SAMPLED, "samples": "not a list"}, "no valid 'samples' (Input should be a valid list)"),
    ("sample", {**SAMPLED, "samples": [42]}, "no valid 'samples.0'"),
    ("sample", one_sample(new_tokens="many"), "no valid 'samples.0.new_tokens' (Input should be a valid integer)"),
    ("sample", one_sample(new_tokens=10**30), "no valid 'samples.0.new_tokens'"),
    ("sample", one_sample(stopped=["eos"]), "no valid 'samples.0.stopped'"),
    ("sample", one_sample(completion="c" * 900_000), "no valid 'samples.0.completion' (String should have at most"),
    ("sample", one_sample(expected={"a": 1}), "no valid 'samples.0.expected'"),
    ("sample", one_sample(shell="rm -rf /"), "a field the engine does not write: 'samples.0.shell'"),
    ("sample", {**SAMPLED, "samples": SAMPLED["samples"] * 9}, "no valid 'samples' (List should have at most 8"),
    ("sample", {**SAMPLED, "samples": SAMPLED["samples"] * 2}, "2 samples for 1 prompts"),
    ("sample", {k: v for k, v in SAMPLED.items() if k != "chat"}, "has no 'chat'"),
    ("evaluate", {**EVALUATED, "metrics": [1, 2]}, "no valid 'metrics' (Input should be a valid dictionary)"),
    ("evaluate", {**EVALUATED, "metrics": {"k" * 10**5: 1.0}}, "no valid 'metrics' (String should have at most 100"),
    ("evaluate", {**EVALUATED, "metrics": {"b": "x"}}, "no valid 'metrics' (Input should be a valid number)"),
    ("evaluate", {**EVALUATED, "metrics": {str(i): 1.0 for i in range(41)}}, "no valid 'metrics'"),
    ("evaluate", {**EVALUATED, "eval_loss": "nan"}, "no valid 'eval_loss'"),
    ("evaluate", {**EVALUATED, "eval_loss": float("nan")}, "no valid 'eval_loss' (Input should be a finite number)"),
    ("evaluate", {**EVALUATED, "tokens": -5}, "no valid 'tokens'"),
    ("evaluate", {**EVALUATED, "perplexity": True}, "no valid 'perplexity'"),
    ("evaluate", {k: v for k, v in EVALUATED.items() if k != "eval_loss"}, "has no 'eval_loss'"),
    ("export", {**EXPORTED, "lora": "x" * 10**5}, "no valid 'lora'"),
    ("export", {**EXPORTED, "tokenizer": ["a"] * 10**4}, "no valid 'tokenizer'"),
    ("export", {**EXPORTED, "tokenizer": "t" * 10**5}, "no valid 'tokenizer' (String should have at most 100"),
    ("export", {**EXPORTED, "parameters": 10**40}, "no valid 'parameters'"),
    ("export", {**EXPORTED, "parameters": "many"}, "no valid 'parameters'"),
    ("export", {k: v for k, v in EXPORTED.items() if k != "parameters"}, "has no 'parameters'"),
    ("export", {**EXPORTED, "files": {"../../etc/passwd": 1}}, "a field the engine does not write: 'files'"),
    ("export", {"ok": False, "kind": "rm -rf", "error": "x"}, "no valid 'kind'"),
    ("export", {"ok": False, "kind": "bad_input", "error": "e" * 10**5}, "no valid 'error'"),
    ("sample", {"ok": "yes", "kind": "bad_input", "error": "e"}, "no valid 'ok' (Input should be False)"),
]


@pytest.mark.parametrize("action, forged, message", FORGED_RESULTS, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(FORGED_RESULTS)])
def test_a_forged_result_from_the_model_process_is_refused_naming_its_field_and_changes_nothing(
        ws, monkeypatch, action, forged, message):
    import json

    from runner import model_process

    def forging(command, workspace, visible, writable, env, limits, timeout_s, mark, bound_fds=None):
        assert command[command.index("-m") + 2] == action
        for folder in writable[1:]:  # an export's staging folder, written as if exported
            (folder / "config.json").write_text("{}")
        Path(command[command.index("--result") + 1]).write_text(json.dumps(forged))
        return "", ""

    monkeypatch.setattr(model_tools, "run_model_io", model_process.run_model_io)  # the real reader
    monkeypatch.setattr(model_process, "run_contained", forging)
    call = {"sample": lambda: model_tools.sample(ws, "r1", ["p"]), "evaluate": lambda: model_tools.evaluate(ws, "r1"),
            "export": lambda: model_tools.export_checkpoint(ws, "r1", "exports/deep/m")}[action]
    before = tree_hash(ws.root)
    with pytest.raises(model_process.ModelProcessFailed) as refused:
        call()
    assert f"the {action} result " in str(refused.value) and message in str(refused.value), str(refused.value)
    assert len(str(refused.value)) < 600
    assert tree_hash(ws.root) == before and not (ws.root / "exports").exists()


@pytest.mark.parametrize("action, written", [("sample", SAMPLED), ("evaluate", EVALUATED), ("export", EXPORTED)])
def test_the_engines_result_passes_the_reader_that_refuses_forged_ones(ws, monkeypatch, action, written):
    import json

    from runner import model_process

    def writing(command, workspace, visible, writable, env, limits, timeout_s, mark, bound_fds=None):
        for folder in writable[1:]:
            (folder / "config.json").write_text("{}")
        Path(command[command.index("--result") + 1]).write_text(json.dumps(written))
        return "", ""

    monkeypatch.setattr(model_tools, "run_model_io", model_process.run_model_io)
    monkeypatch.setattr(model_process, "run_contained", writing)
    result = {"sample": lambda: model_tools.sample(ws, "r1", ["p"]), "evaluate": lambda: model_tools.evaluate(ws, "r1"),
              "export": lambda: model_tools.export_checkpoint(ws, "r1", "exports/m")}[action]()
    shown = result.model_dump(mode="json")
    if action == "sample":
        assert shown["samples"] == [{"prompt": "p", "completion": "c", "new_tokens": 1, "stopped": "eos", "cut": False,
                                     "input": None, "expected": None, "raw": {}}]
    elif action == "evaluate":
        assert (shown["eval_loss"], shown["metrics"], shown["examples"], shown["warnings"]) == (1.5, {"acc": 0.5}, 40, [])
    else:
        assert (shown["tokenizer"], shown["parameters"], shown["files"]) == ("T", 10, {"config.json": 2})


def test_a_destination_under_a_file_is_a_clear_refusal(ws):
    (ws.root / "notes.txt").write_text("a file")
    before = tree_hash(ws.root)
    with pytest.raises(BadInput, match="cannot be created"):
        model_tools.export_checkpoint(ws, "r1", "notes.txt/model")
    assert tree_hash(ws.root) == before


def test_another_exports_staging_folder_is_not_a_destination(ws):
    (ws.root / "exports" / f".m{model_tools.STAGING_MARK}0a1b2c3d").mkdir(parents=True)  # in flight, still empty
    before = tree_hash(ws.root)
    with pytest.raises(BadInput, match="staging folder"):
        model_tools.export_checkpoint(ws, "r1", f"exports/.m{model_tools.STAGING_MARK}0a1b2c3d")
    assert tree_hash(ws.root) == before


@pytest.mark.parametrize("plant", ["link", "fifo", "dir-link"])
def test_an_export_holding_a_link_or_a_special_file_is_refused(ws, tmp_path, plant):
    # Recipe code writes the staging folder: a link there would lead out of the workspace.
    def plant_it(staging):
        sub = staging / "tokenizer"
        sub.mkdir()
        {"link": lambda: (sub / "vocab.json").symlink_to("/etc/passwd"),
         "fifo": lambda: os.mkfifo(sub / "pipe"),
         "dir-link": lambda: (staging / "base").symlink_to(tmp_path / "outside")}[plant]()

    DURING.append(plant_it)
    with pytest.raises(BadInput, match="not a regular file or folder"):
        model_tools.export_checkpoint(ws, "r1", "exports/m")
    assert not (ws.root / "exports").exists()


def test_set_id_bits_written_by_the_recipe_are_dropped(ws):
    DURING.append(lambda staging: (staging / "config.json").chmod(0o6755))
    model_tools.export_checkpoint(ws, "r1", "exports/m")
    # Set-id bits dropped, and the file normalised to 0644 like every exported file.
    assert (ws.root / "exports" / "m" / "config.json").stat().st_mode & 0o7777 == 0o644


def test_model_processes_at_once_are_capped_like_runs(tmp_path, monkeypatch):
    # Each sample/evaluate/export loads a whole model: an agent calling them in a loop without
    # waiting must not start one process per call.
    from runner import model_process
    from workspace.settings import RunLimits

    run = fake_run(tmp_path / "ws", "r1")
    release, entered = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        entered.set()
        release.wait(10)
        return "", ""

    monkeypatch.setattr(model_process, "run_contained", held)
    limits = RunLimits(max_concurrent_runs=1)
    first: list = []
    thread = threading.Thread(target=lambda: first.append(pytest.raises(
        model_process.ModelProcessFailed, model_process.run_model_io, tmp_path / "ws", run, "sample", 2, [], limits, 5)))
    thread.start()
    assert entered.wait(10)
    try:
        with pytest.raises(BadInput, match="at most 1 at once"):
            model_process.run_model_io(tmp_path / "ws", run, "sample", 2, [], limits, 5)
    finally:
        release.set()
        thread.join()
    assert first and "ended without a result" in str(first[0].value)
    entered.clear()
    release.set()  # the slot is free again
    with pytest.raises(model_process.ModelProcessFailed, match="ended without a result"):
        model_process.run_model_io(tmp_path / "ws", run, "sample", 2, [], limits, 5)


def test_a_step_that_is_a_link_incomplete_or_absent_is_not_found(ws, tmp_path):
    checkpoints = ws.run_dir("r1") / rd.CHECKPOINTS_DIRNAME
    (checkpoints / run_checkpoints.checkpoint_dir_name(2) / run_checkpoints.DCP_METADATA).unlink()  # an interrupted save
    (checkpoints / run_checkpoints.checkpoint_dir_name(9)).symlink_to(checkpoints / run_checkpoints.checkpoint_dir_name(4))
    for step in (2, 9, 3, -1, 10**30):
        with pytest.raises(NotFound, match="available steps: 4$"):
            model_tools.sample(ws, "r1", ["x"], step=step)
    with pytest.raises(BadInput, match="step must be an integer"):
        model_tools.sample(ws, "r1", ["x"], step=True)


def test_an_interrupted_export_leaves_nothing_at_to_and_a_killed_one_does_not_block_the_next(ws):
    def interrupted(staging):
        (staging / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    DURING.append(interrupted)
    with pytest.raises(KeyboardInterrupt):
        model_tools.export_checkpoint(ws, "r1", "exports/deep/m")
    assert not (ws.root / "exports").exists()  # nor the folders made for it
    DURING.clear()
    # A server killed midway leaves its hidden staging folder, never a partial "to"; the next
    # export into that folder removes it once no export can still be writing it.
    now = int(time.time())
    abandoned = ws.root / "exports" / f".m{model_tools.STAGING_MARK}{now - model_tools.EXPORT_TIMEOUT_S - 700:010d}-0a1b2c3d"
    in_flight = ws.root / "exports" / f".n{model_tools.STAGING_MARK}{now - 60:010d}-0a1b2c3d"
    other = ws.root / "exports" / f".o{model_tools.STAGING_MARK}{now - model_tools.EXPORT_TIMEOUT_S - 700:010d}-link"
    for left in (abandoned, in_flight):
        left.mkdir(parents=True, exist_ok=True)
        (left / "model.safetensors").write_bytes(b"half")
    (abandoned / "escape").symlink_to(ws.root / "recipes")  # removing it must not follow it
    other.mkdir()
    assert model_tools.export_checkpoint(ws, "r1", "exports/m").files == {"config.json": 2}
    assert not abandoned.exists() and (ws.root / "recipes").is_dir() and any((ws.root / "recipes").iterdir())
    assert (in_flight / "model.safetensors").read_bytes() == b"half" and other.is_dir()


def test_a_folder_on_the_way_named_like_old_staging_is_refused(ws):
    # The name's time says how old a staging folder is: an export into a folder named like an
    # abandoned one would be deleted, with what it holds, by the next export beside it.
    old = f".k{model_tools.STAGING_MARK}{1:010d}-0a1b2c3d"
    before = tree_hash(ws.root)
    with pytest.raises(BadInput, match="staging folder"):
        model_tools.export_checkpoint(ws, "r1", f"exports/{old}/m")
    assert tree_hash(ws.root) == before


def test_samples_with_an_input_and_an_expected_answer_stay_in_the_agent_budget():
    # The recipe's code writes input and expected too: they take from each sample's share.
    from mcp_server.limits import AGENT_BUDGET_CHARS, json_chars

    raw = [GeneratedSample(prompt="p" * 4000, completion="\x01" * 65_536, input="\x02" * 4000, expected="\x03" * 4000,
                           new_tokens=1, stopped="eos")] * 8
    samples = model_tools._bounded_samples(raw)
    assert all(s.cut and s.input.endswith("…") and s.expected.endswith("…") and s.completion for s in samples)
    assert json_chars({"run_id": "x" * 40, "step": 1, "samples": [s.model_dump() for s in samples]}) < AGENT_BUDGET_CHARS


def test_a_secret_in_a_completion_is_redacted_before_the_cut_can_split_it(monkeypatch):
    from sandbox import redact as redaction

    secret = "tw-attack-Secret-9f8e7d6c5b4a3210"
    monkeypatch.setenv("TW_ATTACK_TOKEN", secret)
    redaction.reload()
    try:
        (plain,) = model_tools._bounded_samples([sampled("x" * 20_000)])
        kept = len(plain.completion) - 1  # where the cut falls ("…" added)
        for inside in range(8, len(secret)):  # the cut falls inside the secret
            completion = "x" * (kept - inside) + secret + "x" * 20_000
            (sample,) = model_tools._bounded_samples([sampled(completion)])
            assert secret[:8] not in redaction.redact_model(sample).completion, inside
    finally:
        monkeypatch.delenv("TW_ATTACK_TOKEN")
        redaction.reload()


def test_a_secret_in_the_model_process_output_is_redacted_before_it_is_cut(tmp_path, monkeypatch):
    from runner import model_process
    from sandbox import redact as redaction
    from workspace.settings import RunLimits

    secret = "tw-attack-Secret-0a1b2c3d4e5f6789"
    monkeypatch.setenv("TW_ATTACK_TOKEN", secret)
    redaction.reload()
    run = fake_run(tmp_path / "ws", "r1")
    try:
        for inside in range(8, len(secret), 5):  # the cut keeps the secret's last part
            tail = secret[len(secret) - inside:] + "y" * (model_process.MAX_STDERR_CHARS - inside)
            monkeypatch.setattr(model_process, "run_contained", lambda *a, **k: ("", "x" * 100 + secret[:-inside] + tail))
            with pytest.raises(model_process.ModelProcessFailed) as failed:
                model_process.run_model_io(tmp_path / "ws", run, "sample", 2, [], RunLimits(), 5)
            assert secret[-8:] not in redaction.redact(str(failed.value)), inside
    finally:
        monkeypatch.delenv("TW_ATTACK_TOKEN")
        redaction.reload()


def test_paths_bound_from_descriptors_fall_back_to_paths_on_an_older_bubblewrap(tmp_path, monkeypatch):
    from sandbox import bwrap

    found = bwrap.find_bwrap()
    if found is None or bwrap.probe(found) is not None:
        pytest.skip("bubblewrap cannot run here")
    checkpoint = tmp_path / "step"
    checkpoint.mkdir()
    fd = os.open(checkpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        wrapped = bwrap.wrap(["true"], [tmp_path / "ws"], [], bound_fds={checkpoint: fd})
        assert ["--ro-bind-fd", str(fd), str(checkpoint)] == wrapped.command[wrapped.command.index("--ro-bind-fd"):][:3]
        monkeypatch.setattr(bwrap, "binds_fds", lambda path: False)  # bubblewrap before 0.8
        command = bwrap.wrap(["true"], [tmp_path / "ws"], [], bound_fds={checkpoint: fd}).command
        assert "--ro-bind-fd" not in command and str(checkpoint) in command
    finally:
        os.close(fd)


def test_what_a_recipe_shows_beside_a_sample_is_redacted_bounded_and_typed(monkeypatch):
    """``input`` and ``expected`` come from recipe code (Engine.sample_inputs): strings only,
    secrets redacted, cut like the rest of the result."""
    from sandbox import redact as redaction

    secret = "tw-attack-Secret-0a1b2c3d4e5f6789"
    monkeypatch.setenv("TW_ATTACK_TOKEN", secret)
    redaction.reload()
    try:
        (shown, plain) = model_tools._bounded_samples([
            sampled(" red circle", prompt="a", input="held-out image " + secret + "x" * 3900,
                    expected="a red circle " + secret + "y" * 3900),
            sampled("c"),
        ])
    finally:
        monkeypatch.delenv("TW_ATTACK_TOKEN")
        redaction.reload()
    assert shown.input.startswith("held-out image ") and len(shown.input) <= 200 and shown.cut
    assert shown.expected.startswith("a red circle ") and len(shown.expected) <= 300
    assert secret[:12] not in shown.input + shown.expected
    assert plain.input is None and plain.expected is None and not plain.cut
    # Anything but text there is not the engine's result: refused as it is read (FORGED_RESULTS).


def sampled(completion: str, prompt: str = "p", **shown) -> GeneratedSample:
    return GeneratedSample(prompt=prompt, completion=completion, new_tokens=1, stopped="eos", **shown)


def test_the_model_process_never_gets_the_hosts_network_even_where_runs_share_it(ws, monkeypatch):
    """An lm-eval task YAML may name its data by URL: datasets fetches it even with
    HF_DATASETS_OFFLINE=1 (a GET and two HEADs before it refuses), so evaluate, sample and export
    run without the host's network whatever runs.network says."""
    import dataclasses
    import json

    from runner import model_process

    networks = []

    def writing(command, workspace, visible, writable, env, limits, timeout_s, mark, bound_fds=None):
        networks.append(limits.network)
        Path(command[command.index("--result") + 1]).write_text(json.dumps(EVALUATED))
        return "", ""

    monkeypatch.setattr(model_process, "run_contained", writing)
    shared = dataclasses.replace(ws.run_limits(), network="shared")
    model_process.run_model_io(ws.root, ws.runs_dir / "r1", "evaluate", 4, [], shared, 60)
    assert networks == ["isolated"]
