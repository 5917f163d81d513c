"""The fleet simulator behind ``kvroute simulate``: workloads, the engine, policies, reports.

``kvroute simulate`` replays a :class:`Workload` against a fleet model and reports per policy:

- :mod:`.engine` — :func:`run` (discrete-event fleet model) and :class:`FleetModel` (defaults:
  Llama-3-8B per A100-80GB); :class:`Policy`, the interface a routing policy implements;
- :mod:`.scenario` — :class:`Scenario`, the deployment :func:`run` takes next to the policy
  (dedicated :class:`Endpoint` s, reserved partitions, salted engine hashes, priorities);
- :mod:`.policies` — kvroute's :class:`kvroute.Router` policies by name (:func:`make_policy`),
  one router for all traffic;
- :mod:`.peers` — emulations of SGLang ``cache_aware``, Dynamo's KV router and llm-d's scheduler;
- :mod:`.simulate` — :func:`simulate`: every policy on the same arrivals, oracles, tenant view;
- :mod:`.tenant` / :mod:`.warm` — the dedicated-endpoint study over seeds and cache pressures,
  and the gateway's warm requests (``--warm-interval``) added to its workload;

- :mod:`.workloads` — :class:`Request` / :class:`Workload` (prefix-chained ``uint64`` block hashes
  in one buffer), :func:`chain_block_ids`;
- :mod:`.traces` — :func:`load_trace` (Mooncake and Qwen-Bailian JSONL, kv-cache-tester JSON,
  directories),
  :func:`mooncake_conversation` (the bundled FAST'25 conversation trace),
  :func:`claude_code_sessions` (four bundled kv-cache-tester agent sessions);
- :mod:`.sweep` — :func:`~.sweep.sweep`: every policy at several offered loads (``--sweep``);
- :mod:`.pd` / :mod:`.pd_study` — the prefill/decode fleet (:func:`~.pd.run_pd`: aggregated,
  disaggregated, conditional through ``Router.route_pd``) and the threshold sweep (``--pd``);
- :mod:`.instruments` — :class:`~.instruments.Recorder`: what each decision saw (``--explain``);
- :mod:`.synthetic` — seeded ``endpoint`` / ``rag`` / ``agent`` scenarios;
- :mod:`.oracles` — :func:`infinite_cache` and :func:`pooled_lru` hit-rate oracles;
- :mod:`.report` — per-request :data:`RESULT_DTYPE` records, :func:`summarize`, tables, JSON, plot.

Seam for the engine: it takes a :class:`Workload`, fills :func:`empty_results` (one record per
request), and builds a :class:`Report` from :func:`summarize` per policy plus the two oracles.
"""

from __future__ import annotations

from .engine import FleetModel, Policy, run
from .oracles import LRUBlockCache, OracleResult, infinite_cache, make_block_cache, pooled_lru
from .peers import DynamoKv, LlmdScheduler, SGLangCacheAware
from .policies import DEFAULT_POLICIES, RouterPolicy, make_policy
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
    write_json,
    write_plot,
)
from .scenario import Endpoint, Scenario
from .simulate import EndpointOptions, load_workload, simulate
from .synthetic import SCENARIOS, agent_scenario, endpoint_scenario, rag_scenario
from .traces import (
    bundled_claude_code_dir,
    bundled_mooncake_path,
    claude_code_sessions,
    load_bailian,
    load_kv_cache_tester,
    load_mooncake,
    load_trace,
    mooncake_conversation,
    write_mooncake,
)
from .workloads import Request, Workload, WorkloadBuilder, chain_block_ids

__all__ = [
    "DEFAULT_POLICIES",
    "RESULT_DTYPE",
    "SCENARIOS",
    "DynamoKv",
    "Endpoint",
    "EndpointOptions",
    "FleetModel",
    "LRUBlockCache",
    "LlmdScheduler",
    "OracleResult",
    "Policy",
    "PolicyMetrics",
    "Progress",
    "Report",
    "Request",
    "RequestResult",
    "RouterPolicy",
    "SGLangCacheAware",
    "Scenario",
    "Workload",
    "WorkloadBuilder",
    "agent_scenario",
    "bundled_claude_code_dir",
    "bundled_mooncake_path",
    "chain_block_ids",
    "claude_code_sessions",
    "empty_results",
    "endpoint_scenario",
    "infinite_cache",
    "load_bailian",
    "load_kv_cache_tester",
    "load_mooncake",
    "load_trace",
    "load_workload",
    "make_block_cache",
    "make_policy",
    "mooncake_conversation",
    "pooled_lru",
    "print_report",
    "rag_scenario",
    "render_table",
    "results_from_records",
    "run",
    "simulate",
    "summarize",
    "write_json",
    "write_mooncake",
    "write_plot",
]
