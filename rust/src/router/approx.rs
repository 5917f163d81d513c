//! The approximate model (`index="approx"`): where the router sent each prefix.
//!
//! Each worker's KV cache is modelled by a [`BlockCache`] of `capacity` blocks; with a TTL, blocks
//! idle longer than it are considered gone. The router's [`PrefixIndex`] holds exactly the
//! modelled blocks — invariant: for every worker, the set of blocks its cache holds equals the set
//! the index credits it with — so a route matches all workers in one index walk instead of probing
//! each cache. Every change goes through [`Model`]: a store is validated by the index first (a
//! chain that contradicts the index changes nothing), then the cache is updated and every block it
//! evicted or could not store is removed from the index.
//!
//! Updates: `route` records the prompt on the chosen worker (it will hold the prompt once the
//! request is prefilled); `finish` records it again (the engine frees the request's blocks then,
//! which is their recency in its LRU); `observe` with fewer cached tokens than predicted drops the
//! blocks from the first one the engine lacked (and everything after them: the worker could not
//! have held those either), then records the prompt, which the request itself computed. More
//! cached tokens than predicted need no correction beyond that record.

use crate::cache::{BlockCache, PartitionId};
use crate::error::Result;
use crate::index::PrefixIndex;

use super::workers::Worker;

/// The approx model's parameters and scratch buffers.
pub(super) struct Model {
    /// Modelled cache capacity per worker, in blocks.
    pub capacity: usize,
    /// Idle time after which a block is considered gone.
    pub ttl: Option<f64>,
    evicted: Vec<u64>,
    dropped: Vec<u64>,
}

impl Model {
    pub fn new(capacity: usize, ttl: Option<f64>) -> Self {
        Model {
            capacity,
            ttl,
            evicted: Vec::new(),
            dropped: Vec::new(),
        }
    }

    /// A fresh cache model for a new worker.
    pub fn new_cache(&self) -> Result<BlockCache> {
        let mut cache = BlockCache::new(self.capacity)?;
        if self.ttl.is_some() {
            cache.track_idle();
        }
        Ok(cache)
    }

    /// Drops the blocks of `worker` idle longer than the TTL at `now` (nothing without a TTL, or
    /// before the worker's idle deadline).
    pub fn expire_idle(&mut self, worker: &mut Worker, index: &mut PrefixIndex, now: f64) {
        let (Some(ttl), Some(cache), Some(id)) = (self.ttl, worker.cache.as_mut(), worker.index_id)
        else {
            return;
        };
        if now < worker.idle_deadline {
            return;
        }
        self.evicted.clear();
        let expired = cache.expire_idle_into(now, ttl, &mut self.evicted);
        debug_assert!(
            expired.is_ok(),
            "idle tracking is on whenever there is a TTL, and `now` and the TTL are checked \
             finite: {expired:?}"
        );
        let next = expired.unwrap_or(None);
        if !self.evicted.is_empty() {
            // Harmless when it fails: the only error is an unknown worker id, i.e. someone
            // removed the worker from the router's index (read-only by contract); there is
            // nothing left to drop then.
            let _ = index.remove_id(id, &self.evicted);
        }
        worker.idle_deadline = next.map_or(f64::INFINITY, |t| t + ttl);
    }

    /// Checks that `worker` could be recorded holding `hashes` (the chain agrees with the index):
    /// stores it in the index. Must be followed by [`Model::commit`].
    pub fn validate(worker: &Worker, index: &mut PrefixIndex, hashes: &[u64]) -> Result<()> {
        match worker.index_id {
            Some(id) if !hashes.is_empty() => index.store_id(id, hashes, None),
            _ => Ok(()),
        }
    }

