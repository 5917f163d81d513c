//! Test-only reader of the applier's per-worker maps, and its pages (to pad their arena in
//! `tests_pages.rs`): a child module of `apply`, so it sees them. The memory rule of the module
//! docs — one entry per engine block the worker holds, removals and clears prune it — is checked
//! against an engine model in `tests_memory.rs`.

use super::Applier;
use crate::events::pages::Pages;

/// The engine hashes one tier's maps hold for a worker, each sorted: `links`, `firsts`,
/// `digests`, and whether its `pages` are empty.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::events) struct MapKeys {
    pub links: Vec<u64>,
    pub firsts: Vec<u64>,
    pub digests: Vec<u64>,
    pub pages_empty: bool,
}

impl Applier {
    /// `worker`'s maps, by tier (empty for a worker the applier does not know).
    pub(in crate::events) fn map_keys(&self, worker: &str) -> Vec<MapKeys> {
        let sorted = |keys: Vec<u64>| {
            let mut keys = keys;
            keys.sort_unstable();
            keys
        };
        self.workers.get(worker).map_or_else(Vec::new, |w| {
            w.tiers
                .iter()
                .map(|t| MapKeys {
                    links: sorted(t.links.keys().copied().collect()),
                    firsts: sorted(t.firsts.keys().copied().collect()),
                    digests: sorted(t.digests.keys().copied().collect()),
                    pages_empty: t.pages.is_empty(),
                })
                .collect()
        })
    }

    /// `worker`'s pages on tier `tier` (`None` for a worker or tier the applier does not know).
    pub(in crate::events) fn pages_mut(&mut self, worker: &str, tier: usize) -> Option<&mut Pages> {
        let state = self.workers.get_mut(worker)?.tiers.get_mut(tier)?;
        Some(&mut state.pages)
    }
}
