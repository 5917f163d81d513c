//! Prefill/decode disaggregation: worker roles and [`Router::route_pd`], which routes a request
//! as a (prefill, decode) pair.
//!
//! # Roles
//! Every worker has a [`Role`]: it prefills, decodes, or does both (the default; a fleet without
//! roles is all `Both`). A worker *able to prefill* is `Prefill` or `Both`, one *able to decode*
//! `Decode` or `Both`. [`Router::route`] routes whole requests and so only considers workers able
//! to decode (a whole request decodes where it prefills); `route_pd` considers both phases. An
//! endpoint's pool has a prefill part and a decode part ([`super::endpoints`]); its reserved
//! blocks live on the prefill part.
//!
//! # A pair, step by step
//! `route_pd` runs the steps of `route` (check → match → pick → validate → commit) for both
//! halves, with one index walk:
//! 1. **Candidates**: the healthy workers able to decode (in the endpoint's decode pool, not
//!    excluded) and those able to prefill (likewise). No decode candidate →
//!    [`Error::NoWorker`](crate::Error::NoWorker).
//! 2. **Decode worker**: the decode candidate of least [`decode_cost`] — the KV its running
//!    requests hold once this one joins, less the prompt prefix it already holds (which it
//!    neither receives nor stores anew), per unit of weight (relative capacity, so the least
//!    cost is the most relative headroom). Ties go to the rendezvous order of the prefix, as in
//!    every policy.
//! 3. **Conditional disaggregation** ([`PdConfig`]): the prefill runs on the decode worker
//!    itself (`disaggregate = false`) when that worker may prefill ([`PdConfig::local_prefill`],
//!    or it is `Both`) and
//!    - no worker can prefill ([`PdReason::NoPrefill`]), or
//!    - the part of the prompt it does not hold (tokens minus its overlap credit × block size)
//!      is at most [`PdConfig::threshold`] tokens ([`PdReason::Short`]): shipping a short
//!      prefill costs more than computing it where it decodes; or
//!    - the prefill worker the router's policy picks (over the prefill candidates, prefix hits
//!      counting there) is the decode worker itself ([`PdReason::SameWorker`]); or
//!    - the prefill side is saturated ([`PdReason::Saturated`], when
//!      [`PdConfig::saturation`] is set): the `kv_aware` cost ([`super::policy::kv_cost`]:
//!      the queued work plus the blocks left to prefill, weighted by the requests they delay as
//!      the policy counts them over the prefill candidates) on the chosen prefill worker
//!      exceeds `saturation` × the same cost on the decode worker.
//!
//!    Otherwise the pair is disaggregated ([`PdReason::Remote`]): the prefill on the policy's
//!    prefill worker, the decode on the decode worker.
//! 4. **Validate and commit**: in approx mode the prompt is recorded on both workers (the
//!    decode worker receives the whole prompt's KV and caches it, as vLLM's and SGLang's do);
//!    the prefill pick's state change applies only when its worker is used.
//!
//! # Decisions and load
//! A disaggregated pair is two [`Decision`]s: the prefill half ([`Half::Prefill`]) on the
//! prefill worker, whose prefill blocks are the prompt blocks not cached there, and the decode
//! half ([`Half::Decode`]) on the decode worker, with no prefill blocks (it receives them).
//! Each is begun, (prefilled,) finished and observed on its own, with the usual guarantees; a
//! prefill half is finished once its KV is handed over. A pair that is not disaggregated is one
//! whole decision on the decode worker. Errors change nothing, as for `route`.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::blocks::TokenId;
use crate::error::{Error, Result};
use crate::hashing::Key;
use crate::value_err;

use super::decision::{Decision, Half};
use super::policy::{self, delayed_requests, kv_cost};
use super::route::{gather_candidates, no_worker, Made, RequestKeys};
use super::workers::{Worker, WorkerTable};
use super::{RouteRequest, Router, Scratch};

