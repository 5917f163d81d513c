//! Dedicated endpoints: a sticky pool of workers per endpoint, and the endpoint's own block-hash
//! namespace.
//!
//! Invariants:
//! - **Pool.** An endpoint's pool has a part per phase ([`Phase`]): its *prefill pool* is the
//!   first `pool_size` *healthy* workers able to prefill in the rendezvous order of the endpoint
//!   id ([`crate::hashing::Rendezvous`] over those workers, weighted), its *decode pool* the
//!   first `pool_size` healthy workers able to decode in that order. In a fleet without roles
//!   (every worker `both`) the two are the same workers: the pool. So removing or adding a
//!   worker outside the pool leaves it alone; removing (or marking unhealthy, or giving another
//!   role) a member replaces only that member, by the next healthy worker of its phase in the
//!   order; and when the member comes back it takes its place again, so the pool returns to what
//!   it was. When fewer than `pool_size` workers of a phase are healthy, that part is all of them
//!   (routing fails only when none is). [`add`](super::Router::add_endpoint) refuses a pool
//!   larger than the healthy workers of every phase.
//! - **Cost.** Per phase the endpoint keeps the head of that order (`ranked`: the order up to its
//!   `max(2·pool_size, pool_size + 8)`-th healthy worker, with the unhealthy ones before it; or
//!   all of them), so a worker joining, leaving or changing health or role costs O(head) per
//!   endpoint; only when a head runs out of healthy workers (members removed or marked unhealthy
//!   one by one) is its order drawn again from every worker, O(n), which a random removal
//!   triggers with probability about 1/n per member it takes: O(1) amortised. Creating the pool
//!   draws it once per phase.
//! - **Isolation.** An isolated endpoint (the default) hashes its requests' tokens with its own
//!   salt: the router's [`BlockHasher`] with `salt` = the endpoint's salt (the endpoint id unless
//!   given), so its blocks never equal another tenant's and no other request can match them.
//!   The salt is what a gateway passes upstream as the engine's `cache_salt` (vLLM, SGLang), so
//!   engine KV events (rehashed with the event's salt) land on the same hashes. Block hashes
//!   given directly are salted as `XXH3-64(h as 8 little-endian bytes, seed = XXH3-64(salt))`
//!   per block: deterministic and chain-preserving (each salted hash still identifies its whole
//!   prefix), but not what an engine publishes — pass tokens to match engine events.
//! - **Reservations.** In approx mode an endpoint with `reserved_blocks` holds a partition of that
//!   size (named by the endpoint id) in the modelled cache of every member of its *prefill* pool
//!   (where its prefixes are computed and reused); a worker that leaves that pool keeps the
//!   partition with a reservation of 0 (its blocks become ordinary borrowers), and a replacement
//!   gets as much of the reservation as its cache has unreserved (never more than the capacity).
//! - **Priority.** Every decision routed for an endpoint carries the endpoint's scheduling
//!   priority ([`super::Decision::priority`]; 0 for requests without an endpoint), for a gateway
//!   to ask the engine for (vLLM `priority` with `--scheduling-policy priority`, SGLang `priority`
//!   with `--enable-priority-scheduling`). kvroute's convention is SGLang's default: a higher
//!   value is served first. The router itself does not order requests. Both halves of a
//!   prefill/decode pair carry it.

use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use std::cmp::Ordering;

use crate::blocks::BlockHasher;
use crate::error::Result;
use crate::hashing::{hash_key, RendezvousScore};
use crate::value_err;

use super::pd::Phase;
use super::workers::{rendezvous_order, WorkerTable};

