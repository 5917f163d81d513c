//! The index's worker table: names ↔ dense [`WorkerId`]s, and each worker's block count.
//!
//! Invariants: a registered name has exactly one id and an id at most one name; ids of removed
//! workers are reused (lowest churn of the bitsets that refer to them); [`Workers::heap_bytes`]
//! accounts every allocation the table holds, for the index's memory budget.

use std::sync::Arc;

use hashbrown::HashMap;

use super::{WorkerId, ALLOC_OVERHEAD};

/// Name ↔ id table of the workers, with each worker's block count.
#[derive(Default)]
pub(super) struct Workers {
    pub(super) names: Vec<Option<Arc<str>>>,
    pub(super) ids: HashMap<Arc<str>, WorkerId>,
    pub(super) blocks: Vec<u64>,
    free: Vec<WorkerId>,
}

impl Workers {
    pub(super) fn name(&self, id: WorkerId) -> Option<&Arc<str>> {
        self.names.get(id as usize).and_then(Option::as_ref)
    }

    pub(super) fn insert(&mut self, name: &str) -> WorkerId {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let name: Arc<str> = Arc::from(name);
        let id = match self.free.pop() {
            Some(id) => {
                if let Some(slot) = self.names.get_mut(id as usize) {
                    *slot = Some(name.clone());
                }
                if let Some(count) = self.blocks.get_mut(id as usize) {
                    *count = 0;
                }
                id
            }
            None => {
                self.names.push(Some(name.clone()));
                self.blocks.push(0);
                (self.names.len() - 1) as WorkerId
            }
        };
        self.ids.insert(name, id);
        id
    }

    pub(super) fn remove(&mut self, id: WorkerId) {
        if let Some(name) = self.names.get_mut(id as usize).and_then(Option::take) {
            self.ids.remove(&name);
            self.free.push(id);
        }
    }

    pub(super) fn add_blocks(&mut self, id: WorkerId, delta: usize) {
        if let Some(c) = self.blocks.get_mut(id as usize) {
            *c += delta as u64;
        }
    }

    pub(super) fn sub_blocks(&mut self, id: WorkerId, delta: usize) {
        if let Some(c) = self.blocks.get_mut(id as usize) {
            *c = c.saturating_sub(delta as u64);
        }
    }

    pub(super) fn heap_bytes(&self) -> usize {
        let names: usize = self
            .names
            .iter()
            .flatten()
            .map(|n| n.len() + 16 + ALLOC_OVERHEAD)
            .sum();
        names
            + self.names.capacity() * std::mem::size_of::<Option<Arc<str>>>()
            + self.ids.allocation_size()
            + self.blocks.capacity() * 8
            + self.free.capacity() * 4
    }

    pub(super) fn shrink(&mut self) {
        self.names.shrink_to_fit();
        self.ids.shrink_to_fit();
        self.blocks.shrink_to_fit();
        self.free.shrink_to_fit();
    }
}
