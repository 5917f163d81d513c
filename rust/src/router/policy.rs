//! Routing policies: how a worker is picked among the candidates (healthy, in the endpoint's pool
//! if any, not excluded).
//!
//! A pick is a pure function of the router's state ([`View`]) and the request ([`Request`]): it
//! changes nothing, and returns the choice together with the state change it implies
//! ([`Effect`]: the generator's next state, the round-robin step), which the router applies with
//! [`commit`] only once the decision stands. Every policy is deterministic given the router's
//! state and seed, and picks only a candidate. The value each policy compares is what
//! [`super::Decision::scores`] reports:
//!
//! - `random`: a candidate drawn with probability `weight / Σ weight` (SplitMix64 seeded by the
//!   router's `seed`; a draw `u = (x >> 11) · 2⁻⁵³` picks the first candidate, in slot order,
//!   whose cumulative weight exceeds `u · Σ weight`). Scores: the probabilities.
//! - `round_robin`: smooth weighted round robin (nginx): every candidate's current weight grows
//!   by its weight, the largest (first in slot order on ties) is picked and loses `Σ weight`.
//!   Scores: the current weights compared.
//! - `least_loaded`: the fewest active requests per unit of weight. Scores: that load.
//! - `power_of_two`: two distinct candidates drawn uniformly (first `⌊u₁·n⌋`, then `⌊u₂·(n−1)⌋`
//!   skipping the first), the lower load wins, the first drawn on ties. Scores: the two loads.
//! - `hash`: the candidates in the rendezvous order of the request's hash key, walked with
//!   bounded loads ([`crate::hashing::BoundedLoad`]: the first whose active requests are under
//!   `ceil(c · (T + 1) · w / Σw)`). Scores: the active requests of the workers probed.
//! - `kv_aware`: the minimum of one continuous cost per candidate ([`kv_cost`]): the seconds of
//!   waiting and prefilling the choice costs, this request's and the fleet's, counted in blocks
//!   (the time to prefill one block on a weight-1 worker):
//!
//!   `cost = (queue_weight · prefill_blocks + (1 + delayed) · left + decode_weight ·
//!   written_blocks) / weight`,  `left = prompt_blocks − credit`,
//!   `delayed = 1 + min over the candidates of queued`
//!
//!   `credit` is what the worker will hold of the prompt when it reaches the request: its cached
//!   overlap (scaled by its index freshness; in events mode blocks found only in a slower tier
//!   count at that tier's weight) or, if longer, the prefix held by the requests already begun
//!   there and not finished (in events mode from the router's own in-flight record: the engine
//!   announces blocks only once they are computed, and a worker serves its queue in order).
//!   `prefill_blocks` is the work queued there, each request counted at what it has left to
//!   prefill after those hits; `queued` counts those requests. The request waits for the queue
//!   and its own `left` blocks (its time to first token), and each of its `left` blocks is paid
//!   again by the requests that will wait behind it: at least one (the next request there, or
//!   the one that finds a block it needed evicted to make room), plus, when every candidate is
//!   busy, as many as wait at the least busy one — the fleet has no idle capacity then, so the
//!   work a choice adds delays that many others. Where some worker is idle, the cost is close to
//!   the request's own time to first token; as the fleet saturates, recomputing a prefix that is
//!   cached elsewhere grows dearer than waiting for it. `written_blocks`, the blocks the
//!   worker's active requests add to its cache, each evict a cached block and hold memory while
//!   they run; the term mostly orders workers whose queues are equal. No threshold switches
//!   between affinity and balance.
//!
//! Ties (costs within 1e-9 relative, equal loads) go to the tied candidate ranked first by
//! rendezvous hashing of the request's prefix (its first block hash), so repeated requests with
//! the same prefix agree from the very first one.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::hashing::{BoundedLoad, Key, RendezvousScore};
use crate::value_err;

use super::workers::{rendezvous_order, Worker, WorkerTable};

/// A routing policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Weighted random.
    Random,
    /// Smooth weighted round robin.
    RoundRobin,
    /// Fewest active requests per unit of weight.
    LeastLoaded,
    /// Best of two random candidates.
    PowerOfTwo,
    /// Consistent hashing of the request key with bounded loads.
    Hash,
    /// Minimum of the continuous cost of waiting and prefilling (see the module docs).
    KvAware,
}

