"""Dynamo RadixTree answers in kvroute's shape (shared by the index and events benches)."""

from __future__ import annotations


def dynamo_answer(scores) -> dict[str, int]:
    """``find_matches(...).scores`` keyed ``(worker_id, dp_rank)`` as ``{"w<id>": blocks}``."""
    return {f"w{worker}": n for (worker, _rank), n in scores.items() if n > 0}
