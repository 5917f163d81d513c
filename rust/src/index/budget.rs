//! The index's memory budget (see "Memory budget" in the module docs of [`crate::index`]).
//!
//! Invariant: with `max_bytes` set, [`PrefixIndex::memory_bytes`] is at most the budget when a
//! mutation returns; eviction drops only least recently used leaves, for every worker holding
//! them, so every answer stays sound.

use super::tree::ROOT;
use super::{PrefixIndex, Scratch, WorkerId};

impl PrefixIndex {
    /// Keeps the budget after a mutation: evicts after a success; after a failure (no state
    /// changed, but allocations may have grown) only compacts.
    pub(super) fn after_mutation(&mut self, succeeded: bool) {
        if succeeded {
            self.enforce_budget();
        } else if self.max_bytes.is_some_and(|max| self.memory_bytes() > max) {
            self.compact();
        }
    }

    /// Over budget: evicts least recently used leaves until the index fits in 15/16 of the
    /// budget, and compacts. Compaction alone may be enough (a removal's traversal buffers, an
    /// emptied tree's spare capacity), so it runs even when there is nothing left to evict.
    pub(super) fn enforce_budget(&mut self) {
        let Some(max) = self.max_bytes else { return };
        let target = max - max / 16;
        while self.memory_bytes() > max {
            let empty = self.tree.is_empty_tree();
            if !empty {
                self.evict_until(target);
            }
            self.compact();
            if empty || self.tree.is_empty_tree() {
                // An empty tree and a compacted worker table fit: `add_worker` admits a worker
                // only if the table fits beside an empty index.
                debug_assert!(
                    self.memory_bytes() <= max,
                    "an empty index exceeds its budget"
                );
                break;
            }
        }
    }

    /// Bytes the index would take after [`Self::compact`].
    pub(super) fn compacted_bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.workers.heap_bytes() + self.tree.compacted_bytes()
    }

    pub(super) fn evict_until(&mut self, target: usize) {
        // Every node, oldest first; among equals deepest first, so children go before parents
        // (a parent is never older than its children).
        let mut order: Vec<(u64, u32, u32)> = Vec::with_capacity(self.tree.live_nodes);
        let mut stack = vec![(ROOT, 0u32)];
        while let Some((id, depth)) = stack.pop() {
            for c in self.tree.children(id) {
                order.push((self.tree.node(c).tick(), u32::MAX - depth, c));
                stack.push((c, depth + 1));
            }
        }
        order.sort_unstable();
        let mut parents = Vec::new();
        for (_, _, id) in order {
            if self.compacted_bytes() <= target {
                break;
            }
            if self.tree.node(id).num_children > 0 {
                continue;
            }
            let len = self.tree.node(id).hashes.len();
            let holders: Vec<WorkerId> = self.tree.node(id).workers.iter().collect();
            for w in holders {
                self.workers.sub_blocks(w, len);
            }
            parents.push(self.tree.node(id).parent);
            self.tree.delete_leaf(id);
        }
        for p in parents {
            self.tree.normalize(p);
        }
    }

    /// Rebuilds the tree into exactly sized allocations.
    pub(super) fn compact(&mut self) {
        self.tree = self.tree.rebuilt();
        self.workers.shrink();
        self.scratch = Scratch::default();
    }
}