impl Policy {
    /// All policies.
    pub const ALL: [Policy; 6] = [
        Policy::Random,
        Policy::RoundRobin,
        Policy::LeastLoaded,
        Policy::PowerOfTwo,
        Policy::Hash,
        Policy::KvAware,
    ];

    /// The policy's name as accepted by [`Policy::from_str`].
    pub fn name(self) -> &'static str {
        match self {
            Policy::Random => "random",
            Policy::RoundRobin => "round_robin",
            Policy::LeastLoaded => "least_loaded",
            Policy::PowerOfTwo => "power_of_two",
            Policy::Hash => "hash",
            Policy::KvAware => "kv_aware",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Policy::ALL
            .iter()
            .copied()
            .find(|p| p.name() == s)
            .map_or_else(
                || {
                    value_err!(
                        "policy must be one of 'random', 'round_robin', 'least_loaded', \
                         'power_of_two', 'hash', 'kv_aware', got {s:?}"
                    )
                },
                Ok,
            )
    }
}

/// Why a worker was picked (for metrics and logs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// `kv_aware`: the chosen worker holds part of the prompt.
    Prefix,
    /// `kv_aware`: no overlap on the chosen worker; load decided.
    Load,
    /// `random`.
    Random,
    /// `round_robin`.
    RoundRobin,
    /// `least_loaded`.
    LeastLoaded,
    /// `power_of_two`.
    PowerOfTwo,
    /// `hash`: the key's first choice.
    Hash,
    /// `hash`: the first choice was over the load bound; a later one took it.
    HashBounded,
}

impl Reason {
    /// A short, stable name.
    pub fn name(self) -> &'static str {
        match self {
            Reason::Prefix => "prefix",
            Reason::Load => "load",
            Reason::Random => "random",
            Reason::RoundRobin => "round_robin",
            Reason::LeastLoaded => "least_loaded",
            Reason::PowerOfTwo => "power_of_two",
            Reason::Hash => "hash",
            Reason::HashBounded => "hash_bounded",
        }
    }
}

/// The weights of the `kv_aware` cost's load terms, in blocks of prefill per unit of load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostWeights {
    /// Per block queued for prefill on the worker (default 1: on a worker that serves its queue
    /// in order, each block queued ahead delays the request by one block's prefill; the queue is
    /// counted at what each request has left after its cache hits, in-flight prefixes included).
    pub queue: f64,
    /// Per block the worker's active requests add to its cache (their prompt blocks not held
    /// there when routed; default 0.05). Each such block evicts a cached block of some other
    /// prefix, and while its request runs it is KV memory that admits no other prompt; both cost
    /// a fraction of a block's prefill. Counting the blocks a request *adds*, not those it
    /// holds, keeps a conversation's many turns over one shared prefix from counting that prefix
    /// once per turn. The term orders workers whose queues are equal: it spreads cache churn
    /// evenly, which keeps every worker's LRU as long-lived as the others'. In the README's
    /// sweeps (Mooncake, Claude Code sessions on 4 and 8 workers, RAG, agent; 31 points) 0.02 and
    /// 0.05 meet the goal at every point; 0.2 misses one (Mooncake at 114% offered load: hit
    /// 0.84x the best peer's); without the term the Mooncake hit rate at light load falls from
    /// 23.6% to 21.8% (0.89x the best peer's): requests without a prefix pile where churn is.
    pub decode: f64,
}

impl Default for CostWeights {
    fn default() -> Self {
        CostWeights {
            queue: 1.0,
            decode: 0.05,
        }
    }
}

impl CostWeights {
    /// Checks that both weights are finite and >= 0.
    pub fn check(&self) -> Result<()> {
        for (what, v) in [("queue_weight", self.queue), ("decode_weight", self.decode)] {
            if !(v.is_finite() && v >= 0.0) {
                return value_err!("{what} must be finite and >= 0, got {v}");
            }
        }
        Ok(())
    }
}

