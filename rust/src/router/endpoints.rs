//! Dedicated endpoints: a sticky pool of workers per endpoint, and the endpoint's own block-hash
//! namespace.
//!
//! Invariants:
//! - **Pool.** An endpoint's pool is the first `pool_size` *healthy* workers in the rendezvous
//!   order of the endpoint id ([`crate::hashing::Rendezvous`] over every worker, weighted). So
//!   removing or adding a worker outside the pool leaves it alone; removing (or marking
//!   unhealthy) a member replaces only that member, by the next healthy worker in the order; and
//!   when the member comes back it takes its place again, so the pool returns to what it was.
//!   When fewer than `pool_size` workers are healthy the pool is all of them (routing fails only
//!   when none is). [`add`](super::Router::add_endpoint) refuses a pool larger than the healthy
//!   fleet.
//! - **Cost.** The endpoint keeps the head of that order (`ranked`: about twice `pool_size`
//!   workers, or all of them), so a worker joining, leaving or changing health costs O(pool)
//!   per endpoint; only when the head runs out of healthy workers (members removed one by one)
//!   is the order drawn again from every worker, O(n), which a random removal triggers with
//!   probability about 1/n per member it takes: O(1) amortised. Creating the pool draws it once.
//! - **Isolation.** An isolated endpoint (the default) hashes its requests' tokens with its own
//!   salt: the router's [`BlockHasher`] with `salt` = the endpoint's salt (the endpoint id unless
//!   given), so its blocks never equal another tenant's and no other request can match them.
//!   The salt is what a gateway passes upstream as the engine's `cache_salt` (vLLM, SGLang), so
//!   engine KV events (rehashed with the event's salt) land on the same hashes. Block hashes
//!   given directly are salted as `XXH3-64(h as 8 little-endian bytes, seed = XXH3-64(salt))`
//!   per block: deterministic and chain-preserving (each salted hash still identifies its whole
//!   prefix), but not what an engine publishes — pass tokens to match engine events.
//! - **Reservations.** In approx mode an endpoint with `reserved_blocks` holds a partition of that
//!   size (named by the endpoint id) in every pool member's modelled cache; a worker that leaves the
//!   pool keeps the partition with a reservation of 0 (its blocks become ordinary borrowers), and a
//!   replacement gets as much of the reservation as its cache has unreserved (never more than the
//!   capacity).
//! - **Priority.** Every decision routed for an endpoint carries the endpoint's scheduling
//!   priority ([`super::Decision::priority`]; 0 for requests without an endpoint), for a gateway
//!   to ask the engine for (vLLM `priority` with `--scheduling-policy priority`, SGLang `priority`
//!   with `--enable-priority-scheduling`). kvroute's convention is SGLang's default: a higher
//!   value is served first. The router itself does not order requests.

use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use std::cmp::Ordering;

use crate::blocks::BlockHasher;
use crate::error::Result;
use crate::hashing::{hash_key, RendezvousScore};

use super::workers::{rendezvous_order, WorkerTable};

/// How an endpoint is declared to [`super::Router::add_endpoint`] (build it as a struct literal
/// with `..EndpointSpec::default()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointSpec<'a> {
    /// Workers in the endpoint's pool (default 1).
    pub pool_size: usize,
    /// Blocks reserved in each member's modelled cache, approx mode (default none).
    pub reserved_blocks: Option<usize>,
    /// The endpoint's hash namespace (default: the endpoint id).
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
    /// Requested pool size.
    pub pool_size: usize,
    /// Blocks reserved in each member's modelled cache (approx mode).
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
    /// The first `ranked.len()` workers (slots) of that order over every worker, best first.
    ranked: Vec<u32>,
    /// `ranked` holds every worker.
    complete: bool,
    /// Current members (slots), ascending.
    pub pool: Vec<u32>,
}

