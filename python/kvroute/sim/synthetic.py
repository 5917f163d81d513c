"""Seeded synthetic workloads: ``endpoint``, ``rag`` and ``agent`` scenarios.

A prompt is built from **segments** — a system prompt, a document, a question, a turn's output,
a tool result — each a run of tokens with a 64-bit content id. The token at offset ``k`` of a
segment is a fixed function of (segment id, ``k``), so prompts are token sequences without ever
materialising them. :func:`segment_block_hashes` hashes the **full** ``block_size``-token blocks of
such a sequence (a partial tail is dropped, as :class:`kvroute.BlockHasher` does):

- a block's content hash covers exactly which (segment, offset, length) runs it holds, in order,
  so two blocks hash equal iff their tokens are equal (up to 64-bit collisions);
- block ``j``'s hash then folds in every earlier block (a running sum of position-keyed content
  hashes, finalised with the workload's salt): equal hashes mean equal prefixes, and equal
  prefixes give equal hashes — the chained-hash property the simulator's caches rely on;
- cost is O(segments + blocks) NumPy work per prompt, no per-token Python loop.

Every generator is a pure function of its arguments: the same ``seed`` gives the same workload,
bit for bit. Defaults are documented on each function; times are seconds, sizes tokens.
Distributions "lognormal(mean, sigma)" are parameterised by their mean and log-space sigma.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .workloads import Workload, WorkloadBuilder, mix64, namespace_seed

__all__ = [
    "SCENARIOS",
    "agent_scenario",
    "endpoint_scenario",
    "rag_scenario",
    "segment_block_hashes",
    "segment_block_hashes_many",
]

_U64 = np.uint64

# Segment kinds, in the top byte of a segment id.
_SYSTEM, _QUESTION, _USER, _DOC, _OUTPUT, _TOOL = 1, 2, 3, 4, 5, 6


def _seg(kind: int, index: int) -> int:
    return (kind << 56) | (int(index) & ((1 << 56) - 1))


def segment_block_hashes(
    segment_ids: Sequence[int] | np.ndarray,
    segment_lengths: Sequence[int] | np.ndarray,
    block_size: int,
    salt: int = 0,
) -> np.ndarray:
    """Chained hashes of the full blocks of the token sequence made of these segments.

    ``segment_ids[i]`` names the content of segment ``i`` (equal ids = equal tokens over the
    common length); ``segment_lengths[i] >= 0`` is its token count. Returns ``uint64`` hashes,
    one per full block (see the module docs for the guarantees).
    """
    ids = np.asarray(segment_ids, dtype=_U64)
    hashes, _ = segment_block_hashes_many(ids, segment_lengths, [ids.shape[0]], block_size, salt)
    return hashes


def segment_block_hashes_many(
    segment_ids: np.ndarray,
    segment_lengths: np.ndarray,
    segments_per_prompt: np.ndarray,
    block_size: int,
    salt: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`segment_block_hashes` of many prompts in one pass: prompt ``p`` is made of the
    next ``segments_per_prompt[p]`` entries of ``segment_ids`` / ``segment_lengths``. Returns the
    hashes of every prompt back to back and their ``offsets`` (``int64``, one more than prompts):
    prompt ``p``'s hashes are ``hashes[offsets[p]:offsets[p + 1]]``, equal to
    ``segment_block_hashes`` of its segments. Every step is one NumPy operation over all prompts."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ids = np.asarray(segment_ids, dtype=_U64)
    lens = np.asarray(segment_lengths, dtype=np.int64)
    counts = np.asarray(segments_per_prompt, dtype=np.int64)
    if ids.shape != lens.shape or ids.ndim != 1 or counts.ndim != 1:
        raise ValueError("segment_ids and segment_lengths must be 1-D and of equal length")
    if int(counts.sum()) != ids.shape[0] or np.any(counts < 0):
        raise ValueError("segments_per_prompt must be >= 0 and sum to the number of segments")
    if np.any(lens < 0):
        raise ValueError("segment lengths must be >= 0")
    prompts = counts.shape[0]
    prompt_of = np.repeat(np.arange(prompts), counts)
    keep = lens > 0
    ids, lens, prompt_of = ids[keep], lens[keep], prompt_of[keep]
    totals = np.bincount(prompt_of, weights=lens, minlength=prompts).astype(np.int64)
    n_blocks = totals // block_size
    offsets = np.zeros(prompts + 1, dtype=np.int64)
    np.cumsum(n_blocks, out=offsets[1:])
    total_blocks = int(offsets[-1])
    if total_blocks == 0:
        return np.empty(0, dtype=_U64), offsets
    # Each prompt, cut to its full blocks, in one token space: prompt p starts at token
    # offsets[p] × block_size, so global block boundaries are every prompt's own.
    ends = np.cumsum(lens)
    first_seg = np.searchsorted(prompt_of, np.arange(prompts), side="left")
    before = np.concatenate([[0], ends])[first_seg]  # tokens of earlier prompts, uncut
    local_start = ends - lens - before[prompt_of]
    limit = (n_blocks * block_size)[prompt_of]
    inside = local_start < limit
    base = (offsets[:-1] * block_size)[prompt_of]
    ids, start = ids[inside], (base + local_start)[inside]
    end = (base + np.minimum(local_start + lens, limit))[inside]
    # Piece boundaries: segment and block starts (two sorted runs; sorted unique union).
    bounds = np.concatenate([start, np.arange(total_blocks, dtype=np.int64) * block_size])
    bounds.sort(kind="stable")
    bounds = bounds[np.concatenate([[True], bounds[1:] != bounds[:-1]])]
    piece_len = np.diff(np.append(bounds, total_blocks * block_size))
    seg_of = np.searchsorted(end, bounds, side="right")
    block_of = bounds // block_size
    in_seg = (bounds - start[seg_of]).astype(_U64)
    in_block = (bounds - block_of * block_size).astype(_U64)
    piece = mix64(
        mix64(ids[seg_of])
        ^ mix64((in_seg << _U64(24)) ^ (piece_len.astype(_U64) << _U64(2)) ^ _U64(1))
        ^ mix64((in_block << _U64(8)) ^ _U64(3))
    )
    first_piece = np.searchsorted(block_of, np.arange(total_blocks), side="left")
    content = np.add.reduceat(piece, first_piece)
    local = (np.arange(total_blocks) - np.repeat(offsets[:-1], n_blocks)).astype(_U64)
    keyed = mix64(content ^ mix64(local ^ _U64(0x5BD1E995)))
    running = np.cumsum(keyed, dtype=_U64)
    start_sum = np.concatenate([np.zeros(1, dtype=_U64), running])[offsets[:-1]]
    prefix = running - np.repeat(start_sum, n_blocks)  # wraps modulo 2^64, as the sum does
    return mix64(prefix ^ _U64(salt & ((1 << 64) - 1))), offsets


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size, lo: int, hi: int):
    mu = np.log(mean) - sigma * sigma / 2.0
    return np.clip(np.rint(rng.lognormal(mu, sigma, size)), lo, hi).astype(np.int64)


def _poisson_times(rng: np.random.Generator, rate: float, start: float, end: float) -> np.ndarray:
    if rate <= 0:
        return np.empty(0)
    n = rng.poisson(rate * (end - start))
    return np.sort(rng.uniform(start, end, n))


def _distinct_draws(rng: np.random.Generator, cdf: np.ndarray, k: int) -> np.ndarray:
    """``k`` distinct ranks drawn by the popularity ``cdf``, in draw order (sampling without
    replacement, one candidate batch at a time)."""
    chosen: list[int] = []
    seen: set[int] = set()
    while len(chosen) < k:
        draws = np.searchsorted(cdf, rng.random(2 * k) * cdf[-1], side="right")
        for d in np.minimum(draws, cdf.shape[0] - 1).tolist():
            if d not in seen:
                seen.add(d)
                chosen.append(d)
                if len(chosen) == k:
                    break
    return np.asarray(chosen, dtype=np.int64)


def _check_positive(**kw: float) -> None:
    for k, v in kw.items():
        if not (v > 0 and np.isfinite(v)):
            raise ValueError(f"{k} must be a positive finite number, got {v}")


# ---------------------------------------------------------------------------------------------
def endpoint_scenario(
    *,
    seed: int = 0,
    duration: float = 1800.0,
    block_size: int = 64,
    tenant: str = "ep-tenant",
    tenant_system_tokens: int = 4000,
    tenant_rate: float = 0.1,
    tenant_question_tokens: tuple[int, int] = (20, 200),
    noise_rate: float = 10.0,
    noise_tenants: int = 1000,
    noise_zipf: float = 1.1,
    noise_system_mean: float = 4000.0,
    noise_user_mean: float = 3000.0,
    output_mean: float = 200.0,
) -> Workload:
    """One tenant endpoint with a long system prompt among noisy neighbours, for ``duration``
    seconds (default 1800: about 180 tenant requests, so that the tenant's TTFT p99 is not just
    its slowest request).

    - The tenant (``tenant``; its requests carry it as ``Request.tenant``) sends Poisson
      arrivals at ``tenant_rate`` req/s (default 0.1: a question every 10 s), the first at 0.5 s.
      Each prompt = its ``tenant_system_tokens`` (default 4000) system prompt + its own question
      of uniform ``tenant_question_tokens`` (20..200) tokens.
    - Other tenants (``Request.tenant is None``: the public pool) send Poisson arrivals at
      ``noise_rate`` req/s (default 10). Each picks one of ``noise_tenants`` (1000) tenants with
      Zipf(``noise_zipf`` = 1.1) popularity; prompt = that tenant's system prompt
      (lognormal(``noise_system_mean`` = 4000, 0.6), 256..32k, fixed per tenant) + unique user
      content (lognormal(``noise_user_mean`` = 3000, 0.8), 16..32k). Defaults offer about 65k
      prompt tokens/s, mostly never seen before: ~45% of the prefill capacity of the simulator's
      default fleet for this scenario (16 workers x ~9k tokens/s; an operating point that keeps a
      TTFT SLO), enough to turn an LRU of a few hundred thousand tokens per worker over in about
      two minutes, i.e. faster than the tenant comes back to a given worker under random routing
      (every 16 / 0.1 = 160 s).
    - Output lengths are lognormal(``output_mean`` = 200, 0.8), 1..4096, for everyone.

    ``meta`` records ``tenant`` and ``tenant_system_tokens`` for the report (the two-call demo:
    the tenant's first request can have 0 cached tokens, its second the whole system prompt).
    """
    _check_positive(duration=duration, tenant_rate=tenant_rate, noise_rate=noise_rate)
    lo_q, hi_q = tenant_question_tokens
    if not 1 <= lo_q <= hi_q:
        raise ValueError(
            f"tenant_question_tokens must be 1 <= lo <= hi, got {tenant_question_tokens}"
        )
    if tenant_system_tokens < 1 or noise_tenants < 1:
        raise ValueError("tenant_system_tokens and noise_tenants must be >= 1")
    rng = np.random.default_rng([seed, 0xE4D])
    salt = namespace_seed(f"endpoint:{seed}")
    b = WorkloadBuilder(block_size)
    counter = 0

    t_times = np.concatenate([[0.5], 0.5 + _poisson_times(rng, tenant_rate, 0.0, duration - 0.5)])
    t_q = rng.integers(lo_q, hi_q + 1, size=t_times.shape[0])
    t_out = _lognormal(rng, output_mean, 0.8, t_times.shape[0], 1, 4096)
    n_t = t_times.shape[0]
    questions = [_seg(_QUESTION, counter + 1 + r) for r in range(n_t)]
    counter += n_t
    ids = np.column_stack([np.full(n_t, _seg(_SYSTEM, 0), dtype=_U64), np.array(questions, _U64)])
    lens = np.column_stack([np.full(n_t, tenant_system_tokens), t_q])
    h, off = segment_block_hashes_many(ids.ravel(), lens.ravel(), np.full(n_t, 2), block_size, salt)
    for r, (t, q, o) in enumerate(zip(t_times.tolist(), t_q.tolist(), t_out.tolist(), strict=True)):
        b.add(t, h[off[r] : off[r + 1]], tenant_system_tokens + q, o, tenant=tenant)

    weights = 1.0 / np.arange(1, noise_tenants + 1) ** noise_zipf
    weights /= weights.sum()
    perm = rng.permutation(noise_tenants)  # popularity rank -> tenant index
    sys_len = _lognormal(rng, noise_system_mean, 0.6, noise_tenants, 256, 32768)
    n_times = _poisson_times(rng, noise_rate, 0.0, duration)
    who = perm[rng.choice(noise_tenants, size=n_times.shape[0], p=weights)]
    user_len = _lognormal(rng, noise_user_mean, 0.8, n_times.shape[0], 16, 32768)
    n_out = _lognormal(rng, output_mean, 0.8, n_times.shape[0], 1, 4096)
    n_n = n_times.shape[0]
    systems = [_seg(_SYSTEM, 1 + k) for k in who.tolist()]
    users = [_seg(_USER, counter + 1 + r) for r in range(n_n)]
    ids = np.column_stack([np.array(systems, dtype=_U64), np.array(users, dtype=_U64)])
    lens = np.column_stack([sys_len[who], user_len])
    h, off = segment_block_hashes_many(ids.ravel(), lens.ravel(), np.full(n_n, 2), block_size, salt)
    prompt = (sys_len[who] + user_len).tolist()
    for r, (t, o) in enumerate(zip(n_times.tolist(), n_out.tolist(), strict=True)):
        b.add(t, h[off[r] : off[r + 1]], prompt[r], o)

    return b.build(
        name="endpoint",
        description=(
            f"endpoint scenario (seed {seed}): tenant {tenant!r} with a "
            f"{tenant_system_tokens}-token system prompt at {tenant_rate} req/s among "
            f"{noise_tenants} noisy tenants at {noise_rate} req/s, {duration:.0f}s, "
            f"{block_size}-token blocks"
        ),
        meta={
            "scenario": "endpoint",
            "seed": seed,
            "tenant": tenant,
            "tenant_system_tokens": tenant_system_tokens,
        },
    )


# ---------------------------------------------------------------------------------------------
def rag_scenario(
    *,
    seed: int = 0,
    duration: float = 300.0,
    block_size: int = 64,
    rate: float = 8.0,
    documents: int = 5000,
    doc_mean: float = 800.0,
    zipf: float = 1.0,
    docs_per_request: int = 4,
    system_tokens: int = 1000,
    question_tokens: tuple[int, int] = (16, 128),
    output_mean: float = 150.0,
) -> Workload:
    """Retrieval-augmented generation over a fixed corpus.

    Poisson arrivals at ``rate`` req/s (default 8) for ``duration`` s. A corpus of ``documents``
    (5000) documents of lognormal(``doc_mean`` = 800, 0.5), 64..8192 tokens, whose popularity is
    Zipf(``zipf`` = 1.0) over a seeded random ranking. Each prompt = the shared
    ``system_tokens`` (1000) system prompt + ``docs_per_request`` (4) distinct documents drawn by
    popularity, in draw order (most relevant first) + a question of uniform ``question_tokens``
    (16..128). Prefix sharing is therefore the system prompt always, then as far as the leading
    documents agree. Outputs lognormal(``output_mean`` = 150, 0.8), 1..4096.
    """
    _check_positive(duration=duration, rate=rate, doc_mean=doc_mean)
    if not 1 <= docs_per_request <= documents:
        raise ValueError(f"docs_per_request must be in 1..documents, got {docs_per_request}")
    rng = np.random.default_rng([seed, 0xA6])
    salt = namespace_seed(f"rag:{seed}")
    doc_len = _lognormal(rng, doc_mean, 0.5, documents, 64, 8192)
    weights = 1.0 / np.arange(1, documents + 1) ** zipf
    weights /= weights.sum()
    perm = rng.permutation(documents)
    times = _poisson_times(rng, rate, 0.0, duration)
    n = times.shape[0]
    q_len = rng.integers(question_tokens[0], question_tokens[1] + 1, size=n)
    out = _lognormal(rng, output_mean, 0.8, n, 1, 4096)
    cdf = np.cumsum(weights)
    b = WorkloadBuilder(block_size)
    for r in range(n):
        picks = perm[_distinct_draws(rng, cdf, docs_per_request)]
        ids = [_seg(_SYSTEM, 0), *(_seg(_DOC, int(d)) for d in picks), _seg(_QUESTION, r)]
        lens = [system_tokens, *(int(doc_len[d]) for d in picks), int(q_len[r])]
        b.add(times[r], segment_block_hashes(ids, lens, block_size, salt), sum(lens), int(out[r]))
    return b.build(
        name="rag",
        description=(
            f"RAG scenario (seed {seed}): {documents} documents, Zipf {zipf}, "
            f"{docs_per_request} per request, {rate} req/s, {duration:.0f}s, "
            f"{block_size}-token blocks"
        ),
        meta={"scenario": "rag", "seed": seed},
    )


# ---------------------------------------------------------------------------------------------
def agent_scenario(
    *,
    seed: int = 0,
    duration: float = 300.0,
    block_size: int = 64,
    session_rate: float = 0.5,
    prefix_variants: int = 3,
    prefix_tokens: int = 12000,
    first_message_mean: float = 1500.0,
    turns_mean: float = 10.0,
    max_turns: int = 40,
    output_mean: float = 300.0,
    tool_result_mean: float = 1500.0,
    think_mean: float = 3.0,
    decode_seconds_per_token: float = 0.02,
    max_context: int = 128_000,
) -> Workload:
    """Multi-turn agent sessions whose prompt grows turn by turn.

    Sessions start as Poisson arrivals at ``session_rate`` per s (default 0.5) during ``duration``
    (their later turns may run past it). Each session uses one of ``prefix_variants`` (3) agent
    configurations — a shared tools + system prefix of ``prefix_tokens`` (12000) tokens — then a
    first user message (lognormal(``first_message_mean`` = 1500, 0.8)). It runs a geometric number
    of turns (mean ``turns_mean`` = 10, at most ``max_turns`` = 40, stopping before the prompt
    exceeds ``max_context``). Turn ``t + 1``'s prompt is turn ``t``'s prompt + its output
    (lognormal(``output_mean`` = 300, 0.8)) + a tool result (lognormal(``tool_result_mean`` =
    1500, 1.0)). Open loop: turn ``t + 1`` arrives ``output_tokens * decode_seconds_per_token``
    (nominal generation time, 0.02 s/token) + an exponential think time (mean ``think_mean`` = 3)
    after turn ``t`` arrived. Requests carry ``session`` = ``"agent-<n>"``.
    """
    _check_positive(duration=duration, session_rate=session_rate, turns_mean=turns_mean)
    if turns_mean < 1 or prefix_variants < 1 or max_turns < 1:
        raise ValueError("turns_mean, prefix_variants and max_turns must be >= 1")
    rng = np.random.default_rng([seed, 0xA9E])
    salt = namespace_seed(f"agent:{seed}")
    b = WorkloadBuilder(block_size)
    starts = _poisson_times(rng, session_rate, 0.0, duration)
    counter = 0
    for s, start in enumerate(starts.tolist()):
        turns = min(int(rng.geometric(1.0 / turns_mean)), max_turns)
        ids = [_seg(_SYSTEM, int(rng.integers(prefix_variants)))]
        lens = [prefix_tokens]
        counter += 1
        ids.append(_seg(_USER, counter))
        lens.append(int(_lognormal(rng, first_message_mean, 0.8, None, 8, 32768)))
        t = start
        for _ in range(turns):
            total = sum(lens)
            if total > max_context:
                break
            out = int(_lognormal(rng, output_mean, 0.8, None, 1, 4096))
            b.add(
                t,
                segment_block_hashes(ids, lens, block_size, salt),
                total,
                out,
                session=f"agent-{s}",
            )
            counter += 1
            ids.append(_seg(_OUTPUT, counter))
            lens.append(out)
            counter += 1
            ids.append(_seg(_TOOL, counter))
            lens.append(int(_lognormal(rng, tool_result_mean, 1.0, None, 1, 65536)))
            t += out * decode_seconds_per_token + float(rng.exponential(think_mean))
    return b.build(
        name="agent",
        description=(
            f"agent scenario (seed {seed}): {starts.shape[0]} sessions at {session_rate}/s, "
            f"~{turns_mean:g} turns, {prefix_tokens}-token shared prefix x{prefix_variants}, "
            f"{block_size}-token blocks"
        ),
        meta={"scenario": "agent", "seed": seed},
    )


SCENARIOS = {
    "endpoint": endpoint_scenario,
    "rag": rag_scenario,
    "agent": agent_scenario,
}