/// SplitMix64 (Steele, Lea & Flood 2014): the router's seeded generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64-bit output.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw in `[0, 1)` with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// What a pick reads of the router (a pick never changes it).
pub(super) struct View<'a> {
    /// The workers (their rendezvous scores give the `hash` order and the tie-breaks).
    pub workers: &'a WorkerTable,
    /// The generator's current state (`random`, `power_of_two` draw from a copy).
    pub rng: SplitMix64,
    pub bound: BoundedLoad,
    pub weights: CostWeights,
}

/// One request as a pick sees it.
pub(super) struct Request<'a> {
    /// Candidate slots, ascending, not empty.
    pub candidates: &'a [u32],
    /// Prompt length in blocks.
    pub prompt_blocks: usize,
    /// Overlap credit by slot (freshness and tiers applied).
    pub credit: &'a [f64],
    /// The key `hash` routes by.
    pub hash_key: Key<'a>,
    /// The key ties are broken by (the prefix).
    pub tie_key: Key<'a>,
}

/// Reused buffers of a pick (nothing is kept in them between picks).
#[derive(Default)]
pub(super) struct Buffers {
    scored: Vec<(RendezvousScore, u32)>,
    order: Vec<u32>,
    loads: Vec<u64>,
    shares: Vec<f64>,
}

/// The state change a pick implies, applied by [`commit`] once the decision stands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Effect {
    /// Nothing changes (`least_loaded`, `hash`, `kv_aware`).
    None,
    /// The generator moves to this state (`random`, `power_of_two`).
    Rng(SplitMix64),
    /// Smooth weighted round robin: every candidate's current weight grows by its weight, and
    /// the chosen one's then loses `total` (the candidates' summed weight).
    RoundRobin { total: f64 },
}

/// The outcome of a pick.
pub(super) struct Pick {
    pub slot: u32,
    pub reason: Reason,
    /// `(slot, value)` per worker considered (see the module docs).
    pub scores: Vec<(u32, f64)>,
    pub effect: Effect,
}

impl Pick {
    fn new(slot: u32, reason: Reason, scores: Vec<(u32, f64)>) -> Self {
        Pick {
            slot,
            reason,
            scores,
            effect: Effect::None,
        }
    }
}

/// The `kv_aware` cost of `w` for a prompt of `prompt_blocks` blocks of which `credit` will be
/// cached there, when each block it prefills delays `delayed` other requests (see the module
/// docs): the queue ahead, the request's own prefill and the prefill it imposes on others, and
/// the memory held by running requests — in blocks of prefill on a weight-1 worker.
pub(super) fn kv_cost(
    w: &Worker,
    prompt_blocks: usize,
    credit: f64,
    delayed: f64,
    weights: CostWeights,
) -> f64 {
    let left = (prompt_blocks as f64 - credit).max(0.0);
    let work = weights.queue * w.total_prefill_blocks() as f64
        + (1.0 + delayed) * left
        + weights.decode * w.total_written_blocks() as f64;
    work / w.weight
}

/// How many requests each prefilled block delays besides its own (see the module docs): one, plus
/// the requests queued at the least busy candidate.
pub(super) fn delayed_requests(workers: &WorkerTable, candidates: &[u32]) -> f64 {
    let least = candidates
        .iter()
        .filter_map(|&s| workers.get(s).map(|w| w.total_queued()))
        .min()
        .unwrap_or(0);
    1.0 + least as f64
}