/// What a worker does.
#[allow(clippy::derivable_impls)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Prefills only (its KV goes to a decode worker).
    Prefill,
    /// Decodes only (it receives the KV; it may prefill a request itself, see
    /// [`PdConfig::local_prefill`]).
    Decode,
    /// Prefills and decodes (an ordinary, aggregated worker).
    Both,
}

impl Role {
    /// `"prefill"`, `"decode"` or `"both"`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    /// Whether a worker of this role does `phase`.
    pub fn does(self, phase: Phase) -> bool {
        !matches!(
            (self, phase),
            (Role::Prefill, Phase::Decode) | (Role::Decode, Phase::Prefill)
        )
    }
}

impl Default for Role {
    /// `Both`: an ordinary worker.
    fn default() -> Self {
        Role::Both
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Role {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" => Ok(Role::Both),
            other => value_err!("role must be 'prefill', 'decode' or 'both', got {other:?}"),
        }
    }
}

/// A phase of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Computing the prompt's KV.
    Prefill,
    /// Generating from it.
    Decode,
}

impl Phase {
    /// Both phases.
    pub const BOTH: [Phase; 2] = [Phase::Prefill, Phase::Decode];

    /// `"prefill"` or `"decode"`.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }
}

impl FromStr for Phase {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "prefill" => Ok(Phase::Prefill),
            "decode" => Ok(Phase::Decode),
            other => value_err!("phase must be 'prefill' or 'decode', got {other:?}"),
        }
    }
}

/// When [`Router::route_pd`] runs a request's prefill on its decode worker (see the module
/// docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdConfig {
    /// A request whose part not held by its decode worker is at most this many tokens is
    /// prefilled there (default 2048, measured: `kvroute simulate --pd`, README "P/D"; 0: only
    /// when nothing is left to compute).
    pub threshold: usize,
    /// The prefill side is saturated when the `kv_aware` cost on the chosen prefill worker
    /// exceeds this many times the cost on the decode worker (`None` or infinite: never, the
    /// threshold alone decides; the default). Must be >= 0.
    pub saturation: Option<f64>,
    /// Whether a `Decode` worker may prefill a request itself (default true, as vLLM's decode
    /// workers may: a request without KV transfer parameters is an ordinary request there;
    /// false for SGLang, whose decode servers only take KV from a prefill server). A `Both`
    /// worker always may.
    pub local_prefill: bool,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            threshold: 2048,
            saturation: None,
            local_prefill: true,
        }
    }
}

impl PdConfig {
    /// Checks that `saturation` is a number >= 0 (infinity allowed).
    pub fn check(&self) -> Result<()> {
        match self.saturation {
            Some(s) if s.is_nan() || s < 0.0 => {
                value_err!("pd_saturation must be >= 0 (or None: never), got {s}")
            }
            _ => Ok(()),
        }
    }
}

/// Why a pair is, or is not, disaggregated (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PdReason {
    /// Disaggregated: prefill and decode on different workers.
    Remote,
    /// The part of the prompt the decode worker lacks is within the threshold.
    Short,
    /// The prefill side costs more than `saturation` × prefilling on the decode worker.
    Saturated,
    /// The best prefill worker is the decode worker.
    SameWorker,
    /// No worker can prefill.
    NoPrefill,
}

impl PdReason {
    /// `"remote"`, `"short"`, `"saturated"`, `"same_worker"` or `"no_prefill"`.
    pub fn name(self) -> &'static str {
        match self {
            PdReason::Remote => "remote",
            PdReason::Short => "short",
            PdReason::Saturated => "saturated",
            PdReason::SameWorker => "same_worker",
            PdReason::NoPrefill => "no_prefill",
        }
    }
}

/// The answer of [`Router::route_pd`].
#[derive(Debug)]
pub struct PdDecision {
    /// The prefill half, when disaggregated (`None`: `decode` is the whole request).
    pub prefill: Option<Decision>,
    /// The decode half, or the whole request when not disaggregated.
    pub decode: Decision,
    /// Why.
    pub reason: PdReason,
}

