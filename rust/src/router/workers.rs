//! The worker table: names, weights, health, load counters and index freshness.
//!
//! Invariants:
//! - **Slots.** A worker keeps its slot while it is in the table; slots ascend in the order
//!   workers were added. A removed worker leaves a vacancy, never reused; when vacancies
//!   outnumber the workers the table is compacted (order kept) and the router renumbers what it
//!   keeps by slot. So adding, removing or changing a worker costs O(1) (amortised), and a slot
//!   is only meaningful for the table state that produced it. Every worker also has a `uid`,
//!   never reused, which is what a [`super::Decision`] remembers.
//! - Load counters are exact sums over the decisions begun on the worker and not yet finished:
//!   `active` requests, `prefill_blocks` (blocks those requests still have to prefill: prompt
//!   blocks minus the blocks predicted cached, until [`super::Router::prefilled`] or `finish`),
//!   `queued` (those requests whose prefill is not done: begun, neither `prefilled` nor
//!   finished), `decode_blocks` (the prompt blocks they hold while they run: the KV memory their
//!   decode steps read) and `written_blocks` (the blocks they add to the worker's cache: their
//!   prompt blocks not held there when routed, prefilled or still to be). A removed worker's
//!   counters leave with it.
//! - **Roles** ([`Role`]): every worker prefills, decodes or both; the table counts the workers
//!   able to do each phase, so a prefill/decode order knows when it holds them all.
//! - **Rendezvous.** Each worker's rendezvous seed is `XXH3-64(name)`; the table knows whether
//!   every worker has the same weight, so its scores ([`WorkerTable::rendezvous`]) rank exactly
//!   as a [`crate::hashing::Rendezvous`] over the same workers does, ties to the name sorting
//!   first.
//! - Freshness is 1 for a worker whose index stream is trusted. [`WorkerTable::mark_stale`] at time
//!   `s` makes it `0.5^((now - s) / half_life)`, decaying continuously from 1 towards 0;
//!   [`WorkerTable::mark_fresh`] makes it 1 again; [`WorkerTable::set_freshness`] pins it to a
//!   given value in `[0, 1]` until the next mark.

use std::cmp::Ordering;
use std::sync::Arc;

use hashbrown::HashMap;

use crate::cache::BlockCache;
use crate::error::{Error, Result};
use crate::hashing::{check_weight, Rendezvous, RendezvousScore};
use crate::index::WorkerId;

use super::pd::{Phase, Role};

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
    /// What the worker does: prefill, decode or both (see [`super::pd`]).
    pub role: Role,
    /// Rendezvous seed: `XXH3-64(name)`.
    pub(super) seed: u64,
    /// Requests begun and not finished.
    pub active: u64,
    /// Blocks the active requests still have to prefill.
    pub prefill_blocks: u64,
    /// Active requests whose prefill is not done (queued or prefilling).
    pub queued: u64,
    /// Prompt blocks held by the active requests.
    pub decode_blocks: u64,
    /// Blocks the active requests add to the worker's cache (prompt blocks not held there when
    /// they were routed).
    pub written_blocks: u64,
    /// Load of requests this router did not begin (other replicas'), as last reported by the
    /// engine ([`super::Router::set_load`]): the engine's figure minus this router's own at that
    /// moment. Added to the own counters wherever a policy weighs load.
    pub others: Load,
    /// Index freshness (see the module docs).
    pub freshness: Freshness,
    /// Smooth weighted round robin: the worker's current weight.
    pub(super) rr_current: f64,
    /// Approx mode: the model of the worker's KV cache.
    pub(super) cache: Option<Box<BlockCache>>,
    /// Approx mode: no modelled block can pass the TTL before this time.
    pub(super) idle_deadline: f64,
    /// Approx mode: the worker's id in the router's index.
    pub(super) index_id: Option<WorkerId>,
    /// The block size (tokens) the worker's engine caches in, once known (its KV events, or
    /// [`super::Router::set_engine_block_size`]): matches count only its whole blocks.
    pub engine_block_size: Option<u32>,
}

/// A worker's load counters (see the module docs), as another replica's requests add them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// Requests running or waiting.
    pub active: u64,
    /// Requests whose prefill is not done.
    pub queued: u64,
    /// Blocks waiting to be prefilled.
    pub prefill_blocks: u64,
    /// Prompt blocks held by running requests.
    pub decode_blocks: u64,
    /// Blocks the requests add to the worker's cache.
    pub written_blocks: u64,
}

impl Load {
    /// The counters in wire order: active, queued, prefill, decode, written.
    pub fn counters_mut(&mut self) -> [&mut u64; 5] {
        [
            &mut self.active,
            &mut self.queued,
            &mut self.prefill_blocks,
            &mut self.decode_blocks,
            &mut self.written_blocks,
        ]
    }

