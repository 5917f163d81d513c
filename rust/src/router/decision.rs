//! A routing decision and its lifecycle: routed → begun → (prefilled) → finished, or routed (or
//! begun) → withdrawn when the request never ran on its worker.
//!
//! Invariants: a decision is begun at most once and finished at most once, only after it was
//! begun, and only by the router that made it; `prefilled` and `observe` apply at most once each;
//! a withdrawn decision was never prefilled, observed or finished, and nothing applies to it
//! after.
//! The state lives in the decision itself (atomic flags), and the router changes it only while
//! holding its own lock, together with the load counters it accounts for — so counters stay
//! exact when decisions are shared between threads.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use crate::blocks::Profile;
use crate::cache::TouchMark;

use super::policy::{Policy, Reason};

const BEGUN: u8 = 1;
const PREFILLED: u8 = 2;
const FINISHED: u8 = 4;
const OBSERVED: u8 = 8;
const WITHDRAWN: u8 = 16;
const IN_FLIGHT: u8 = 32;

/// Where a decision is in its lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Returned by `route`, not begun.
    Routed,
    /// Begun, not finished.
    Active,
    /// Finished.
    Finished,
    /// Withdrawn: the request never ran on its worker ([`super::Router::withdraw`]).
    Withdrawn,
}

impl Stage {
    /// `"routed"`, `"active"`, `"finished"` or `"withdrawn"`.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Routed => "routed",
            Stage::Active => "active",
            Stage::Finished => "finished",
            Stage::Withdrawn => "withdrawn",
        }
    }
}

/// Which part of a request a decision is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    /// The whole request: prefill and decode on one worker ([`super::Router::route`], or a
    /// pair that is not disaggregated).
    Whole,
    /// The prefill of a disaggregated pair: its worker computes the prompt's KV and hands it
    /// over.
    Prefill,
    /// The decode of a disaggregated pair: its worker receives the KV (no prefill work of its
    /// own) and generates.
    Decode,
}

impl Half {
    /// `"whole"`, `"prefill"` or `"decode"`.
    pub fn name(self) -> &'static str {
        match self {
            Half::Whole => "whole",
            Half::Prefill => "prefill",
            Half::Decode => "decode",
        }
    }
}

/// The answer of [`super::Router::route`]: which worker, why, and how much of the prompt it is
/// expected to hold.
#[derive(Debug)]
pub struct Decision {
    /// Unique per router (1, 2, …).
    pub id: u64,
    pub(super) router: u64,
    /// The chosen worker.
    pub worker: Arc<str>,
    pub(super) worker_uid: u64,
    pub(super) slot_hint: u32,
    /// The policy that chose.
    pub policy: Policy,
    /// Why (see [`Reason`]).
    pub reason: Reason,
    /// The part of the request it is for.
    pub half: Half,
    /// Tokens per block.
    pub block_size: usize,
    /// Prompt length in tokens (blocks × block size when block hashes were given).
    pub prompt_tokens: usize,
    /// Full blocks of the prompt.
    pub prompt_blocks: usize,
    /// Leading prompt blocks the chosen worker is expected to serve from its cache: the blocks it
    /// holds per the index (raw, before freshness; whole blocks of its engine's size once known),
    /// capped as the engine caps its hit ([`engine_hit_blocks`]).
    pub cached_blocks: usize,
    /// Leading prompt blocks the chosen worker holds per the index (in whole engine blocks once
    /// its engine's size is known), uncapped.
    pub(super) matched_blocks: usize,
    /// Events mode: leading prompt blocks held by the requests in flight on the chosen worker
    /// when routed (begun, not finished); a worker serving its queue in order will hold
    /// `max(cached_blocks, inflight_blocks)` when it reaches this request (capped as
    /// `cached_blocks` is). 0 in approx mode, whose index records each prompt where it is routed.
    pub inflight_blocks: usize,
    /// The endpoint the request was routed for.
    pub endpoint: Option<Arc<str>>,
    /// The scheduling priority to ask the engine for: the endpoint's (0 without one); higher is
    /// served first (see [`super::endpoints`]).
    pub priority: i32,
    /// The prompt's block hashes: the approx model records them; in events mode they are the
    /// worker's in-flight blocks from `begin` to `finish`.
    pub(super) hashes: Vec<u64>,
    /// Worker names by slot when the decision was made (for `scores`).
    pub(super) roster: Arc<[Option<Arc<str>>]>,
    pub(super) scores: Vec<(u32, f64)>,
    /// Approx mode: the worker's touch order right after the route recorded the prompt (what
    /// only this decision touched since can be withdrawn exactly).
    pub(super) mark: Option<TouchMark>,
    /// Lifecycle flags (a new decision: `Default`, none set).
    pub(super) state: AtomicU8,
}

impl Decision {
    /// `cached_blocks × block_size`: prompt tokens expected to be served from the cache.
    pub fn cached_tokens(&self) -> usize {
        self.cached_blocks.saturating_mul(self.block_size)
    }

