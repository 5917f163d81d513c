//! Prefixes in flight: the prompt blocks of the requests begun on each worker and not finished.
//!
//! A worker serves its queue in order, so by the time it reaches a new request it will have
//! computed (and still holds, pinned or cached) the prompts of the requests routed to it before.
//! An index fed only by the engine's KV events learns of those blocks only after their prefill;
//! under load a conversation's next turn arrives while the previous one is still queued, finds its
//! prefix nowhere and is sent elsewhere. This structure is what the router knows without events:
//! it lets `route` credit a worker with the prefix it *will* hold.
//!
//! Invariants:
//! - For every worker, the index holds exactly the union of the chains added for it (each under a
//!   request key) and not yet released. Each chain is a whole prompt from its first block, so a
//!   worker's set is prefix-closed and one index walk answers every worker's in-flight overlap.
//! - `add` either records the whole chain or (a chain that contradicts the index, a key already
//!   in flight) changes nothing; `release` of a key undoes exactly its `add`.
//! - Cost: `add` is one index store (a walk of the blocks already held, then the new ones) and a
//!   copy of the chain into a reused buffer; `release` compares the chain with the worker's other
//!   in-flight chains (stopping at the first differing block) and cuts the index once, after the
//!   deepest block another request still holds. Nothing is allocated per block.

use crate::error::Result;
use crate::index::PrefixIndex;
use crate::value_err;

/// Spare chain buffers kept for reuse.
const SPARE_BUFFERS: usize = 64;

/// The in-flight prompt blocks of every worker (see the module docs).
pub(super) struct InFlight {
    index: PrefixIndex,
    /// By index worker id: `(request key, chain)` of the requests in flight there.
    chains: Vec<Vec<(u64, Vec<u64>)>>,
    spare: Vec<Vec<u64>>,
}

impl InFlight {
    pub fn new() -> Result<Self> {
        Ok(InFlight {
            index: PrefixIndex::new(None)?,
            chains: Vec::new(),
            spare: Vec::new(),
        })
    }

    /// The index of in-flight blocks (worker names are the router's).
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// The request `key` (unique among those in flight), whose prompt is `chain`, was begun on
    /// `worker`. An `Err` (the chain contradicts the blocks in flight, or `key` is in flight
    /// already) changes nothing.
    pub fn add(&mut self, worker: &str, key: u64, chain: &[u64]) -> Result<()> {
        let id = match self.index.worker_id(worker) {
            Some(id) => id,
            None => self.index.add_worker(worker)?,
        };
        let at = id as usize;
        if self.chains.len() <= at {
            self.chains.resize_with(at + 1, Vec::new);
        }
        let Some(list) = self.chains.get_mut(at) else {
            return Ok(());
        };
        if list.iter().any(|(k, _)| *k == key) {
            return value_err!("request {key} is already in flight on {worker:?}");
        }
        if !chain.is_empty() {
            self.index.store_id(id, chain, None)?;
        }
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(chain);
        list.push((key, buf));
        Ok(())
    }

    /// The request `key` (added for `worker`) finished; unknown keys are ignored.
    pub fn release(&mut self, worker: &str, key: u64) {
        let Some(id) = self.index.worker_id(worker) else {
            return;
        };
        let Some(list) = self.chains.get_mut(id as usize) else {
            return;
        };
        let Some(pos) = list.iter().position(|(k, _)| *k == key) else {
            return;
        };
        let (_, chain) = list.swap_remove(pos);
        let kept = list
            .iter()
            .map(|(_, other)| common_prefix(other, &chain))
            .max()
            .unwrap_or(0);
        if let Some(cut) = chain.get(kept..=kept) {
            // Harmless when it fails: the worker exists in the index (it was found above) and
            // holds the block (its chain was stored at `add`), so the removal cannot fail.
            let removed = self.index.remove_id(id, cut);
            debug_assert!(removed.is_ok());
        }
        if self.spare.len() < SPARE_BUFFERS {
            self.spare.push(chain);
        }
    }

    /// Forgets `worker` and its in-flight blocks.
    pub fn remove_worker(&mut self, worker: &str) {
        let Some(id) = self.index.worker_id(worker) else {
            return;
        };
        if let Some(list) = self.chains.get_mut(id as usize) {
            list.clear();
        }
        // Harmless when it fails: the worker was just found in the index.
        let removed = self.index.remove_worker(worker);
        debug_assert!(removed.is_ok());
    }

    /// Distinct blocks in flight on `worker`.
    #[cfg(test)]
    pub fn blocks(&self, worker: &str) -> usize {
        self.index.num_blocks(worker).map_or(0, |n| n as usize)
    }
}

/// The number of leading blocks `a` and `b` share.
fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