/// How an endpoint is declared to [`super::Router::add_endpoint`] (build it as a struct literal
/// with `..EndpointSpec::default()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointSpec<'a> {
    /// Workers in the endpoint's pool (default 1).
    pub pool_size: usize,
    /// Blocks reserved in each member's modelled cache, approx mode (default none).
    pub reserved_blocks: Option<usize>,
    /// The endpoint's hash namespace (default: the endpoint id; never empty, and only for an
    /// isolated endpoint).
    pub salt: Option<&'a str>,
    /// Whether the endpoint has its own namespace (default true); `false` shares the router's.
    pub isolate: bool,
    /// Scheduling priority of the endpoint's requests, higher first (default 0, as requests
    /// without an endpoint).
    pub priority: i32,
}

impl Default for EndpointSpec<'_> {
    fn default() -> Self {
        EndpointSpec {
            pool_size: 1,
            reserved_blocks: None,
            salt: None,
            isolate: true,
            priority: 0,
        }
    }
}

/// One dedicated endpoint.
pub struct Endpoint {
    /// The endpoint id.
    pub id: Arc<str>,
    /// Requested pool size (per phase).
    pub pool_size: usize,
    /// Blocks reserved in each prefill-pool member's modelled cache (approx mode).
    pub reserved_blocks: Option<usize>,
    /// The endpoint's salt (`None`: not isolated, shares the router's namespace).
    pub salt: Option<String>,
    /// Scheduling priority of its requests (higher first; see the module docs).
    pub priority: i32,
    /// The hasher of the endpoint's namespace.
    pub(super) hasher: Arc<BlockHasher>,
    /// Seed deriving salted hashes from given block hashes.
    pub(super) salt_seed: Option<u64>,
    /// `hash_key` of the id: the pool is drawn in the rendezvous order of this key.
    key_hash: u64,
    /// Per phase (prefill, decode): the head of the order and the members it gives.
    parts: [Part; 2],
}

/// One phase's part of an endpoint's pool.
#[derive(Default)]
struct Part {
    /// The first `ranked.len()` workers (slots) able to do the phase, in the order, best first.
    ranked: Vec<u32>,
    /// `ranked` holds every worker able to do the phase.
    complete: bool,
    /// Current members (slots), ascending.
    pool: Vec<u32>,
}

impl Endpoint {
    /// A new endpoint (its pool is computed by the router). `Value` error, naming the endpoint:
    /// a salt given to an endpoint that is not isolated (it would have none), or an empty salt
    /// (given, or the id's): the hasher takes "" as no salt, so its tokens would hash as
    /// untenanted requests' while its given block hashes were salted.
    pub(super) fn new(id: &str, spec: &EndpointSpec<'_>, base: &BlockHasher) -> Result<Self> {
        let salt = match (spec.isolate, spec.salt) {
            (false, Some(s)) => {
                return value_err!(
                    "endpoint {id:?}: salt {s:?} given with isolate=False, which shares the \
                     router's unsalted namespace: leave out the salt or the isolate=False"
                )
            }
            (false, None) => None,
            (true, Some("")) => {
                return value_err!(
                    "endpoint {id:?}: salt \"\" is no salt (its requests would share blocks with \
                     untenanted ones): give a non-empty salt, or isolate=False to share them"
                )
            }
            (true, None) if id.is_empty() => {
                return value_err!(
                    "endpoint \"\": an isolated endpoint is salted with its id, and \"\" is no \
                     salt: give a non-empty salt, or isolate=False"
                )
            }
            (true, salt) => Some(salt.unwrap_or(id).to_owned()),
        };
        let hasher = match &salt {
            None => base.clone(),
            Some(s) => {
                let mut options = base.options().clone();
                options.salt = Some(s.clone());
                BlockHasher::new(base.block_size(), base.profile(), options)?
            }
        };
        Ok(Endpoint {
            key_hash: hash_key(id.as_bytes()),
            parts: Default::default(),
            id: Arc::from(id),
            pool_size: spec.pool_size,
            reserved_blocks: spec.reserved_blocks,
            salt_seed: salt.as_ref().map(|s| hash_key(s.as_bytes())),
            salt,
            priority: spec.priority,
            hasher: Arc::new(hasher),
        })
    }