    /// Blocks the worker is expected to prefill: prompt blocks neither cached nor held by the
    /// requests in flight there (none for a decode half, whose worker receives them).
    pub fn prefill_blocks(&self) -> usize {
        match self.half {
            Half::Decode => 0,
            Half::Whole | Half::Prefill => {
                let held = self.cached_blocks.max(self.inflight_blocks);
                self.prompt_blocks.saturating_sub(held)
            }
        }
    }

    /// The value the policy compared for each worker it considered (see
    /// [`super::policy`]), as `(worker, value)`.
    pub fn scores(&self) -> impl Iterator<Item = (&Arc<str>, f64)> + '_ {
        self.scores
            .iter()
            .filter_map(|&(s, v)| Some((self.roster.get(s as usize)?.as_ref()?, v)))
    }

    /// The lifecycle stage.
    pub fn stage(&self) -> Stage {
        let s = self.state.load(Ordering::Acquire);
        if s & WITHDRAWN != 0 {
            Stage::Withdrawn
        } else if s & FINISHED != 0 {
            Stage::Finished
        } else if s & BEGUN != 0 {
            Stage::Active
        } else {
            Stage::Routed
        }
    }

    /// True once `prefilled` was applied.
    pub fn is_prefilled(&self) -> bool {
        self.state.load(Ordering::Acquire) & PREFILLED != 0
    }

    /// True once `observe` was applied.
    pub fn is_observed(&self) -> bool {
        self.state.load(Ordering::Acquire) & OBSERVED != 0
    }

    pub(super) fn set_begun(&self) {
        self.state.fetch_or(BEGUN, Ordering::AcqRel);
    }

    pub(super) fn set_prefilled(&self) {
        self.state.fetch_or(PREFILLED, Ordering::AcqRel);
    }

    pub(super) fn set_finished(&self) {
        self.state.fetch_or(FINISHED, Ordering::AcqRel);
    }

    pub(super) fn set_withdrawn(&self) {
        self.state.fetch_or(WITHDRAWN, Ordering::AcqRel);
    }

    pub(super) fn set_observed(&self) {
        self.state.fetch_or(OBSERVED, Ordering::AcqRel);
    }

    /// True while the decision's prompt counts among its worker's in-flight blocks.
    pub(super) fn is_in_flight(&self) -> bool {
        self.state.load(Ordering::Acquire) & IN_FLIGHT != 0
    }

    pub(super) fn set_in_flight(&self) {
        self.state.fetch_or(IN_FLIGHT, Ordering::AcqRel);
    }
}

/// The blocks of a `prompt_tokens`-token prompt an engine serves from its cache when it holds
/// `held` leading blocks of `block_size`. vLLM (v1 engine; `KVCacheManager.get_computed_blocks`
/// caps the hit at `num_tokens - 1`, 0.9 to 0.32 at least, earlier v1 releases dropped the last
/// block of a fully cached prompt) and SGLang (`max_prefix_len = input_len - 1`, rounded down to
/// its page) always compute at least the prompt's last token for its logits, so a fully cached
/// prompt whose length is a multiple of the block size gets one block fewer:
/// `min(held, (prompt_tokens - 1) / block_size)`. Other profiles: `held`. With the engine's own
/// block size known (`engine`, tokens), both are counted in whole engine blocks first
/// ([`whole_engine_blocks`]).
pub(super) fn engine_hit_blocks(
    profile: Profile,
    prompt_tokens: usize,
    block_size: usize,
    engine: Option<u32>,
    held: usize,
) -> usize {
    let held = whole_engine_blocks(held as u64, block_size, engine) as usize;
    match profile {
        Profile::Vllm(_) | Profile::Sglang => {
            let last = prompt_tokens.saturating_sub(1) as u128;
            held.min(engine_tokens_in_blocks(last, block_size, engine) as usize)
        }
        Profile::Native => held,
    }
}

/// Of `blocks` leading router blocks (`block_size` tokens each), those an engine caching blocks
/// of `engine` tokens can hold: the whole engine blocks within them, in router blocks (rounded
/// down). An engine caches and hits whole blocks of its own size only, so with router blocks of
/// 16 and engine blocks of 64 a prefix of 7 router blocks is 4 (one engine block); a worker whose
/// engine block size is not known (`None`) is taken at its word: `blocks`.
pub(super) fn whole_engine_blocks(blocks: u64, block_size: usize, engine: Option<u32>) -> u64 {
    let tokens = u128::from(blocks) * block_size as u128;
    engine_tokens_in_blocks(tokens, block_size, engine)
}

/// The whole engine blocks within `tokens` tokens, in router blocks (rounded down).
fn engine_tokens_in_blocks(tokens: u128, block_size: usize, engine: Option<u32>) -> u64 {
    let router = (block_size as u128).max(1);
    let engine = engine.map_or(router, |e| u128::from(e.max(1)));
    u64::try_from(tokens / engine * engine / router).unwrap_or(u64::MAX)
}
