"""Fleet simulator pieces: workloads, trace loaders, synthetic scenarios, oracles and reports.

``kvroute simulate`` (issue 6) replays a :class:`Workload` against a fleet model and reports per
policy. This package holds what does not depend on the engine:

- :mod:`.workloads` — :class:`Request` / :class:`Workload` (prefix-chained ``uint64`` block hashes
  in one buffer), :func:`chain_block_ids`;
- :mod:`.traces` — :func:`load_trace` (Mooncake JSONL, kv-cache-tester JSON, directories),
  :func:`mooncake_conversation` (the bundled FAST'25 conversation trace);
- :mod:`.synthetic` — seeded ``endpoint`` / ``rag`` / ``agent`` scenarios;
- :mod:`.oracles` — :func:`infinite_cache` and :func:`pooled_lru` hit-rate oracles;
- :mod:`.report` — per-request :data:`RESULT_DTYPE` records, :func:`summarize`, tables, JSON, plot.

Seam for the engine: it takes a :class:`Workload`, fills :func:`empty_results` (one record per
request), and builds a :class:`Report` from :func:`summarize` per policy plus the two oracles.
"""

from __future__ import annotations

from .oracles import LRUBlockCache, OracleResult, infinite_cache, make_block_cache, pooled_lru
from .report import (
    RESULT_DTYPE,
    PolicyMetrics,
    Progress,
    Report,
    RequestResult,
    empty_results,
    print_report,
    render_table,
    results_from_records,
    summarize,
    tenant_view,
    write_json,
    write_plot,
)
from .synthetic import SCENARIOS, agent_scenario, endpoint_scenario, rag_scenario
from .traces import (
    bundled_mooncake_path,
    load_kv_cache_tester,
    load_mooncake,
    load_trace,
    mooncake_conversation,
)
from .workloads import Request, Workload, WorkloadBuilder, chain_block_ids

__all__ = [
    "RESULT_DTYPE",
    "SCENARIOS",
    "LRUBlockCache",
    "OracleResult",
    "PolicyMetrics",
    "Progress",
    "Report",
    "Request",
    "RequestResult",
    "Workload",
    "WorkloadBuilder",
    "agent_scenario",
    "bundled_mooncake_path",
    "chain_block_ids",
    "empty_results",
    "endpoint_scenario",
    "infinite_cache",
    "load_kv_cache_tester",
    "load_mooncake",
    "load_trace",
    "make_block_cache",
    "mooncake_conversation",
    "pooled_lru",
    "print_report",
    "rag_scenario",
    "render_table",
    "results_from_records",
    "summarize",
    "tenant_view",
    "write_json",
    "write_plot",
]