impl PdDecision {
    /// True when prefill and decode run on different workers.
    pub fn disaggregate(&self) -> bool {
        self.prefill.is_some()
    }
}

/// The decode cost of `w` for a prompt of `prompt_blocks` blocks of which it holds `credit`:
/// the prompt blocks its running requests hold once this one joins, less what it already holds
/// of this prompt, per unit of weight (see the module docs).
pub(super) fn decode_cost(w: &Worker, prompt_blocks: usize, credit: f64) -> f64 {
    let held = w.total_decode_blocks() as f64 + (prompt_blocks as f64 - credit).max(0.0);
    held / w.weight
}

/// The decode candidate of least [`decode_cost`] (ties: rendezvous order of `tie_key`), with
/// the cost of every candidate. Pure.
pub(super) fn pick_decode(
    workers: &WorkerTable,
    candidates: &[u32],
    credit: &[f64],
    prompt_blocks: usize,
    tie_key: Key<'_>,
) -> Result<policy::Pick> {
    policy::least_cost(workers, candidates, credit, tie_key, |w, c| {
        decode_cost(w, prompt_blocks, c)
    })
}

/// Where the prefill of a pair runs.
enum Plan {
    /// On the decode worker.
    Local(PdReason),
    /// On another worker: the policy's pick (and that worker's name and uid).
    Remote(policy::Pick, (Arc<str>, u64)),
}

impl Router {
    /// Hashes `tokens` for `endpoint` and routes them as a pair (a convenience over
    /// [`Router::tokens_request`] + [`Router::route_pd`]).
    pub fn route_pd_tokens<T: TokenId>(
        &mut self,
        tokens: &[T],
        endpoint: Option<&str>,
        now: f64,
    ) -> Result<PdDecision> {
        let req = self.tokens_request(tokens, None, endpoint, now)?;
        self.route_pd(req)
    }

    /// Routes one request as a prefill/decode pair (see the module docs). `exclude` applies to
    /// both halves.
    ///
    /// Errors change nothing, as for [`Router::route`]; no decode candidate (or, when decode
    /// workers may not prefill, no prefill candidate and no `Both` decode candidate) is
    /// [`Error::NoWorker`].
    pub fn route_pd(&mut self, req: RouteRequest<'_>) -> Result<PdDecision> {
        // 1. Check the request and gather both phases' candidates.
        let prompt_tokens = self.check_request(&req)?;
        let endpoint = self.endpoint_arc(req.endpoint)?;
        let pd = self.config.pd;
        let Scratch {
            candidates,
            decoders,
            ..
        } = &mut self.scratch;
        let ep = endpoint.as_ref().and_then(|e| self.endpoints.get(e));
        let workers = &self.workers;
        gather_candidates(workers, ep, req.exclude, super::Phase::Decode, decoders)?;
        gather_candidates(workers, ep, req.exclude, super::Phase::Prefill, candidates)?;
        if candidates.is_empty() && !pd.local_prefill {
            // Only a worker that does both can take the whole request.
            decoders.retain(|&s| workers.get(s).is_some_and(|w| w.role == Role::Both));
        }
        if decoders.is_empty() {
            return Err(no_worker(workers, ep, req.exclude, super::Phase::Decode));
        }

        // 2. Match: one index walk gives every worker's credit.
        let shared = self.index.clone();
        let mut index = shared.write();
        self.expire_idle(&mut index, req.now);
        self.credit(&index, &req.hashes, req.now);

        // 3. Pick the decode worker, then where the prefill runs (all pure).
        let keys = RequestKeys::of(&req, endpoint.as_ref());
        let prompt_blocks = req.hashes.len();
        let decode_pick = pick_decode(
            &self.workers,
            &self.scratch.decoders,
            &self.scratch.credit,
            prompt_blocks,
            keys.tie,
        )?;
        let d = decode_pick.slot;
        let plan = self.plan(d, &keys, prompt_tokens, prompt_blocks)?;

        // 4. Validate (approx): the chain must agree with the index (the last step that can
        //    fail; on the decode worker first, which leaves the chain stored in the index).
        let d_who = self.who(d)?;
        self.validate_on(&mut index, d, &req.hashes)?;

        // 5. Commit: nothing fails from here on.
        let d_mark = self.commit_on(&mut index, d, &req.hashes, endpoint.as_ref(), req.now);
        let prompt = (prompt_tokens, prompt_blocks);
        let (prefill, reason) = match plan {
            Plan::Remote(p, who) => {
                // The chain is stored in the index now (the decode worker's validation), so
                // storing it for another worker follows the same path and cannot fail.
                let stored = self.validate_on(&mut index, p.slot, &req.hashes);
                debug_assert!(
                    stored.is_ok(),
                    "validated for the decode worker: {stored:?}"
                );
                let p_mark = match stored {
                    Ok(()) => {
                        self.commit_on(&mut index, p.slot, &req.hashes, endpoint.as_ref(), req.now)
                    }
                    Err(_) => None,
                };
                policy::commit(
                    p.effect,
                    p.slot,
                    &self.scratch.candidates,
                    &mut self.workers,
                    &mut self.rng,
                );
                let made = Made {
                    slot: p.slot,
                    who,
                    reason: p.reason,
                    scores: p.scores,
                    half: Half::Prefill,
                    mark: p_mark,
                };
                let hashes = req.hashes.clone();
                let half = self.decision(made, prompt, hashes, endpoint.clone());
                (Some(half), PdReason::Remote)
            }
            Plan::Local(why) => (None, why),
        };
        drop(index);
        let made = Made {
            slot: d,
            who: d_who,
            reason: decode_pick.reason,
            scores: decode_pick.scores,
            half: if prefill.is_some() {
                Half::Decode
            } else {
                Half::Whole
            },
            mark: d_mark,
        };
        let hashes = req.hashes;
        let decode = self.decision(made, prompt, hashes, endpoint);
        Ok(PdDecision {
            prefill,
            decode,
            reason,
        })
    }

