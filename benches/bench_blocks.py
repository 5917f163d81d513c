"""BlockHasher.hash against Dynamo's compute_block_hash_for_seq (ai-dynamo-runtime), same process.

Workload: 32,768 token ids drawn from a 128k vocabulary, blocks of 16 (2,048 blocks). Each group
gives both sides the same input object: a Python list (what tokenizers usually return) or a NumPy
int64 array (both libraries accept either). Dynamo computes unchained XXH3-64 (seed 1337) block
hashes; kvroute computes chained hashes in each profile (native XXH3, vLLM sha256_cbor, SGLang
SHA-256), so the vllm/sglang rows compare a cryptographic hash against Dynamo's XXH3.
"""

from __future__ import annotations

import struct

import kvroute
import numpy as np
import pytest

dynamo_llm = pytest.importorskip("dynamo.llm")
compute_block_hash_for_seq = dynamo_llm.compute_block_hash_for_seq
xxhash = pytest.importorskip("xxhash")

N_TOKENS = 32_768
BLOCK = 16
PROFILES = ["native", "vllm", "sglang"]
INPUTS = ["list", "numpy"]


@pytest.fixture(scope="module")
def token_inputs() -> dict:
    arr = np.random.default_rng(0).integers(0, 128_000, size=N_TOKENS, dtype=np.int64)
    return {"list": arr.tolist(), "numpy": arr}


def _group(kind: str, profile: str) -> str:
    return f"hash {N_TOKENS} tokens bs={BLOCK}, {kind} input: kvroute {profile} vs dynamo"


@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("profile", PROFILES)
def test_blockhasher(benchmark, token_inputs, kind, profile):
    benchmark.group = _group(kind, profile)
    benchmark.extra_info.update(impl="kvroute", ops=1)
    h = kvroute.BlockHasher(BLOCK, profile=profile)
    tokens = token_inputs[kind]
    out = benchmark(h.hash, tokens)
    assert out.dtype == np.uint64 and len(out) == N_TOKENS // BLOCK
    # Same answer from the other input kind, and the chain continues exactly from its state.
    other = token_inputs["numpy" if kind == "list" else "list"]
    np.testing.assert_array_equal(out, h.hash(other))
    half = N_TOKENS // 2
    head, state = h.hash_with_state(token_inputs["list"][:half])
    tail = h.hash(token_inputs["list"][half:], parent=state)
    np.testing.assert_array_equal(out, np.concatenate([head, tail]))


@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("profile", PROFILES)
def test_dynamo(benchmark, token_inputs, kind, profile):
    benchmark.group = _group(kind, profile)
    benchmark.extra_info.update(impl="dynamo compute_block_hash_for_seq", ops=1)
    tokens = token_inputs[kind]
    out = benchmark(compute_block_hash_for_seq, tokens, BLOCK)
    assert len(out) == N_TOKENS // BLOCK
    # Cross-check: Dynamo's block hash is XXH3-64 (seed 1337) of the block's u32 LE tokens.
    listed = token_inputs["list"]
    for i in (0, len(out) - 1):
        block = struct.pack(f"<{BLOCK}I", *listed[i * BLOCK : (i + 1) * BLOCK])
        assert out[i] == xxhash.xxh3_64_intdigest(block, seed=1337)