/// Picks a candidate by `policy` (see the module docs); changes nothing. Fails only without a
/// candidate ([`Error::NoWorker`]).
pub(super) fn pick(
    policy: Policy,
    view: &View<'_>,
    req: &Request<'_>,
    buf: &mut Buffers,
) -> Result<Pick> {
    let workers = view.workers;
    let Some(&first) = req.candidates.first() else {
        return Err(no_candidate());
    };
    let weight = |s: u32| workers.get(s).map_or(1.0, |x| x.weight);
    let load = |s: u32| workers.get(s).map_or(0.0, |x| x.request_load());
    match policy {
        Policy::Random => {
            let mut rng = view.rng;
            let total: f64 = req.candidates.iter().map(|&s| weight(s)).sum();
            let target = rng.next_f64() * total;
            let mut acc = 0.0;
            let mut chosen = req.candidates.last().copied().unwrap_or(first);
            for &s in req.candidates {
                acc += weight(s);
                if acc > target {
                    chosen = s;
                    break;
                }
            }
            let scores = req
                .candidates
                .iter()
                .map(|&s| (s, weight(s) / total))
                .collect();
            Ok(Pick {
                effect: Effect::Rng(rng),
                ..Pick::new(chosen, Reason::Random, scores)
            })
        }
        Policy::RoundRobin => {
            let total: f64 = req.candidates.iter().map(|&s| weight(s)).sum();
            let scores: Vec<(u32, f64)> = req
                .candidates
                .iter()
                .filter_map(|&s| workers.get(s).map(|w| (s, w.rr_current + w.weight)))
                .collect();
            // The largest grown weight, the first in slot order on ties.
            let chosen = scores
                .iter()
                .fold(None, |best: Option<(u32, f64)>, &(s, v)| match best {
                    Some((_, b)) if v <= b => best,
                    _ => Some((s, v)),
                })
                .map_or(first, |(s, _)| s);
            Ok(Pick {
                effect: Effect::RoundRobin { total },
                ..Pick::new(chosen, Reason::RoundRobin, scores)
            })
        }
        Policy::LeastLoaded => {
            let scores: Vec<(u32, f64)> = req.candidates.iter().map(|&s| (s, load(s))).collect();
            let chosen = argmin(&scores, workers, req.tie_key)?;
            Ok(Pick::new(chosen, Reason::LeastLoaded, scores))
        }
        Policy::PowerOfTwo => {
            let mut rng = view.rng;
            let n = req.candidates.len();
            let i = ((rng.next_f64() * n as f64) as usize).min(n - 1);
            let mut j = i;
            if n > 1 {
                j = ((rng.next_f64() * (n - 1) as f64) as usize).min(n - 2);
                if j >= i {
                    j += 1;
                }
            }
            let a = req.candidates.get(i).copied().unwrap_or(first);
            let b = req.candidates.get(j).copied().unwrap_or(first);
            let (la, lb) = (load(a), load(b));
            let chosen = if lb < la { b } else { a };
            let mut scores = vec![(a, la)];
            if b != a {
                scores.push((b, lb));
            }
            Ok(Pick {
                effect: Effect::Rng(rng),
                ..Pick::new(chosen, Reason::PowerOfTwo, scores)
            })
        }
        Policy::Hash => pick_hash(view, req, buf),
        Policy::KvAware => {
            let delayed = delayed_requests(workers, req.candidates);
            least_cost(
                workers,
                req.candidates,
                req.credit,
                req.tie_key,
                |w, credit| kv_cost(w, req.prompt_blocks, credit, delayed, view.weights),
            )
        }
    }
}

/// Applies the state change of a pick that chose `chosen` among `candidates`.
pub(super) fn commit(
    effect: Effect,
    chosen: u32,
    candidates: &[u32],
    workers: &mut WorkerTable,
    rng: &mut SplitMix64,
) {
    match effect {
        Effect::None => {}
        Effect::Rng(next) => *rng = next,
        Effect::RoundRobin { total } => {
            for &s in candidates {
                if let Some(w) = workers.get_mut(s) {
                    w.rr_current += w.weight;
                }
            }
            if let Some(w) = workers.get_mut(chosen) {
                w.rr_current -= total;
            }
        }
    }
}

/// The candidate of least `cost(worker, its credit)` (ties: [`argmin`]), with every candidate's
/// cost; the reason is `prefix` when the chosen worker holds part of the prompt, else `load`.
/// Pure.
pub(super) fn least_cost(
    workers: &WorkerTable,
    candidates: &[u32],
    credit: &[f64],
    tie_key: Key<'_>,
    cost: impl Fn(&Worker, f64) -> f64,
) -> Result<Pick> {
    let credit_of = |s: u32| credit.get(s as usize).copied().unwrap_or(0.0);
    let scores: Vec<(u32, f64)> = candidates
        .iter()
        .filter_map(|&s| Some((s, cost(workers.get(s)?, credit_of(s)))))
        .collect();
    let chosen = argmin(&scores, workers, tie_key)?;
    let reason = if credit_of(chosen) > 0.0 {
        Reason::Prefix
    } else {
        Reason::Load
    };
    Ok(Pick::new(chosen, reason, scores))
}