    /// Adds `delta` (wire order, as [`Load::counters_mut`]), saturating at 0.
    pub fn add(&mut self, delta: [i64; 5]) {
        add_signed(self.counters_mut(), delta);
    }
}

/// `counters[i] += delta[i]`, saturating.
fn add_signed(counters: [&mut u64; 5], delta: [i64; 5]) {
    for (v, d) in counters.into_iter().zip(delta) {
        *v = v.saturating_add_signed(d);
    }
}

impl Worker {
    /// Adds `delta` (wire order: active, queued, prefill, decode, written) to this router's own
    /// counters, saturating at 0: what `begin`, `prefilled`, `finish` and `withdraw` change, and
    /// announce to the other replicas as the same delta.
    pub(super) fn add_load(&mut self, delta: [i64; 5]) {
        let own = [
            &mut self.active,
            &mut self.queued,
            &mut self.prefill_blocks,
            &mut self.decode_blocks,
            &mut self.written_blocks,
        ];
        add_signed(own, delta);
    }

    /// Active requests, this router's and (as last reported) the others'.
    pub fn total_active(&self) -> u64 {
        self.active.saturating_add(self.others.active)
    }

    /// Blocks queued for prefill, this router's and the others'.
    pub fn total_prefill_blocks(&self) -> u64 {
        self.prefill_blocks
            .saturating_add(self.others.prefill_blocks)
    }

    /// Prompt blocks of running requests, this router's and the others'.
    pub fn total_decode_blocks(&self) -> u64 {
        self.decode_blocks.saturating_add(self.others.decode_blocks)
    }

    /// Requests whose prefill is not done, this router's and the others'.
    pub fn total_queued(&self) -> u64 {
        self.queued.saturating_add(self.others.queued)
    }

    /// Blocks the requests add to the worker's cache, this router's and the others'.
    pub fn total_written_blocks(&self) -> u64 {
        self.written_blocks
            .saturating_add(self.others.written_blocks)
    }

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
        self.total_active() as f64 / self.weight
    }
}

/// The workers, in the order they were added (see the module docs).
#[derive(Default)]
pub struct WorkerTable {
    /// By slot; `None` is a vacancy left by a removed worker.
    slots: Vec<Option<Worker>>,
    by_name: HashMap<Arc<str>, u32>,
    healthy: usize,
    /// Workers per distinct weight (its bits): rendezvous is uniform with at most one entry.
    weights: HashMap<u64, usize>,
    /// Workers able to prefill, able to decode (a `Both` worker counts in each).
    capable: [usize; 2],
    next_uid: u64,
}

/// Vacancies tolerated before [`WorkerTable::compact`] renumbers: at least this many, and more
/// than the workers.
const MIN_VACANCIES: usize = 64;

impl WorkerTable {
    /// Number of workers.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// True when there is no worker.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Number of healthy workers.
    pub fn healthy(&self) -> usize {
        self.healthy
    }

    /// Number of workers able to do `phase` (see [`Role`]).
    pub fn capable(&self, phase: Phase) -> usize {
        let [p, d] = self.capable;
        match phase {
            Phase::Prefill => p,
            Phase::Decode => d,
        }
    }

