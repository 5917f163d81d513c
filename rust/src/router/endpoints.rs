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

use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::blocks::BlockHasher;
use crate::error::Result;
use crate::hashing::{hash_key, ConsistentHash, Key, Rendezvous};

use super::workers::WorkerTable;

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
    /// The hasher of the endpoint's namespace.
    pub(super) hasher: Arc<BlockHasher>,
    /// Seed deriving salted hashes from given block hashes.
    pub(super) salt_seed: Option<u64>,
    /// Current members (slots), ascending.
    pub pool: Vec<u32>,
}

impl Endpoint {
    /// A new endpoint (its pool is computed by the router).
    pub(super) fn new(
        id: &str,
        pool_size: usize,
        reserved_blocks: Option<usize>,
        salt: Option<String>,
        base: &BlockHasher,
    ) -> Result<Self> {
        let hasher = match &salt {
            None => base.clone(),
            Some(s) => {
                let mut options = base.options().clone();
                options.salt = Some(s.clone());
                BlockHasher::new(base.block_size(), base.profile(), options)?
            }
        };
        Ok(Endpoint {
            id: Arc::from(id),
            pool_size,
            reserved_blocks,
            salt_seed: salt.as_ref().map(|s| hash_key(s.as_bytes())),
            salt,
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

    /// Recomputes the pool: the first `pool_size` healthy workers in the rendezvous order of
    /// the endpoint id. `order` is scratch.
    pub(super) fn refresh_pool(
        &mut self,
        ring: &Rendezvous,
        workers: &WorkerTable,
        order: &mut Vec<u32>,
    ) {
        self.pool.clear();
        if ring.is_empty() {
            return;
        }
        let r = ring.preference_into(Key::Bytes(self.id.as_bytes()), ring.len(), order);
        debug_assert!(r.is_ok(), "a full preference of a non-empty ring: {r:?}");
        if r.is_err() {
            return;
        }
        for &s in order.iter() {
            if self.pool.len() >= self.pool_size {
                break;
            }
            if workers.get(s).is_some_and(|w| w.healthy) {
                self.pool.push(s);
            }
        }
        self.pool.sort_unstable();
    }
}