fn no_candidate() -> Error {
    Error::NoWorker("no worker to route to: no candidate".into())
}

/// The slot with the lowest value; ties (within 1e-9 relative) broken by the rendezvous order of
/// `tie_key` (the first of the tied in that order).
pub(super) fn argmin(
    scores: &[(u32, f64)],
    workers: &WorkerTable,
    tie_key: Key<'_>,
) -> Result<u32> {
    let Some(min) = scores.iter().map(|&(_, v)| v).reduce(f64::min) else {
        return Err(no_candidate());
    };
    let tol = 1e-9 * min.abs().max(1.0);
    let mut tied = scores
        .iter()
        .filter(|&&(_, v)| v - min <= tol)
        .map(|&(s, _)| s);
    let Some(first) = tied.next() else {
        return Err(no_candidate());
    };
    let mut rest = tied.peekable();
    if rest.peek().is_none() {
        return Ok(first);
    }
    let k = tie_key.hash64();
    let scored = |s: u32| workers.get(s).map(|w| (workers.rendezvous(w, k), w));
    let mut best = (first, scored(first));
    for s in rest {
        let x = scored(s);
        let better = match (x, best.1) {
            (Some(a), Some(b)) => rendezvous_order(a, b).is_lt(),
            (a, b) => a.is_some() && b.is_none(),
        };
        if better {
            best = (s, x);
        }
    }
    Ok(best.0)
}

/// `hash`: the candidates in the rendezvous order of the hash key, walked with bounded loads.
/// The order is sorted only when its first worker is over the bound.
fn pick_hash(view: &View<'_>, req: &Request<'_>, buf: &mut Buffers) -> Result<Pick> {
    let workers = view.workers;
    let k = req.hash_key.hash64();
    // Position i of `scored`, `loads`, `shares` is the i-th candidate.
    buf.scored.clear();
    buf.loads.clear();
    buf.shares.clear();
    for &s in req.candidates {
        if let Some(w) = workers.get(s) {
            buf.scored.push((workers.rendezvous(w, k), s));
            buf.loads.push(w.total_active());
            buf.shares.push(w.weight);
        }
    }
    let order = |&(a, sa): &(RendezvousScore, u32), &(b, sb): &(RendezvousScore, u32)| match (
        workers.get(sa),
        workers.get(sb),
    ) {
        (Some(wa), Some(wb)) => rendezvous_order((a, wa), (b, wb)),
        _ => sa.cmp(&sb),
    };
    let Some(first) = (0..buf.scored.len() as u32).reduce(|a, b| {
        match (buf.scored.get(a as usize), buf.scored.get(b as usize)) {
            (Some(x), Some(y)) if order(y, x).is_lt() => b,
            _ => a,
        }
    }) else {
        return Err(no_candidate());
    };
    let mut picked = view.bound.pick(&[first], &buf.loads, Some(&buf.shares))?;
    buf.order.clear();
    buf.order.push(first);
    if !picked.within_bound {
        buf.order.clear();
        buf.order.extend(0..buf.scored.len() as u32);
        let scored = &buf.scored;
        buf.order.sort_unstable_by(|&a, &b| {
            match (scored.get(a as usize), scored.get(b as usize)) {
                (Some(x), Some(y)) => order(x, y),
                _ => a.cmp(&b),
            }
        });
        picked = view.bound.pick(&buf.order, &buf.loads, Some(&buf.shares))?;
    }
    let slot_at = |i: u32| buf.scored.get(i as usize).map(|&(_, s)| s);
    let Some(chosen) = slot_at(picked.node) else {
        return Err(no_candidate());
    };
    let scores = buf
        .order
        .iter()
        .take(picked.probes)
        .filter_map(|&i| Some((slot_at(i)?, *buf.loads.get(i as usize)? as f64)))
        .collect();
    let reason = if picked.probes == 1 {
        Reason::Hash
    } else {
        Reason::HashBounded
    };
    Ok(Pick::new(chosen, reason, scores))
}