    /// Step 3: where the prefill of a request decoding on slot `d` runs (see the module docs).
    fn plan(
        &mut self,
        d: u32,
        keys: &RequestKeys<'_>,
        prompt_tokens: usize,
        prompt_blocks: usize,
    ) -> Result<Plan> {
        let pd = self.config.pd;
        let Some(dw) = self.workers.get(d) else {
            return Err(super::route::picked_missing(d));
        };
        let local_ok = pd.local_prefill || dw.role == Role::Both;
        if self.scratch.candidates.is_empty() {
            return Ok(Plan::Local(PdReason::NoPrefill));
        }
        let d_credit = self.scratch.credit.get(d as usize).copied().unwrap_or(0.0);
        let block_size = self.config.block_size as f64;
        let uncached = (prompt_tokens as f64 - d_credit * block_size).max(0.0);
        if local_ok && uncached <= pd.threshold as f64 {
            return Ok(Plan::Local(PdReason::Short));
        }
        // Both costs count each prefilled block as delaying as many requests as the policy's
        // view of the prefill side says.
        let delayed = delayed_requests(&self.workers, &self.scratch.candidates);
        let local_cost = kv_cost(dw, prompt_blocks, d_credit, delayed, self.config.weights);
        let p = self.pick(keys, prompt_blocks)?;
        if p.slot == d {
            return Ok(Plan::Local(PdReason::SameWorker));
        }
        if let (true, Some(saturation)) = (local_ok, pd.saturation.filter(|s| s.is_finite())) {
            let p_credit = self.scratch.credit.get(p.slot as usize).copied();
            let remote_cost = self.workers.get(p.slot).map(|pw| {
                kv_cost(
                    pw,
                    prompt_blocks,
                    p_credit.unwrap_or(0.0),
                    delayed,
                    self.config.weights,
                )
            });
            if remote_cost.is_some_and(|c| c > saturation * local_cost) {
                return Ok(Plan::Local(PdReason::Saturated));
            }
        }
        let who = self.who(p.slot)?;
        Ok(Plan::Remote(p, who))
    }
}
