//! Engine KV events (vLLM, SGLang) → the router's prefix indexes.
//!
//! Engines publish, per scheduler step, a msgpack batch of `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared` events (wire format: `tests/data/vectors/KV_EVENTS_SPEC.md`). [`decode`]
//! turns one payload into a reusable [`Batch`]; [`Applier`] applies batches, per worker, to a
//! shared [`crate::index::PrefixIndex`] (the GPU tier) and to one index per other storage tier.
//! Transport (ZMQ sockets, sequence numbers, replay) lives in Python (`kvroute.events`); it calls
//! [`Applier::apply`] with each payload and [`Applier::clear_worker`] when it loses track.
//!
//! # Guarantees
//! - **A malformed payload changes nothing.** The whole payload is decoded before any event is
//!   applied; a decode error only increments the worker's `malformed` counter.
//! - **Sound, never guessing.** Every (worker, block) the index gains is one the engine reported
//!   holding, keyed so that a later `match` of the same tokens finds it. When an event cannot be
//!   placed exactly it is skipped and counted (`skipped_*`), never approximated:
//!   - a `BlockStored` whose parent the worker is not known to hold is skipped — storing it as a
//!     new root would claim a prefix match for tokens whose earlier blocks the router never saw
//!     (and in rehash mode its hashes cannot even be computed without the parent's chain state).
//!     Such chains come back when the engine stores them again from the start (vLLM 0.33 re-emits
//!     prefix-cache hits from block 0);
//!   - a partial block (`len(token_ids) != len(block_hashes) * block_size`, or on the GPU a
//!     store smaller than both the router's block and the engine's, e.g. vLLM 0.33 partial
//!     windows or SGLang's short last page) is skipped;
//!   - only KV-cache group `group_idx` (default 0) is followed: in hybrid models a sliding-window
//!     group evicts blocks the full-attention group still holds;
//!   - in rehash mode, keys the router cannot reproduce from the event (multimodal items, prompt
//!     embedding digests, vLLM 0.33 lookahead tokens) make the store skipped.
//! - **Removals and clears are exact.** `BlockRemoved` drops the router blocks of each named engine
//!   block and, as the index does, every block after them; unknown hashes are ignored.
//!   `AllBlocksCleared` clears the worker in every tier.
//! - **Tiers are separate.** `medium` nil or `"GPU"` goes to the main index; any other medium
//!   (`"CPU"`, `"STORAGE"`, SGLang's `"CPU_PINNED"`, `"DISK"`, `"EXTERNAL"`, …) to its own index
//!   ([`Applier::tier_index`]), created on first use with the main index's budget, at most
//!   [`MAX_TIERS`] of them. A CPU hit is never a GPU hit; the router scores tiers separately.
//!
//! # Rehash and direct mode
//! - **Rehash** (default): the router recomputes its own block hashes from each event's
//!   `token_ids` with a [`crate::blocks::BlockHasher`] of its profile and block size, continuing
//!   from the chain state it recorded for the parent. Per worker and tier it keeps
//!   `engine hash → last own block` (for `native`, also the chain state), plus the first own block
//!   when an engine block spans several router blocks and the 32-byte digest for `vllm`/`sglang`,
//!   so that children can be chained and removals translated. It works whatever hash algorithm, seed or
//!   `PYTHONHASHSEED` the engine uses. Namespaces follow the engine: a cache salt (vLLM: the
//!   string extra key of a sequence's first block; SGLang: `cache_salt`) and `lora_name` select a
//!   hasher with that salt / LoRA name (LoRA path `""`: events do not carry it), so the router's
//!   `BlockHasher(salt=..., lora_name=...)` finds them and tenants never share blocks.
//! - **Direct**: the engine's hashes are the keys (the router's `hash_profile` must reproduce the
//!   engine's, e.g. `vllm` for vLLM ≥ 0.29 with `sha256_cbor`, or `sglang`). No map is kept.
//!
//! # Block sizes
//! A `BlockStored` carries the engine's block size `E`; the router's is `R`.
//! - `E == R`: one router block per engine block.
//! - Rehash, `E = k·R`: each engine block becomes `k` router blocks (its removal drops the first
//!   of them and so all `k`). Lossless.
//! - Rehash, `E < R` dividing `R` (SGLang's default page of 1 token): pages are gathered into
//!   router blocks, each indexed once the engine has reported all its pages in one chain (see
//!   `pages`). On the GPU a store smaller than the engine's block size (the largest since the
//!   worker was last cleared) is a partial block, skipped (`skipped_partial`), as is any other
//!   `E < R` (direct mode, or not a divisor). `E > R` not a multiple of `R` (or, in direct mode,
//!   `E != R`) is skipped (`skipped_block_size`).
//!   A divisor works in rehash mode, but the index then matches router blocks the engine holds
//!   only as part of a whole engine block: the applier records each engine's `E` in
//!   [`EngineBlockSizes`] (shared with the router that built it), and the router counts each
//!   worker's match in whole blocks of its engine's size — what the engine serves. Read directly,
//!   the index may count up to `E - R` tokens more. Choosing `R` equal to the engine's block size
//!   (vLLM's GPU default: 16 up to 0.33, 64 from 0.34; 128 on CPU; SGLang: its `page_size`)
//!   keeps the index smallest. An engine's `E` ([`WorkerCounters::engine_block_size`]) is the
//!   largest block size of its GPU stores since it was last cleared: a vLLM 0.33 partial-window
//!   entry names its window's length and a KV connector's CPU or storage tier its own size,
//!   neither of which is the GPU's block.
//! - In rehash mode with `E = k·R`, a vLLM partial window whose length is a multiple of `R` is
//!   stored as whole router blocks, which is what the engine holds for those tokens.
//!
//! # Memory
//! The per-worker map holds one entry per engine block the worker holds (removals and clears
//! prune it): 16 bytes plus the hash table's overhead with the `native` profile and engine blocks
//! of the router's size; +16 bytes when engine blocks span several router blocks, +40 bytes for
//! the digest profiles. Decoding reuses the applier's buffers; nothing is allocated per block
//! except map growth. Consecutive `BlockRemoved` events (vLLM sends one per evicted block) are
//! gathered, translated in one pass over the per-worker map and applied to the index in one call
//! (which cuts each tree node once).

mod apply;
pub mod decode;
mod extra;
mod keys;
mod pages;
mod reader;
mod sizes;

pub use apply::{
    Applier, BatchOutcome, Config, Mode, TierRegistry, WorkerCounters, GPU, MAX_TIERS,
};
pub use decode::{Batch, Decoder, Event, EventKind};
pub use extra::{ExtraKeys, ExtraSummary};
pub use sizes::EngineBlockSizes;

#[cfg(test)]
mod tests;
