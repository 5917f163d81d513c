//! The worker table: names, weights, health, load counters and index freshness.
//!
//! Invariants:
//! - Slots are dense (`0..len`) in the order workers were added; removing a worker shifts later
//!   slots down by one, so a slot is only meaningful for the table state that produced it. Every
//!   worker also has a `uid`, never reused, which is what a [`super::Decision`] remembers.
//! - Load counters are exact sums over the decisions begun on the worker and not yet finished:
//!   `active` requests, `prefill_blocks` (blocks those requests still have to prefill: prompt
//!   blocks minus the blocks predicted cached, until [`super::Router::prefilled`] or `finish`),
//!   and `decode_blocks` (the prompt blocks they hold while they run: the KV memory their decode
//!   steps read). A removed worker's counters leave with it.
//! - Freshness is 1 for a worker whose index stream is trusted. [`WorkerTable::mark_stale`] at time
//!   `s` makes it `0.5^((now - s) / half_life)`, decaying continuously from 1 towards 0;
//!   [`WorkerTable::mark_fresh`] makes it 1 again; [`WorkerTable::set_freshness`] pins it to a
//!   given value in `[0, 1]` until the next mark.

use std::sync::Arc;

use hashbrown::HashMap;

use crate::cache::BlockCache;
use crate::error::{Error, Result};
use crate::hashing::check_weight;
use crate::index::WorkerId;

/// How a worker's freshness is currently set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Freshness {
    /// Trusted: freshness 1.
    Fresh,
    /// Stale since the given time: decays with the router's half-life.
    StaleSince(f64),
    /// Set explicitly to a value in `[0, 1]`.
    Fixed(f64),
}

/// One worker's state.
pub struct Worker {
    /// The worker's name.
    pub name: Arc<str>,
    /// Unique for the router's lifetime (a re-added name gets a new uid).
    pub uid: u64,
    /// Relative capacity (> 0): divides the load terms of the `kv_aware` cost, sets the share of
    /// `random`, `round_robin` and the `hash` bound.
    pub weight: f64,
    /// Unhealthy workers are never chosen.
    pub healthy: bool,
    /// Requests begun and not finished.
    pub active: u64,
    /// Blocks the active requests still have to prefill.
    pub prefill_blocks: u64,
    /// Prompt blocks held by the active requests.
    pub decode_blocks: u64,
    /// Index freshness (see the module docs).
    pub freshness: Freshness,
    /// Smooth weighted round robin: the worker's current weight.
    pub(super) rr_current: f64,
    /// Approx mode: the model of the worker's KV cache.
    pub(super) cache: Option<BlockCache>,
    /// Approx mode: no modelled block can pass the TTL before this time.
    pub(super) idle_deadline: f64,
    /// Approx mode: the worker's id in the router's index.
    pub(super) index_id: Option<WorkerId>,
}

impl Worker {
    /// Freshness at `now`, in `[0, 1]`.
    pub fn freshness_at(&self, now: f64, half_life: f64) -> f64 {
        match self.freshness {
            Freshness::Fresh => 1.0,
            Freshness::Fixed(f) => f,
            Freshness::StaleSince(since) => {
                let age = (now - since).max(0.0);
                if half_life > 0.0 {
                    0.5f64.powf(age / half_life)
                } else {
                    0.0
                }
            }
        }
    }

    /// Active requests per unit of weight (the load `least_loaded` and `power_of_two` compare).
    pub fn request_load(&self) -> f64 {
        self.active as f64 / self.weight
    }
}

/// The workers, in the order they were added.
#[derive(Default)]
pub struct WorkerTable {
    workers: Vec<Worker>,
    by_name: HashMap<Arc<str>, u32>,
    next_uid: u64,
}