impl Endpoint {
    /// A new endpoint (its pool is computed by the router).
    pub(super) fn new(id: &str, spec: &EndpointSpec<'_>, base: &BlockHasher) -> Result<Self> {
        let salt = spec.isolate.then(|| spec.salt.unwrap_or(id).to_owned());
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
            ranked: Vec::new(),
            complete: true,
            id: Arc::from(id),
            pool_size: spec.pool_size,
            reserved_blocks: spec.reserved_blocks,
            salt_seed: salt.as_ref().map(|s| hash_key(s.as_bytes())),
            salt,
            priority: spec.priority,
            hasher: Arc::new(hasher),
            pool: Vec::new(),
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

    /// How many workers `ranked` keeps when it does not hold them all: enough spares that
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

    /// Draws the head of the order from every worker again: O(n).
    pub(super) fn rank(&mut self, workers: &WorkerTable) {
        let mut scored: Vec<(RendezvousScore, u32)> = workers
            .iter_slots()
            .map(|(s, w)| (workers.rendezvous(w, self.key_hash), s))
            .collect();
        let keep = self.head_len();
        if keep < scored.len() {
            scored.select_nth_unstable_by(keep, |&a, &b| Self::order(workers, a, b));
            scored.truncate(keep);
        }
        scored.sort_unstable_by(|&a, &b| Self::order(workers, a, b));
        self.ranked.clear();
        self.ranked.extend(scored.iter().map(|&(_, s)| s));
        self.complete = self.ranked.len() == workers.len();
    }

    /// Re-sorts `ranked` (after the table's weights became, or stopped being, all equal: the
    /// scores change form, their order only where two were equal).
    pub(super) fn resort(&mut self, workers: &WorkerTable) {
        let mut scored: Vec<(RendezvousScore, u32)> = self
            .ranked
            .iter()
            .filter_map(|&s| Some((self.score(workers, s)?, s)))
            .collect();
        scored.sort_unstable_by(|&a, &b| Self::order(workers, a, b));
        self.ranked.clear();
        self.ranked.extend(scored.iter().map(|&(_, s)| s));
    }

    /// The worker in `slot` joined: it enters `ranked` if it belongs to the head. Returns
    /// whether it did (the pool may change).
    pub(super) fn joined(&mut self, workers: &WorkerTable, slot: u32) -> bool {
        let Some(score) = self.score(workers, slot) else {
            return false;
        };
        let key = (score, slot);
        let at = self.ranked.partition_point(|&s| {
            self.score(workers, s)
                .is_some_and(|x| Self::order(workers, (x, s), key) == Ordering::Less)
        });
        if !self.complete && at == self.ranked.len() {
            return false; // after the head: outside it
        }
        self.ranked.insert(at, slot);
        if self.complete {
            if self.ranked.len() > 2 * self.head_len() {
                self.ranked.truncate(self.head_len());
                self.complete = false;
            }
        } else {
            self.ranked.pop();
        }
        true
    }

    /// The worker in `slot` left (or is leaving): it leaves `ranked`. Returns whether it was
    /// there (the pool may change).
    pub(super) fn left(&mut self, slot: u32) -> bool {
        match self.ranked.iter().position(|&s| s == slot) {
            Some(i) => {
                self.ranked.remove(i);
                true
            }
            None => false,
        }
    }

    /// Whether the worker in `slot` is in the head of the order (its health matters).
    pub(super) fn ranks(&self, slot: u32) -> bool {
        self.ranked.contains(&slot)
    }

    /// Recomputes the pool: the first `pool_size` healthy workers of the order, drawing the
    /// order again from every worker when the head has too few.
    pub(super) fn refresh_pool(&mut self, workers: &WorkerTable) {
        self.fill_pool(workers);
        if self.pool.len() < self.pool_size && !self.complete {
            self.rank(workers);
            self.fill_pool(workers);
        }
    }

    fn fill_pool(&mut self, workers: &WorkerTable) {
        self.pool.clear();
        for &s in &self.ranked {
            if self.pool.len() >= self.pool_size {
                break;
            }
            if workers.get(s).is_some_and(|w| w.healthy) {
                self.pool.push(s);
            }
        }
        self.pool.sort_unstable();
    }

    /// The worker table was compacted: `renumber[old slot]` is the new slot.
    pub(super) fn renumber(&mut self, renumber: &[Option<u32>]) {
        let map = |s: &u32| renumber.get(*s as usize).copied().flatten();
        self.ranked = self.ranked.iter().filter_map(map).collect();
        self.pool = self.pool.iter().filter_map(map).collect();
    }
}