    /// Records, after [`Model::validate`], that `worker` holds `hashes` at `now` in the cache
    /// partition named `partition` (the shared pool when `None` or undeclared), and removes from
    /// the index whatever the cache evicted or could not store.
    pub fn commit(
        &mut self,
        worker: &mut Worker,
        index: &mut PrefixIndex,
        hashes: &[u64],
        partition: Option<&str>,
        now: f64,
    ) {
        let (Some(cache), Some(id)) = (worker.cache.as_mut(), worker.index_id) else {
            return;
        };
        if hashes.is_empty() {
            return;
        }
        let part = partition
            .and_then(|p| cache.partition(p).ok())
            .unwrap_or(PartitionId::SHARED);
        self.evicted.clear();
        let inserted = cache.insert_into(hashes, part, None, now, &mut self.evicted);
        debug_assert!(
            inserted.is_ok(),
            "`now` is checked finite, `part` is declared in this cache and there is no parent: \
             {inserted:?}"
        );
        let stored = inserted.unwrap_or(0);
        // Both removals below are harmless when they fail, as in `expire_idle`: an unknown
        // worker id holds nothing.
        if let Some(first_missing) = hashes.get(stored..stored + 1) {
            let _ = index.remove_id(id, first_missing);
        }
        if !self.evicted.is_empty() {
            let _ = index.remove_id(id, &self.evicted);
            // An eviction can turn an older block into a leaf: recheck at the next route.
            worker.idle_deadline = f64::NEG_INFINITY;
        }
        if let Some(ttl) = self.ttl {
            worker.idle_deadline = worker.idle_deadline.min(now + ttl);
        }
    }

    /// Records `hashes` on `worker` (validate + commit); an inconsistent chain changes nothing.
    pub fn record(
        &mut self,
        worker: &mut Worker,
        index: &mut PrefixIndex,
        hashes: &[u64],
        partition: Option<&str>,
        now: f64,
    ) -> Result<()> {
        Self::validate(worker, index, hashes)?;
        self.commit(worker, index, hashes, partition, now);
        Ok(())
    }

    /// `worker` lacks `hashes[from]` and so everything after it: drops them from the index and
    /// the cache.
    pub fn forget_from(
        &mut self,
        worker: &mut Worker,
        index: &mut PrefixIndex,
        hashes: &[u64],
        from: usize,
    ) {
        let (Some(cache), Some(id)) = (worker.cache.as_mut(), worker.index_id) else {
            return;
        };
        let Some(first) = hashes.get(from..from + 1) else {
            return;
        };
        self.dropped.clear();
        // An error means the index no longer knows the worker (its router index was written to,
        // against the contract): nothing of it is credited, so there is nothing to forget.
        if index.remove_id_into(id, first, &mut self.dropped).is_ok() {
            self.evicted.clear();
            let removed = cache.remove_into(&self.dropped, &mut self.evicted);
            debug_assert!(
                removed.is_ok(),
                "the cache holds the blocks the index credits (module invariant), nothing in it \
                 is pinned or leased, and `dropped` lists descendants first: {removed:?}"
            );
        }
    }

    /// Declares or resizes the partition `name` in `worker`'s cache to `blocks`, clamped to what
    /// the cache has unreserved.
    pub fn reserve(worker: &mut Worker, name: &str, blocks: usize) {
        let Some(cache) = worker.cache.as_mut() else {
            return;
        };
        let others: usize = cache
            .reservations()
            .filter(|&(n, _)| n != name)
            .map(|(_, r)| r)
            .sum();
        let blocks = blocks.min(cache.capacity().saturating_sub(others));
        // Harmless when it fails: `blocks` is clamped to what is unreserved, so the only error
        // left is a cache past 65,534 partitions (endpoints that ever reserved blocks on this
        // worker); the endpoint's blocks then use the shared pool on this worker.
        let _ = match cache.partition(name) {
            Ok(id) => cache.set_reserved(id, blocks),
            Err(_) => cache.add_partition(name, blocks).map(drop),
        };
    }

    /// Checks that `worker`'s cache could reserve `blocks` more for a new partition.
    pub fn can_reserve(worker: &Worker, blocks: usize) -> bool {
        worker.cache.as_ref().is_none_or(|c| {
            let reserved: usize = c.reservations().map(|(_, r)| r).sum();
            reserved.saturating_add(blocks) <= c.capacity()
        })
    }
}