impl WorkerTable {
    /// Number of workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// True when there is no worker.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The workers, by slot.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &Worker> + '_ {
        self.workers.iter()
    }

    /// The worker in `slot`.
    pub fn get(&self, slot: u32) -> Option<&Worker> {
        self.workers.get(slot as usize)
    }

    pub(super) fn get_mut(&mut self, slot: u32) -> Option<&mut Worker> {
        self.workers.get_mut(slot as usize)
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Worker> + '_ {
        self.workers.iter_mut()
    }

    /// The slot of worker `name`.
    pub fn slot(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    /// The slot of worker `name`, or a `KeyError` naming it.
    pub fn require(&self, name: &str) -> Result<u32> {
        self.slot(name).ok_or_else(|| unknown(name))
    }

    /// Worker `name`, or a `KeyError` naming it.
    pub fn named(&self, name: &str) -> Result<&Worker> {
        let slot = self.require(name)?;
        self.get(slot).ok_or_else(|| unknown(name))
    }

    /// Worker `name`, mutably, or a `KeyError` naming it.
    pub(super) fn named_mut(&mut self, name: &str) -> Result<&mut Worker> {
        let slot = self.require(name)?;
        self.get_mut(slot).ok_or_else(|| unknown(name))
    }

    /// The slot of the worker with `uid` (`hint` is tried first).
    pub fn slot_of_uid(&self, uid: u64, hint: u32) -> Option<u32> {
        if self.get(hint).is_some_and(|w| w.uid == uid) {
            return Some(hint);
        }
        self.workers
            .iter()
            .position(|w| w.uid == uid)
            .map(|s| s as u32)
    }

    /// Checks that `name` could be added with `weight`.
    pub fn check_new(&self, name: &str, weight: f64) -> Result<()> {
        if self.by_name.contains_key(name) {
            return crate::value_err!("worker {name:?} is already present");
        }
        if name.is_empty() {
            return crate::value_err!("a worker name must not be empty");
        }
        check_weight(name, weight)
    }

    /// Appends a worker (checked with [`WorkerTable::check_new`]); returns its slot.
    pub(super) fn push(&mut self, name: &str, weight: f64) -> Result<u32> {
        self.check_new(name, weight)?;
        let slot = self.workers.len() as u32;
        let name: Arc<str> = Arc::from(name);
        self.next_uid += 1;
        self.workers.push(Worker {
            name: name.clone(),
            uid: self.next_uid,
            weight,
            healthy: true,
            active: 0,
            prefill_blocks: 0,
            decode_blocks: 0,
            freshness: Freshness::Fresh,
            rr_current: 0.0,
            cache: None,
            idle_deadline: f64::INFINITY,
            index_id: None,
        });
        self.by_name.insert(name, slot);
        Ok(slot)
    }

    /// Removes worker `name`; returns it. Later slots shift down by one.
    pub(super) fn remove(&mut self, name: &str) -> Result<Worker> {
        let slot = self.require(name)?;
        let worker = self.workers.remove(slot as usize);
        self.by_name.remove(name);
        for s in self.by_name.values_mut() {
            if *s > slot {
                *s -= 1;
            }
        }
        Ok(worker)
    }

    /// Marks `name`'s index stream stale since `now` (its overlap credit starts decaying).
    /// A worker already stale keeps its original time.
    pub fn mark_stale(&mut self, name: &str, now: f64) -> Result<()> {
        check_finite(now, "now")?;
        let w = self.named_mut(name)?;
        if !matches!(w.freshness, Freshness::StaleSince(_)) {
            w.freshness = Freshness::StaleSince(now);
        }
        Ok(())
    }

    /// Marks `name`'s index stream trusted again (freshness 1).
    pub fn mark_fresh(&mut self, name: &str) -> Result<()> {
        self.named_mut(name)?.freshness = Freshness::Fresh;
        Ok(())
    }

    /// Sets `name`'s freshness to `value` in `[0, 1]` until the next mark.
    pub fn set_freshness(&mut self, name: &str, value: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&value) {
            return crate::value_err!("freshness must be in [0, 1], got {value}");
        }
        self.named_mut(name)?.freshness = Freshness::Fixed(value);
        Ok(())
    }
}

fn unknown(name: &str) -> Error {
    Error::Key(format!("unknown worker {name:?}"))
}

/// `Ok` when `value` is finite; otherwise a `ValueError` naming `what`.
pub(super) fn check_finite(value: f64, what: &str) -> Result<()> {
    if value.is_finite() {
        Ok(())
    } else {
        crate::value_err!("{what} must be a finite number, got {value}")
    }
}
