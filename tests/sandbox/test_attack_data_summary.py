"""launch_run's data summary is counted by the launch check; the run reads its data again when it
starts. A data folder that changes in between is trained on as it is then: the run notices (the
check fingerprinted the files), counts again, and get_run shows the new count and a warning."""

from __future__ import annotations

import pytest

from engine import run_dir as rd
from mcp_server.server import build_server
from tests.sandbox.helpers import derived_recipe, error_text, live_client, make_workspace, wait_final

pytestmark = pytest.mark.slow  # three short runs

COUNTING = '''
class Counting(CausalLM):
    def prepare_data(self):
        train, held_out = self.store.counts["train"], self.store.counts["eval"]  # [documents, tokens]
        print(f"TRAINED-ON-DOCUMENTS {train[0] + held_out[0]}", flush=True)
        return super().prepare_data()
'''


def test_the_reported_data_is_the_data_the_run_trained_on(tmp_path):
    from tests.sandbox.test_attack_code_origin import _tiny

    root = make_workspace(tmp_path / "ws")
    derived_recipe(root, "counting", COUNTING)
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the first document " * 50)
    overrides = _tiny(**{"train.max_steps": 1, "data.paths": ["corpus"], "data.eval_fraction": 0.0})
    with live_client(build_server(root)) as client:
        steady = client.call("launch_run", {"recipe": "recipes/counting", "overrides": overrides})
        assert not steady.is_error, error_text(steady)
        assert wait_final(root / "runs" / steady.structured_content["run_id"], timeout=240).status == rd.COMPLETED
        steady_run = client.call("get_run", {"run_id": steady.structured_content["run_id"]}).structured_content
        result = client.call("launch_run", {"recipe": "recipes/counting", "overrides": _tiny(
            **{"train.max_steps": 1, "data.paths": ["corpus"], "data.eval_fraction": 0.0})})
        assert not result.is_error, error_text(result)
        for i in range(40):  # the run is still importing torch
            (corpus / f"late{i}.txt").write_text(f"a document added after the check {i} " * 50)
        run_dir = root / "runs" / result.structured_content["run_id"]
        record = wait_final(run_dir, timeout=240)
        shown = client.call("get_run", {"run_id": run_dir.name}).structured_content
        reported = shown["data"]["documents"]
        # Resuming the first run now would train on other data than it did: the result says so.
        resumed = client.call("resume_checkpoint", {"run_id": steady.structured_content["run_id"],
                                                    "overrides": {"train.max_steps": 2}})
        assert not resumed.is_error, error_text(resumed)
        wait_final(root / "runs" / resumed.structured_content["run_id"], timeout=240)
    assert record.status == rd.COMPLETED, record.error
    console = (run_dir / rd.CONSOLE_LOG).read_text()
    trained = int(console.split("TRAINED-ON-DOCUMENTS ", 1)[1].split()[0])
    assert result.structured_content["data"]["documents"] == 1
    assert reported == trained, f"get_run reports {reported} documents; the run trained on {trained}"
    assert any("the data changed after the launch check" in w and "1 document" in w and "41 documents" in w
               for w in shown["warnings"]), shown["warnings"]
    assert shown["data"]["fingerprint"] != result.structured_content["data"]["fingerprint"]
    # Data that stays put: the check's count and fingerprint stand, and nothing is said.
    assert steady_run["data"] == steady.structured_content["data"] and steady_run["data"]["fingerprint"]
    assert not any("data changed" in w for w in steady_run["warnings"]), steady_run["warnings"]
    assert any("the data differs from what run" in w and "41 documents" in w
               for w in resumed.structured_content["warnings"]), resumed.structured_content["warnings"]
