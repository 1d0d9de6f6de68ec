"""The ``data_cache`` tool: the tokenized data runs share (``engine.token_store``), listed with
sizes, removed by name; and the checkpoints launches start from, exported
(``.trainwright/start-models/``: :mod:`mcp_server.operations.starting_model`), named
``start-models/NAME``."""

from __future__ import annotations

from typing import Any

from mcp_server.limits import MAX_LIST_STORES
from mcp_server.models import DataCacheResult
from mcp_server.operations.starting_model import (START_MODELS_DIRNAME, chosen_start_models, prune_start_models,
                                                  remove_start_models, start_models)
from workspace.workspace import cached_data, data_cache_dir, remove_cached_data

EXPORT_PREFIX = f"{START_MODELS_DIRNAME}/"


def data_cache(ws: Any, remove: list[str]) -> DataCacheResult:
    """What the workspace's data cache holds (name -> bytes, the largest :data:`MAX_LIST_STORES`
    and how many more) and its start-model exports, after removing ``remove`` (names, exports as
    ``start-models/NAME``, or ``["all"]``: every store and every export no run uses). Exports no
    run uses are pruned as a launch prunes them."""
    exports = [name.removeprefix(EXPORT_PREFIX) for name in remove if name.startswith(EXPORT_PREFIX)]
    stores = [name for name in remove if not name.startswith(EXPORT_PREFIX)]
    if remove == ["all"]:
        exports = ["all"]
    chosen_start_models(ws, exports)  # refused before any store is removed
    removed = remove_cached_data(ws.root, stores) if stores else []
    removed += [(EXPORT_PREFIX + name, size) for name, size in
                [*(remove_start_models(ws, exports) if exports else []), *prune_start_models(ws)]]
    cached = cached_data(ws.root)
    largest = sorted(cached, key=lambda store: -store[1])[:MAX_LIST_STORES]
    models = {EXPORT_PREFIX + name: size for name, size, _ in start_models(ws)[:MAX_LIST_STORES]}
    return DataCacheResult(folder=str(data_cache_dir(ws.root).relative_to(ws.root)),
                           stores=dict(largest), not_listed=len(cached) - len(largest),
                           total_bytes=sum(size for _, size in cached), removed=dict(removed[:MAX_LIST_STORES]),
                           start_models=models)
