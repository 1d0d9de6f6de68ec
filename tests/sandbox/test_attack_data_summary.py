"""launch_run's data summary is counted by the launch check; the run reads its data again when it
starts. A data folder that changes in between is trained on as it is then, while launch_run,
get_run and the git note keep the check's count."""

from __future__ import annotations

import pytest

from engine import run_dir as rd
from mcp_server.server import build_server
from tests.sandbox.helpers import derived_recipe, error_text, live_client, make_workspace, wait_final

COUNTING = '''
class Counting(CausalLM):
    def prepare_data(self):
        train, held_out = self.documents
        print(f"TRAINED-ON-DOCUMENTS {len(train) + len(held_out)}", flush=True)
        return super().prepare_data()
'''


@pytest.mark.xfail(strict=True, reason="the run does not check that the data it loads is the data the "
                   "launch check counted (the template's loader would have to count what it loads)")
def test_the_reported_data_is_the_data_the_run_trained_on(tmp_path):
    from tests.sandbox.test_attack_code_origin import _tiny

    root = make_workspace(tmp_path / "ws")
    derived_recipe(root, "counting", COUNTING)
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the first document " * 50)
    with live_client(build_server(root)) as client:
        result = client.call("launch_run", {"recipe": "recipes/counting", "overrides": _tiny(
            **{"train.max_steps": 1, "data.paths": ["corpus"], "data.eval_fraction": 0.0})})
        assert not result.is_error, error_text(result)
        for i in range(40):  # the run is still importing torch
            (corpus / f"late{i}.txt").write_text(f"a document added after the check {i} " * 50)
        run_dir = root / "runs" / result.structured_content["run_id"]
        record = wait_final(run_dir, timeout=240)
        reported = client.call("get_run", {"run_id": run_dir.name}).structured_content["data"]["documents"]
    assert record.status == rd.COMPLETED, record.error
    console = (run_dir / rd.CONSOLE_LOG).read_text()
    trained = int(console.split("TRAINED-ON-DOCUMENTS ", 1)[1].split()[0])
    assert result.structured_content["data"]["documents"] == 1
    assert reported == trained, f"get_run reports {reported} documents; the run trained on {trained}"