    /// Replaces given block hashes by the endpoint's salted ones (see the module docs); no-op
    /// for an endpoint that is not isolated.
    pub fn salt_block_hashes(&self, hashes: &mut [u64]) {
        if let Some(seed) = self.salt_seed {
            for h in hashes {
                *h = xxh3_64_with_seed(&h.to_le_bytes(), seed);
            }
        }
    }

    /// The members of the pool able to do `phase` (slots, ascending).
    pub fn pool(&self, phase: Phase) -> &[u32] {
        &self.part(phase).pool
    }

    /// Every member, of either phase (slots, ascending, each once).
    pub fn members(&self) -> Vec<u32> {
        let [p, d] = &self.parts;
        let mut all: Vec<u32> = p.pool.iter().chain(&d.pool).copied().collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    fn part(&self, phase: Phase) -> &Part {
        let [p, d] = &self.parts;
        match phase {
            Phase::Prefill => p,
            Phase::Decode => d,
        }
    }

    fn part_mut(&mut self, phase: Phase) -> &mut Part {
        let [p, d] = &mut self.parts;
        match phase {
            Phase::Prefill => p,
            Phase::Decode => d,
        }
    }

    /// How many workers a head keeps when it does not hold them all: enough spares that
    /// members can leave many times before the order must be drawn again.
    fn head_len(&self) -> usize {
        self.pool_size.saturating_mul(2).max(self.pool_size + 8)
    }

    /// The rendezvous score of the worker in `slot` for the endpoint id.
    fn score(&self, workers: &WorkerTable, slot: u32) -> Option<RendezvousScore> {
        workers
            .get(slot)
            .map(|w| workers.rendezvous(w, self.key_hash))
    }

    /// Rendezvous order of two scored slots.
    fn order(
        workers: &WorkerTable,
        a: (RendezvousScore, u32),
        b: (RendezvousScore, u32),
    ) -> Ordering {
        match (workers.get(a.1), workers.get(b.1)) {
            (Some(wa), Some(wb)) => rendezvous_order((a.0, wa), (b.0, wb)),
            _ => a.1.cmp(&b.1),
        }
    }

    /// Draws the head of every phase's order from every worker again: O(n).
    pub(super) fn rank(&mut self, workers: &WorkerTable) {
        for phase in Phase::BOTH {
            self.rank_phase(workers, phase);
        }
    }

    fn rank_phase(&mut self, workers: &WorkerTable, phase: Phase) {
        let mut scored: Vec<(RendezvousScore, u32)> = workers
            .iter_slots()
            .filter(|(_, w)| w.role.does(phase))
            .map(|(s, w)| (workers.rendezvous(w, self.key_hash), s))
            .collect();
        // The head runs to its `head_len`-th healthy worker: unhealthy ones ranked before it stay
        // (they take their place again when back), and the pool is always inside the head.
        let healthy = |s: u32| workers.get(s).is_some_and(|w| w.healthy);
        let head_len = self.head_len();
        let unhealthy = scored.iter().filter(|&&(_, s)| !healthy(s)).count();
        let keep = head_len.saturating_add(unhealthy);
        if keep < scored.len() {
            scored.select_nth_unstable_by(keep, |&a, &b| Self::order(workers, a, b));
            scored.truncate(keep);
        }
        scored.sort_unstable_by(|&a, &b| Self::order(workers, a, b));
        let mut seen = 0;
        if let Some(end) = scored.iter().position(|&(_, s)| {
            seen += usize::from(healthy(s));
            seen == head_len
        }) {
            scored.truncate(end + 1);
        }
        let part = self.part_mut(phase);
        part.ranked.clear();
        part.ranked.extend(scored.iter().map(|&(_, s)| s));
        part.complete = part.ranked.len() == workers.capable(phase);
    }

    /// Re-sorts the heads (after the table's weights became, or stopped being, all equal: the
    /// scores change form, their order only where two were equal).
    pub(super) fn resort(&mut self, workers: &WorkerTable) {
        for phase in Phase::BOTH {
            let mut scored: Vec<(RendezvousScore, u32)> = self
                .part(phase)
                .ranked
                .iter()
                .filter_map(|&s| Some((self.score(workers, s)?, s)))
                .collect();
            scored.sort_unstable_by(|&a, &b| Self::order(workers, a, b));
            let ranked = &mut self.part_mut(phase).ranked;
            ranked.clear();
            ranked.extend(scored.iter().map(|&(_, s)| s));
        }
    }

    /// The worker in `slot` joined (or took a role): it enters the head of each phase it does
    /// where it belongs to the head. Returns whether it entered one (the pool may change).
    pub(super) fn joined(&mut self, workers: &WorkerTable, slot: u32) -> bool {
        let Some(w) = workers.get(slot) else {
            return false;
        };
        let Some(score) = self.score(workers, slot) else {
            return false;
        };
        let key = (score, slot);
        let (head_len, key_hash) = (self.head_len(), self.key_hash);
        let mut entered = false;
        for phase in Phase::BOTH {
            if !w.role.does(phase) {
                continue;
            }
            let part = self.part_mut(phase);
            let at = part.ranked.partition_point(|&s| {
                workers
                    .get(s)
                    .map(|x| workers.rendezvous(x, key_hash))
                    .is_some_and(|x| Self::order(workers, (x, s), key) == Ordering::Less)
            });
            if !part.complete && at == part.ranked.len() {
                continue; // after the head: outside it
            }
            part.ranked.insert(at, slot);
            if part.complete {
                if part.ranked.len() > 2 * head_len {
                    part.ranked.truncate(head_len);
                    part.complete = false;
                }
            } else {
                part.ranked.pop();
            }
            entered = true;
        }
        entered
    }

    /// The worker in `slot` left (or is leaving, or gave up a role): it leaves every head.
    /// Returns whether it was in one (the pool may change).
    pub(super) fn left(&mut self, slot: u32) -> bool {
        let mut was = false;
        for part in &mut self.parts {
            if let Some(i) = part.ranked.iter().position(|&s| s == slot) {
                part.ranked.remove(i);
                was = true;
            }
        }
        was
    }

    /// Whether the worker in `slot` is in the head of an order (its health matters).
    pub(super) fn ranks(&self, slot: u32) -> bool {
        self.parts.iter().any(|p| p.ranked.contains(&slot))
    }

    /// Recomputes the pool: per phase, the first `pool_size` healthy workers of the order,
    /// drawing the order again from every worker when the head has too few.
    pub(super) fn refresh_pool(&mut self, workers: &WorkerTable) {
        for phase in Phase::BOTH {
            self.fill_pool(workers, phase);
            let part = self.part(phase);
            if part.pool.len() < self.pool_size && !part.complete {
                self.rank_phase(workers, phase);
                self.fill_pool(workers, phase);
            }
        }
    }

    fn fill_pool(&mut self, workers: &WorkerTable, phase: Phase) {
        let size = self.pool_size;
        let part = self.part_mut(phase);
        part.pool.clear();
        for &s in &part.ranked {
            if part.pool.len() >= size {
                break;
            }
            if workers.get(s).is_some_and(|w| w.healthy) {
                part.pool.push(s);
            }
        }
        part.pool.sort_unstable();
    }

    /// The worker table was compacted: `renumber[old slot]` is the new slot.
    pub(super) fn renumber(&mut self, renumber: &[Option<u32>]) {
        let map = |s: &u32| renumber.get(*s as usize).copied().flatten();
        for part in &mut self.parts {
            part.ranked = part.ranked.iter().filter_map(map).collect();
            part.pool = part.pool.iter().filter_map(map).collect();
        }
    }
}
