"""list_recipes takes no argument, so its result must fit an agent's budget however many recipe
folders the workspace holds and however long their names are (an agent's own file tools can make
any number of folders with a recipe.py)."""

from __future__ import annotations

import json

from mcp_server.limits import AGENT_BUDGET_CHARS
from mcp_server.server import build_server
from tests.sandbox.helpers import live_client, make_workspace


def test_list_recipes_fits_the_budget_with_many_long_recipe_folders(tmp_path):
    root = make_workspace(tmp_path / "ws")
    for i in range(150):
        folder = root / "recipes" / f"r{i:03d}{'x' * 200}"
        folder.mkdir()
        (folder / "recipe.py").write_text("")
    for i in range(20):
        folder = root / ("a" * 250) / ("b" * 250) / ("c" * 250) / f"deep{i}"
        folder.mkdir(parents=True)
        (folder / "recipe.py").write_text("")
    with live_client(build_server(root)) as client:
        result = client.call("list_recipes", {})
        assert not result.is_error, result.content
        size = len(json.dumps(result.structured_content))
        assert size <= AGENT_BUDGET_CHARS, f"list_recipes returned {size} characters"
        assert result.structured_content["truncated"] is True
        assert result.structured_content["recipes"][0]["path"] == "recipes/lm"
