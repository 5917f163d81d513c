//! Time-limited pins ("leases") and the queue that releases them.
//!
//! Invariants: a block holds at most one lease, with an end time that only moves later; the queue
//! holds one item per lease extension, and the item that matches the block's current lease is the
//! one that releases it. Items of extended leases are dropped when they come due (they are always
//! due before the current one), so the queue never holds an item for a block without a lease.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use hashbrown::HashMap;

/// One queued lease end.
#[derive(Clone, Copy, Debug)]
struct Due {
    end: f64,
    seq: u64,
    block: u32,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    fn cmp(&self, other: &Self) -> Ordering {
        self.end
            .total_cmp(&other.end)
            .then(self.seq.cmp(&other.seq))
            .then(self.block.cmp(&other.block))
    }
}

/// The current lease of every leased block and the queue of lease ends.
#[derive(Clone, Debug, Default)]
pub(super) struct Leases {
    queue: BinaryHeap<Reverse<Due>>,
    /// Block index → (end, sequence number of the extension that set it).
    current: HashMap<u32, (f64, u64)>,
    seq: u64,
}

impl Leases {
    /// End time of block `block`'s lease, if it has one.
    pub fn end(&self, block: u32) -> Option<f64> {
        self.current.get(&block).map(|&(end, _)| end)
    }

    /// Number of blocks holding a lease.
    pub fn len(&self) -> usize {
        self.current.len()
    }

    /// Extends `block`'s lease to end at `end` (a lease never gets shorter). Returns true when the
    /// block had no lease before.
    pub fn extend(&mut self, block: u32, end: f64) -> bool {
        let previous = self.current.get(&block).copied();
        if previous.is_some_and(|(old, _)| old >= end) {
            return false;
        }
        self.seq += 1;
        self.current.insert(block, (end, self.seq));
        self.queue.push(Reverse(Due {
            end,
            seq: self.seq,
            block,
        }));
        previous.is_none()
    }

    /// Whether a queued lease end is at or before `now` (a call taking `now` would first release
    /// it, or drop its item if the lease was extended).
    pub fn due(&self, now: f64) -> bool {
        self.queue.peek().is_some_and(|Reverse(due)| due.end <= now)
    }

    /// Ends and returns the next lease (earliest end, then earliest extension) that ends at or
    /// before `now`, if any.
    pub fn pop_due(&mut self, now: f64) -> Option<u32> {
        while let Some(Reverse(due)) = self.queue.peek().copied() {
            if due.end > now {
                return None;
            }
            self.queue.pop();
            if self.current.get(&due.block) == Some(&(due.end, due.seq)) {
                self.current.remove(&due.block);
                return Some(due.block);
            }
        }
        None
    }
}
