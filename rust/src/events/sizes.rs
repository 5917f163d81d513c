//! Each worker's engine block size, as its KV events (or the caller) report it, shared between an
//! [`super::Applier`] that writes it and the router that reads it.
//!
//! Guarantees: [`EngineBlockSizes::version`] changes after every change of a size (never on a
//! call that changes nothing), so a reader that keeps a copy re-reads only when it moved; a
//! size is never 0.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

/// Engine block sizes (tokens) by worker name. See the module docs.
#[derive(Debug, Default)]
pub struct EngineBlockSizes {
    version: AtomicU64,
    sizes: RwLock<HashMap<Arc<str>, u32>>,
}

impl EngineBlockSizes {
    /// Records that `worker`'s engine stores blocks of `tokens` tokens (0 is ignored).
    pub fn set(&self, worker: &str, tokens: u32) {
        if tokens == 0 || self.get(worker) == Some(tokens) {
            return;
        }
        self.sizes.write().insert(Arc::from(worker), tokens);
        self.version.fetch_add(1, Ordering::Release);
    }

    /// The block size last recorded for `worker`.
    pub fn get(&self, worker: &str) -> Option<u32> {
        self.sizes.read().get(worker).copied()
    }

    /// Changes whenever a size changes.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Forgets `worker`'s size: its engine is gone, and one added later under the name reports
    /// its own.
    pub fn forget(&self, worker: &str) {
        if self.sizes.write().remove(worker).is_some() {
            self.version.fetch_add(1, Ordering::Release);
        }
    }
}