    /// One past the largest slot (what per-slot buffers must cover).
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// The workers, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = &Worker> + '_ {
        self.slots.iter().flatten()
    }

    /// `(slot, worker)`, in slot order.
    pub fn iter_slots(&self) -> impl Iterator<Item = (u32, &Worker)> + '_ {
        (0u32..)
            .zip(&self.slots)
            .filter_map(|(s, w)| w.as_ref().map(|w| (s, w)))
    }

    /// The worker in `slot`.
    pub fn get(&self, slot: u32) -> Option<&Worker> {
        self.slots.get(slot as usize)?.as_ref()
    }

    pub(super) fn get_mut(&mut self, slot: u32) -> Option<&mut Worker> {
        self.slots.get_mut(slot as usize)?.as_mut()
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Worker> + '_ {
        self.slots.iter_mut().flatten()
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

    /// The slot of the worker `name` with `uid` (`hint` is tried first); `None` once that
    /// worker was removed (even if the name was added again since).
    pub fn slot_of_uid(&self, name: &str, uid: u64, hint: u32) -> Option<u32> {
        if self.get(hint).is_some_and(|w| w.uid == uid) {
            return Some(hint);
        }
        let slot = self.slot(name)?;
        self.get(slot).is_some_and(|w| w.uid == uid).then_some(slot)
    }

    /// Makes room for `n` more workers.
    pub(super) fn reserve(&mut self, n: usize) {
        self.slots.reserve(n);
        self.by_name.reserve(n);
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
    pub(super) fn push(&mut self, name: &str, weight: f64, role: Role) -> Result<u32> {
        self.check_new(name, weight)?;
        let Ok(slot) = u32::try_from(self.slots.len()) else {
            return crate::value_err!("too many workers");
        };
        let name: Arc<str> = Arc::from(name);
        self.next_uid += 1;
        self.slots.push(Some(Worker {
            name: name.clone(),
            uid: self.next_uid,
            weight,
            healthy: true,
            role,
            seed: Rendezvous::node_seed(&name),
            active: 0,
            prefill_blocks: 0,
            queued: 0,
            decode_blocks: 0,
            written_blocks: 0,
            others: Load::default(),
            freshness: Freshness::Fresh,
            rr_current: 0.0,
            cache: None,
            idle_deadline: f64::INFINITY,
            index_id: None,
            engine_block_size: None,
        }));
        self.by_name.insert(name, slot);
        self.healthy += 1;
        *self.weights.entry(weight.to_bits()).or_default() += 1;
        self.count_role(role, true);
        Ok(slot)
    }

    /// Counts (`add`) or uncounts a worker of `role` in the per-phase totals.
    fn count_role(&mut self, role: Role, add: bool) {
        let [p, d] = &mut self.capable;
        for (phase, n) in [(Phase::Prefill, p), (Phase::Decode, d)] {
            if role.does(phase) {
                *n = if add { *n + 1 } else { n.saturating_sub(1) };
            }
        }
    }

    /// Sets worker `name`'s role; returns its slot and whether the role changed.
    pub(super) fn set_role(&mut self, name: &str, role: Role) -> Result<(u32, bool)> {
        let slot = self.require(name)?;
        let w = self.get_mut(slot).ok_or_else(|| unknown(name))?;
        let old = w.role;
        w.role = role;
        if old != role {
            self.count_role(old, false);
            self.count_role(role, true);
        }
        Ok((slot, old != role))
    }

    /// Removes worker `name`, leaving a vacancy; returns its slot and the worker.
    pub(super) fn remove(&mut self, name: &str) -> Result<(u32, Worker)> {
        let slot = self.require(name)?;
        let Some(worker) = self.slots.get_mut(slot as usize).and_then(Option::take) else {
            return Err(unknown(name));
        };
        self.by_name.remove(name);
        if worker.healthy {
            self.healthy -= 1;
        }
        self.count_role(worker.role, false);
        let bits = worker.weight.to_bits();
        if let Some(n) = self.weights.get_mut(&bits) {
            *n -= 1;
            if *n == 0 {
                self.weights.remove(&bits);
            }
        }
        Ok((slot, worker))
    }

    /// Sets worker `name`'s health; returns its slot and whether the health changed.
    pub(super) fn set_healthy(&mut self, name: &str, healthy: bool) -> Result<(u32, bool)> {
        let slot = self.require(name)?;
        let w = self.get_mut(slot).ok_or_else(|| unknown(name))?;
        let changed = w.healthy != healthy;
        w.healthy = healthy;
        if changed {
            if healthy {
                self.healthy += 1;
            } else {
                self.healthy -= 1;
            }
        }
        Ok((slot, changed))
    }

    /// When vacancies outnumber the workers (and [`MIN_VACANCIES`]), renumbers the workers
    /// densely, keeping their order; returns the new slot of each old slot (`None`: vacant).
    pub(super) fn compact(&mut self) -> Option<Vec<Option<u32>>> {
        let vacant = self.slots.len() - self.len();
        if vacant < MIN_VACANCIES || vacant <= self.len() {
            return None;
        }
        let mut renumber = Vec::with_capacity(self.slots.len());
        let mut next = 0u32;
        for w in &self.slots {
            renumber.push(w.as_ref().map(|_| {
                next += 1;
                next - 1
            }));
        }
        self.slots.retain(Option::is_some);
        for (slot, w) in (0u32..).zip(self.slots.iter().flatten()) {
            if let Some(s) = self.by_name.get_mut(&w.name) {
                *s = slot;
            }
        }
        Some(renumber)
    }

    /// Worker names by slot (`None`: vacant).
    pub(super) fn roster(&self) -> Arc<[Option<Arc<str>>]> {
        self.slots
            .iter()
            .map(|w| w.as_ref().map(|w| w.name.clone()))
            .collect()
    }

    /// True when every worker has the same weight (rendezvous compares raw draws then).
    pub fn uniform(&self) -> bool {
        self.weights.len() <= 1
    }

    /// The rendezvous score of worker `w` for the key hashing to `key_hash` (see the module
    /// docs); order with [`rendezvous_order`].
    pub(super) fn rendezvous(&self, w: &Worker, key_hash: u64) -> RendezvousScore {
        Rendezvous::node_score(key_hash, w.seed, w.weight, self.uniform())
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

/// Rendezvous order of two scored workers: `Less` when `a` comes first (the higher score, then
/// the name sorting first).
pub(super) fn rendezvous_order(
    a: (RendezvousScore, &Worker),
    b: (RendezvousScore, &Worker),
) -> Ordering {
    b.0.partial_cmp(&a.0)
        .unwrap_or(Ordering::Equal)
        .then_with(|| a.1.name.cmp(&b.1.name))
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
