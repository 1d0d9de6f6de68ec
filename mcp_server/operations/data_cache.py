"""The ``data_cache`` tool: the tokenized data runs share (``engine.token_store``), listed with
sizes, removed by name."""

from __future__ import annotations

from typing import Any

from mcp_server.limits import MAX_LIST_STORES
from mcp_server.models import DataCacheResult
from workspace.workspace import cached_data, data_cache_dir, remove_cached_data


def data_cache(ws: Any, remove: list[str]) -> DataCacheResult:
    """What the workspace's data cache holds (name -> bytes, the largest :data:`MAX_LIST_STORES`
    and how many more), after removing ``remove`` (names, or ``["all"]``)."""
    removed = remove_cached_data(ws.root, remove) if remove else []
    stores = cached_data(ws.root)
    largest = sorted(stores, key=lambda store: -store[1])[:MAX_LIST_STORES]
    return DataCacheResult(folder=str(data_cache_dir(ws.root).relative_to(ws.root)),
                           stores=dict(largest), not_listed=len(stores) - len(largest),
                           total_bytes=sum(size for _, size in stores), removed=dict(removed[:MAX_LIST_STORES]))
