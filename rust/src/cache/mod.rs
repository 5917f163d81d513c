//! A model of a worker's KV memory: a cache of block hashes with LRU eviction of leaves, pinning,
//! time-limited pins (leases) and reserved partitions.
//!
//! # Semantics
//!
//! **Chains.** Blocks form chains as they are inserted: each block of an inserted chain is the
//! child of the block before it (the first one is the child of `parent`, or a root). A block's
//! parent is fixed when the block is first cached; inserting a cached block again (in any chain)
//! refreshes it but does not move it. So the cached blocks form a forest.
//!
//! **Recency.** Each *touch* of a block makes it the most recently used block. Touches are, in
//! order: `insert` touches `parent` (if given), then each block of the chain that it stores;
//! `match` touches the leading cached blocks; releasing a block's last pin (by `unpin` or by its
//! lease ending) touches it. Pinning does not touch. Recency is a block's own last touch: touching
//! a prefix does not refresh its descendants, and a block whose children are all evicted keeps its
//! own last touch.
//!
//! **Eviction.** When a new block needs room, the least recently used *evictable* block is evicted:
//! an unpinned block with no cached child (a leaf), not touched by the running operation, whose
//! partition the inserting partition may evict (below). Consequently a block is never evicted
//! before its descendants, a cached block's parent is always cached, and pinned blocks (and their
//! ancestors) stay. When no block is evictable, `insert` stops: the longest prefix of the chain
//! that fits is stored, with exactly the evictions that made room for it.
//!
//! **Partitions.** `reserved = {name: blocks}` declares partitions (the sum must not exceed the
//! capacity); inserting with no partition uses the shared pool (reservation 0). Every block
//! belongs to exactly one partition and `usage(p)` counts the blocks that belong to `p`
//! (`usage()` of the shared pool); the usages add up to `len()`. A new block belongs to the
//! partition that inserted it. A cached block inserted again into a *declared* partition moves to
//! that partition (the reservation of the tenant that uses a shared prefix protects it); an insert
//! into the shared pool never takes a block from a partition, and `parent` is never moved.
//! An insert into partition `p` that needs room evicts:
//! * if `p` is below its reservation: the least recently used evictable block among partitions
//!   *over* their reservation (borrowers, the shared pool included); only if there is none, `p`'s
//!   own;
//! * otherwise: the least recently used evictable block of `p` itself or of any other partition
//!   over its reservation.
//!
//! So a partition's blocks, up to its reserved size, are evicted only by inserts into that same
//! partition; a partition under its reservation lends the unused space to everyone (free slots
//! are used by whoever inserts) and takes it back by evicting borrowers. A borrower whose blocks
//! are all pinned (or hold up pinned or protected descendants) cannot be evicted, and then the
//! owner evicts its own blocks or stores a shorter prefix.
//!
//! **Pins and leases.** `pin` adds one reference to each block and `unpin` removes one; a block
//! with a reference is never evicted (a block holds at most 65 535 references, a lease counting
//! as one; `pin` beyond that is an error). `pin` with a time-to-live instead gives each block a *lease*
//! ending at `now + ttl` (an existing lease is extended, never shortened). A lease is not a
//! reference: `unpin` does not end it. Leases end lazily: every call that takes `now` (`insert`,
//! `pin`, `unpin`, `expire`) first releases, in order of end time (then of when they were set),
//! every lease that ended at or before `now`, before doing its own work. Time is whatever the
//! caller passes (virtual time in a simulator); it need not increase between calls — a lease
//! released stays released.
//!
//! **Matching.** `match_prefix` (Python `match`) counts the leading hashes that are cached and
//! touches them; `peek_prefix` (Python `peek`) counts without touching. Both look hashes up one
//! by one: with chained block hashes a cached hash implies its prefix.
//!
//! **Idle expiry.** With [`BlockCache::track_idle`] on, each touch is stamped with the cache's
//! clock (the largest `now` passed to any call so far) and [`BlockCache::expire_idle_into`] drops
//! the blocks idle longer than a given time, by the eviction rules: only evictable blocks (no pin,
//! no lease), leaves first, so a prefix still outlives its descendants. Pinned blocks are never
//! idle; releasing the last pin is a touch.
//!
//! **Changing partitions.** [`BlockCache::add_partition`] declares a partition later and
//! [`BlockCache::set_reserved`] changes a reservation (lowering it evicts nothing: the blocks above
//! it become borrowers). The reservations never add up to more than the capacity.
//!
//! **Removal.** [`BlockCache::remove_into`] takes blocks out explicitly (a model corrected by what
//! the engine reported), descendants first; a pinned block, or one whose cached children are not
//! removed before it, is refused.
//!
//! **Errors.** Every method validates all of its input before changing anything: an unknown
//! partition, a `parent` or pinned block that is not cached, a block unpinned more times than it
//! is pinned, a non-finite time or negative ttl is an [`Error`](crate::Error) and leaves the
//! cache unchanged.
//!
//! # Invariants
//!
//! After every call: `len() <= capacity()`; the usages of all partitions add up to `len()`; a
//! cached block's parent is cached; no block with a pin or an unreleased lease has been evicted;
//! an insert into `p` evicted at most `usage(q) - reserved(q)` blocks of any other partition `q`;
//! the evicted hashes reported are exactly the blocks that left, in eviction order.
//!
//! # Use from Rust
//!
//! Resolve partition names once with [`BlockCache::partition`]; on hot paths call
//! [`BlockCache::insert_into`] with a reused `Vec` for the evicted hashes, and
//! [`BlockCache::peek_prefix`] to score a cache without refreshing it. The cache is a plain value
//! (`Send`, `Clone`); share it behind a lock.
//!
//! # Cost
//!
//! O(1) amortised per block and no allocation per block: 32-byte slab entries with `u32`
//! indices, one intrusive recency list per partition, and an open-addressing table of 8-byte
//! slots (hash tag → slab index), grown at most once per batch — 48 to 64 bytes per cached block
//! in all. An eviction also scans the partitions over their
//! reservation (a handful). Batches prefetch the table slots a few blocks ahead, and large tables
//! and slabs ask Linux for transparent huge pages. See `recency` for the eviction order and the
//! proof that it is exact, and `table` for the hash table.

mod lease;
mod recency;
mod table;

use hashbrown::HashMap;

use crate::error::Result;
use lease::Leases;
use recency::{Recency, NIL};
use table::{Probe, Table};

/// How many blocks ahead batch lookups prefetch their hash-table slot.
const PREFETCH: usize = 16;

/// Largest capacity a cache accepts (2^30 - 1 blocks).
pub const MAX_CAPACITY: usize = recency::MAX_BLOCKS;

/// A point in a [`BlockCache`]'s order of touches ([`BlockCache::touch_mark`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TouchMark {
    epoch: u32,
    tick: u32,
}

/// A partition of a [`BlockCache`], resolved once by name with [`BlockCache::partition`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PartitionId(u16);

impl PartitionId {
    /// The shared pool: no reservation, never takes blocks from a declared partition.
    pub const SHARED: PartitionId = PartitionId(0);
}

#[derive(Clone, Debug)]
struct Partition {
    name: Option<String>,
    reserved: usize,
    usage: usize,
}

/// An LRU cache of block hashes with leaf-first eviction, pins, leases and reserved partitions.
/// See the [module documentation](self) for the exact semantics.
#[derive(Clone, Debug)]
pub struct BlockCache {
    capacity: usize,
    len: usize,
    table: Table,
    order: Recency,
    partitions: Vec<Partition>,
    by_name: HashMap<String, u16>,
    leases: Leases,
    /// Reused between calls: slab indices of the blocks being pinned or unpinned.
    scratch: Vec<u32>,
}

fn check_time(now: f64) -> Result<()> {
    if now.is_finite() {
        Ok(())
    } else {
        crate::value_err!("now must be a finite number of seconds, got {now}")
    }
}

impl BlockCache {
    /// A cache of `capacity` blocks with only the shared pool.
    pub fn new(capacity: usize) -> Result<Self> {
        Self::with_reserved::<&str>(capacity, &[])
    }

    /// A cache of `capacity` blocks with the given reserved partitions `(name, blocks)`.
    /// Errors: capacity over [`MAX_CAPACITY`], reservations adding up to more than the capacity,
    /// a repeated name, or more than 65 534 partitions.
    pub fn with_reserved<S: AsRef<str>>(capacity: usize, reserved: &[(S, usize)]) -> Result<Self> {
        if capacity > MAX_CAPACITY {
            return crate::value_err!("capacity must be at most {MAX_CAPACITY}, got {capacity}");
        }
        let shared = Partition {
            name: None,
            reserved: 0,
            usage: 0,
        };
        let mut cache = BlockCache {
            capacity,
            len: 0,
            table: Table::default(),
            order: Recency::new(1),
            partitions: vec![shared],
            by_name: HashMap::with_capacity(reserved.len()),
            leases: Leases::default(),
            scratch: Vec::new(),
        };
        for (name, blocks) in reserved {
            cache.add_partition(name.as_ref(), *blocks)?;
        }
        Ok(cache)
    }

    /// The id of the declared partition `name` (a [`crate::Error::Key`] if it was not declared).
    pub fn partition(&self, name: &str) -> Result<PartitionId> {
        match self.by_name.get(name) {
            Some(&id) => Ok(PartitionId(id)),
            None => crate::key_err!("unknown partition {name:?}"),
        }
    }

    /// The declared partitions: `(name, reserved blocks)`, in declaration order.
    pub fn reservations(&self) -> impl Iterator<Item = (&str, usize)> + '_ {
        self.partitions
            .iter()
            .filter_map(|p| p.name.as_deref().map(|n| (n, p.reserved)))
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of cached blocks.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no block is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of cached blocks that belong to `partition`.
    pub fn usage(&self, partition: PartitionId) -> usize {
        self.partitions
            .get(usize::from(partition.0))
            .map_or(0, |p| p.usage)
    }

    /// Whether `hash` is cached (does not refresh it).
    pub fn contains(&self, hash: u64) -> bool {
        self.find(hash).is_some()
    }

    /// Number of references (`pin` minus `unpin`) block `hash` holds, if it is cached.
    pub fn pins(&self, hash: u64) -> Option<u32> {
        let i = self.find(hash)?;
        let leased = u32::from(self.leases.end(i).is_some());
        Some(u32::from(self.order.get(i)?.pins) - leased)
    }

    /// End time of block `hash`'s lease, if it is cached and has one (ended leases count until
    /// released by a call that takes `now`).
    pub fn lease_end(&self, hash: u64) -> Option<f64> {
        self.leases.end(self.find(hash)?)
    }

    /// Number of blocks holding a lease.
    pub fn leases(&self) -> usize {
        self.leases.len()
    }

    /// Whether a call taking `now` (`insert`, `pin`, `unpin`, `expire`) would first have lease
    /// work to do: a lease (or an extended lease's queued end) ending at or before `now`. The
    /// work is unbounded (every lease ended since), so a caller that runs short calls inline can
    /// ask first.
    pub fn leases_due(&self, now: f64) -> bool {
        self.leases.due(now)
    }

    /// Number of leading blocks of `hashes` that are cached, without refreshing them.
    pub fn peek_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .position(|&h| self.find(h).is_none())
            .unwrap_or(hashes.len())
    }

    /// Number of leading blocks of `hashes` that are cached; touches them, in order.
    pub fn match_prefix(&mut self, hashes: &[u64]) -> usize {
        for (k, &h) in hashes.iter().enumerate() {
            if let Some(&ahead) = hashes.get(k + PREFETCH) {
                self.table.prefetch(ahead);
            }
            match self.find(h) {
                Some(i) => self.order.touch(i),
                None => return k,
            }
        }
        hashes.len()
    }

    /// Inserts the chain `hashes` into `partition`, continuing from the cached block `parent` if
    /// given, after releasing the leases ended at `now`. Appends the evicted hashes to `evicted`
    /// (in eviction order) and returns how many leading blocks of `hashes` are now cached (all of
    /// them unless no evictable block was left).
    pub fn insert_into(
        &mut self,
        hashes: &[u64],
        partition: PartitionId,
        parent: Option<u64>,
        now: f64,
        evicted: &mut Vec<u64>,
    ) -> Result<usize> {
        check_time(now)?;
        let part = partition.0;
        if usize::from(part) >= self.partitions.len() {
            return crate::key_err!("unknown partition id {part}");
        }
        let parent = match parent {
            Some(h) => match self.find(h) {
                Some(i) => i,
                None => return crate::key_err!("parent block {h:#x} is not cached"),
            },
            None => NIL,
        };
        self.expire(now)?;
        self.order.protect_from_now();
        if parent != NIL {
            self.order.touch(parent);
        }
        let room = self.capacity.saturating_sub(self.len);
        self.reserve(hashes.len().min(room));
        let claims = part != PartitionId::SHARED.0;
        let mut prev = parent;
        for (k, &h) in hashes.iter().enumerate() {
            if let Some(&ahead) = hashes.get(k + PREFETCH) {
                self.table.prefetch(ahead);
            }
            let order = &self.order;
            let is_h = |i: u32| order.get(i).is_some_and(|e| e.hash == h);
            let mut vacant = match self.table.probe(h, is_h) {
                Probe::Found(i) => {
                    if claims && self.order.get(i).is_some_and(|e| e.part != part) {
                        self.move_block(i, part);
                    } else {
                        self.order.touch(i);
                    }
                    prev = i;
                    continue;
                }
                Probe::Vacant(at) => at,
            };
            if self.len >= self.capacity {
                match self.victim(part) {
                    Some(v) => self.evict(v, evicted),
                    None => {
                        self.order.unprotect();
                        return Ok(k);
                    }
                }
                // The eviction shifted table slots: find the empty slot again.
                let order = &self.order;
                let is_h = |i: u32| order.get(i).is_some_and(|e| e.hash == h);
                if let Probe::Vacant(at) = self.table.probe(h, is_h) {
                    vacant = at;
                }
            }
            let i = self.order.add(h, prev, part);
            self.table.fill(vacant, h, i);
            self.len += 1;
            if let Some(p) = self.partitions.get_mut(usize::from(part)) {
                p.usage += 1;
            }
            prev = i;
        }
        self.order.unprotect();
        Ok(hashes.len())
    }

    /// [`insert_into`](Self::insert_into) returning the evicted hashes in a new vector.
    pub fn insert(
        &mut self,
        hashes: &[u64],
        partition: PartitionId,
        parent: Option<u64>,
        now: f64,
    ) -> Result<(usize, Vec<u64>)> {
        let mut evicted = Vec::new();
        let stored = self.insert_into(hashes, partition, parent, now, &mut evicted)?;
        Ok((stored, evicted))
    }

    /// Adds one reference to every block of `hashes` (a block listed twice gets two), after
    /// releasing the leases ended at `now`. Every block must be cached.
    pub fn pin(&mut self, hashes: &[u64], now: f64) -> Result<()> {
        check_time(now)?;
        let blocks = self.lookup_all(hashes)?;
        for (k, &i) in blocks.iter().enumerate() {
            let Some(e) = self.order.get_mut(i) else {
                continue;
            };
            match e.pins.checked_add(1) {
                Some(p) => e.pins = p,
                None => {
                    let hash = e.hash;
                    self.add_pins(blocks.get(..k).unwrap_or_default(), -1);
                    self.scratch = blocks;
                    return crate::value_err!("block {hash:#x} has too many pins");
                }
            }
        }
        // Validated. The ended leases go first (a block they leave unpinned is touched), then
        // the pins are added.
        self.add_pins(&blocks, -1);
        self.expire(now)?;
        self.add_pins(&blocks, 1);
        for &i in &blocks {
            self.order.hold(i);
        }
        self.scratch = blocks;
        Ok(())
    }

    /// Gives every block of `hashes` a lease ending at `now + ttl` (extending, never shortening,
    /// a lease it has), after releasing the leases ended at `now`. Every block must be cached.
    pub fn lease(&mut self, hashes: &[u64], ttl: f64, now: f64) -> Result<()> {
        check_time(now)?;
        if !(ttl.is_finite() && ttl >= 0.0) {
            return crate::value_err!("ttl must be a finite number of seconds >= 0, got {ttl}");
        }
        let blocks = self.lookup_all(hashes)?;
        for &i in &blocks {
            let full = self.order.get(i).is_some_and(|e| e.pins == u16::MAX);
            if full && self.leases.end(i).is_none() {
                let hash = self.order.get(i).map_or(0, |e| e.hash);
                self.scratch = blocks;
                return crate::value_err!("block {hash:#x} has too many pins");
            }
        }
        self.expire(now)?;
        let end = now + ttl;
        for &i in &blocks {
            if self.leases.extend(i, end) {
                if let Some(e) = self.order.get_mut(i) {
                    e.pins = e.pins.saturating_add(1);
                }
                self.order.hold(i);
            }
        }
        self.scratch = blocks;
        Ok(())
    }

    /// Removes one reference from every block of `hashes` (a block listed twice loses two), after
    /// releasing the leases ended at `now`. A block whose last pin goes is touched; blocks are
    /// touched in the order of their last occurrence in `hashes`.
    pub fn unpin(&mut self, hashes: &[u64], now: f64) -> Result<()> {
        check_time(now)?;
        let blocks = self.lookup_all(hashes)?;
        for (k, &i) in blocks.iter().enumerate() {
            let leased = u16::from(self.leases.end(i).is_some());
            let Some(e) = self.order.get_mut(i) else {
                continue;
            };
            if e.pins <= leased {
                let hash = e.hash;
                self.add_pins(blocks.get(..k).unwrap_or_default(), 1);
                self.scratch = blocks;
                return crate::value_err!("block {hash:#x} is not pinned");
            }
            e.pins -= 1;
        }
        // Validated. The ended leases go first (with the pins still held), then the pins.
        self.add_pins(&blocks, 1);
        self.expire(now)?;
        self.add_pins(&blocks, -1);
        for &i in &blocks {
            if self.order.get(i).is_some_and(|e| e.pins == 0) {
                self.order.touch(i);
            }
        }
        self.scratch = blocks;
        Ok(())
    }

    /// Releases every lease that ended at or before `now` (in order of end time, then of when it
    /// was set); a block left with no pin is touched. Returns the number of leases released.
    pub fn expire(&mut self, now: f64) -> Result<usize> {
        check_time(now)?;
        self.order.advance(now);
        let mut released = 0;
        while let Some(i) = self.leases.pop_due(now) {
            released += 1;
            let Some(e) = self.order.get_mut(i) else {
                continue;
            };
            e.pins = e.pins.saturating_sub(1);
            if e.pins == 0 {
                self.order.touch(i);
            }
        }
        Ok(released)
    }

    /// Starts recording when each block was last touched, for [`expire_idle_into`]
    /// (Self::expire_idle_into). A touch is stamped with the cache's clock: the largest `now`
    /// passed to any call so far (`match_prefix` takes no `now` and uses it as it stands).
    /// Blocks already cached count as touched at the current clock. Costs 8 bytes per block.
    pub fn track_idle(&mut self) {
        self.order.track_times();
    }

    /// Whether [`track_idle`](Self::track_idle) is on.
    pub fn tracks_idle(&self) -> bool {
        self.order.tracks_times()
    }

    /// The cache's clock: the largest `now` passed so far (`-inf` before any).
    pub fn clock(&self) -> f64 {
        self.order.now()
    }

    /// When block `hash` was last touched (with [`track_idle`](Self::track_idle) on).
    pub fn last_touch(&self, hash: u64) -> Option<f64> {
        self.order.time(self.find(hash)?)
    }

    /// A point in the order of touches: every touch after it compares later (see
    /// [`BlockCache::touched_since`]).
    pub fn touch_mark(&self) -> TouchMark {
        let (epoch, tick) = self.order.clock();
        TouchMark { epoch, tick }
    }

    /// Whether block `hash` was touched after `mark`: `None` when it is not cached, or when the
    /// touch order was renumbered since `mark` (once per ~4 billion touches) so it cannot tell.
    pub fn touched_since(&self, hash: u64, mark: TouchMark) -> Option<bool> {
        let (epoch, _) = self.order.clock();
        if epoch != mark.epoch {
            return None;
        }
        Some(self.order.tick_of(self.find(hash)?)? > mark.tick)
    }

    /// Drops every block idle for more than `max_idle` at `now` — last touched before
    /// `now - max_idle` — that is evictable: unpinned, without a lease (leases ended at `now` are
    /// released first) and without a cached child once its idle descendants are gone. Blocks
    /// leave leaves first, least recently used first within each partition; their hashes are
    /// appended to `dropped`. Returns the last-touch time of the least recently used evictable
    /// block left, if any: nothing can expire before that time plus `max_idle`, until an
    /// eviction (which can turn an older block into a leaf) or a pin release.
    ///
    /// Errors (`Value`): idle tracking is off; `now` not finite; `max_idle` negative or NaN.
    pub fn expire_idle_into(
        &mut self,
        now: f64,
        max_idle: f64,
        dropped: &mut Vec<u64>,
    ) -> Result<Option<f64>> {
        check_time(now)?;
        if !self.order.tracks_times() {
            return crate::value_err!("idle expiry needs idle tracking: call track_idle first");
        }
        if max_idle.is_nan() || max_idle < 0.0 {
            return crate::value_err!("max_idle must be >= 0 seconds, got {max_idle}");
        }
        self.expire(now)?;
        let cutoff = now - max_idle;
        let mut oldest: Option<f64> = None;
        for q in 0..self.partitions.len() as u16 {
            while let Some((_, i)) = self.order.victim(q) {
                let t = self.order.time(i).unwrap_or(f64::NEG_INFINITY);
                if t < cutoff {
                    self.evict(i, dropped);
                } else {
                    oldest = Some(oldest.map_or(t, |o: f64| o.min(t)));
                    break;
                }
            }
        }
        Ok(oldest)
    }

    /// Declares a new partition `name` with `reserved` blocks (see [`BlockCache::with_reserved`]
    /// for the limits); returns its id. Errors change nothing.
    pub fn add_partition(&mut self, name: &str, reserved: usize) -> Result<PartitionId> {
        if self.by_name.contains_key(name) {
            return crate::value_err!("partition {name:?} is declared twice");
        }
        if self.partitions.len() >= usize::from(u16::MAX) {
            return crate::value_err!("at most {} partitions", u16::MAX - 1);
        }
        self.check_reservations(None, reserved)?;
        let id = self.partitions.len() as u16;
        self.partitions.push(Partition {
            name: Some(name.to_owned()),
            reserved,
            usage: 0,
        });
        self.by_name.insert(name.to_owned(), id);
        self.order.add_list();
        Ok(PartitionId(id))
    }

    /// Changes the reservation of declared partition `partition` to `blocks`. Blocks above a
    /// lowered reservation become borrowers (evictable by every partition); nothing is evicted
    /// now. Errors (the shared pool, an unknown id, reservations over the capacity) change
    /// nothing.
    pub fn set_reserved(&mut self, partition: PartitionId, blocks: usize) -> Result<()> {
        let at = usize::from(partition.0);
        if partition == PartitionId::SHARED || at >= self.partitions.len() {
            return crate::key_err!("no declared partition with id {}", partition.0);
        }
        self.check_reservations(Some(at), blocks)?;
        if let Some(p) = self.partitions.get_mut(at) {
            p.reserved = blocks;
        }
        Ok(())
    }

    /// The reservation of `partition` (0 for the shared pool or an unknown id).
    pub fn reserved(&self, partition: PartitionId) -> usize {
        self.partitions
            .get(usize::from(partition.0))
            .map_or(0, |p| p.reserved)
    }

    /// `Ok` when the reservations, with partition `replacing` (if any) set to `blocks` or a new
    /// one of `blocks` added, fit in the capacity.
    fn check_reservations(&self, replacing: Option<usize>, blocks: usize) -> Result<()> {
        let others: usize = self
            .partitions
            .iter()
            .enumerate()
            .filter(|&(i, _)| Some(i) != replacing)
            .fold(0usize, |a, (_, p)| a.saturating_add(p.reserved));
        let total = others.saturating_add(blocks);
        if total > self.capacity {
            return crate::value_err!(
                "reserved blocks would add up to {total}, more than the capacity {}",
                self.capacity
            );
        }
        Ok(())
    }

    /// Removes the listed blocks that are cached, in list order, appending their hashes to
    /// `removed`; hashes not cached (or listed again after their removal) are ignored. Each
    /// block must be unpinned, without a lease, and have no cached child when its turn comes:
    /// list descendants before their ancestors. Otherwise nothing changes and the error names
    /// the block. Removing is not a touch: the parents keep their recency.
    pub fn remove_into(&mut self, hashes: &[u64], removed: &mut Vec<u64>) -> Result<usize> {
        let mut blocks = std::mem::take(&mut self.scratch);
        blocks.clear();
        // Children of each block removed earlier in the list, counted per parent.
        let mut gone: HashMap<u32, u32> = HashMap::new();
        for &h in hashes {
            let Some(i) = self.find(h) else { continue };
            if gone.get(&i) == Some(&u32::MAX) {
                continue; // listed twice
            }
            let pins = self.order.get(i).map_or(0, |e| e.pins);
            let children = self.order.children(i) - gone.get(&i).copied().unwrap_or(0);
            if pins > 0 || children > 0 {
                self.scratch = blocks;
                let why = if pins > 0 {
                    "is pinned"
                } else {
                    "has a cached child not listed before it"
                };
                return crate::value_err!("cannot remove block {h:#x}: it {why}");
            }
            gone.insert(i, u32::MAX);
            let parent = self.order.parent(i);
            if parent != NIL {
                let c = gone.entry(parent).or_insert(0);
                *c = c.saturating_add(1);
            }
            blocks.push(i);
        }
        for &i in &blocks {
            self.evict(i, removed);
        }
        let n = blocks.len();
        self.scratch = blocks;
        Ok(n)
    }

    /// Every cached block, least recently touched first (the order that, touched again in a
    /// fresh cache, reproduces this one's eviction order): `(hash, parent, partition)`.
    pub fn blocks_by_recency(&self) -> Vec<(u64, Option<u64>, PartitionId)> {
        let mut live = Vec::with_capacity(self.len);
        self.order.live_by_tick(&mut live);
        live.iter()
            .filter_map(|&i| {
                let e = self.order.get(i)?;
                let parent = self.order.get(self.order.parent(i)).map(|p| p.hash);
                Some((e.hash, parent, PartitionId(e.part)))
            })
            .collect()
    }

    /// The name of `partition` (`None` for the shared pool or an unknown id).
    pub fn partition_name(&self, partition: PartitionId) -> Option<&str> {
        self.partitions
            .get(usize::from(partition.0))?
            .name
            .as_deref()
    }

    /// Appends the chain ending at the cached block `hash` to `out`, root first (every block of
    /// it is cached: a cached block's parent is); `false`, appending nothing, if `hash` is not
    /// cached. Not a touch.
    pub fn chain_into(&self, hash: u64, out: &mut Vec<u64>) -> bool {
        let Some(mut i) = self.find(hash) else {
            return false;
        };
        let start = out.len();
        // A parent link never cycles; the bound only guards the walk.
        for _ in 0..=self.len {
            let Some(e) = self.order.get(i) else { break };
            out.push(e.hash);
            i = self.order.parent(i);
            if i == NIL {
                break;
            }
        }
        if let Some(chain) = out.get_mut(start..) {
            chain.reverse();
        }
        true
    }

    /// Slab index of the cached block `hash`.
    #[inline]
    fn find(&self, hash: u64) -> Option<u32> {
        let order = &self.order;
        self.table
            .get(hash, |i| order.get(i).is_some_and(|e| e.hash == hash))
    }

    /// Makes room in the table and slab for `additional` new blocks, so a batch never rehashes
    /// more than once.
    fn reserve(&mut self, additional: usize) {
        self.table.reserve(additional);
        self.order.reserve(additional);
    }

    /// Slab indices of every block of `hashes` (in the reused scratch vector, which the caller
    /// puts back), or an error naming the first block that is not cached.
    fn lookup_all(&mut self, hashes: &[u64]) -> Result<Vec<u32>> {
        let mut blocks = std::mem::take(&mut self.scratch);
        blocks.clear();
        for &h in hashes {
            match self.find(h) {
                Some(i) => blocks.push(i),
                None => {
                    self.scratch = blocks;
                    return crate::key_err!("block {h:#x} is not cached");
                }
            }
        }
        Ok(blocks)
    }

    /// Adds `delta` to the pin count of each of `blocks` (undoes a partial pass).
    fn add_pins(&mut self, blocks: &[u32], delta: i64) {
        for &i in blocks {
            if let Some(e) = self.order.get_mut(i) {
                e.pins = u16::try_from(i64::from(e.pins) + delta).unwrap_or(e.pins);
            }
        }
    }

    /// Moves the cached block `i` to partition `part` (a claim by a declared partition) and
    /// touches it.
    fn move_block(&mut self, i: u32, part: u16) {
        if let Some(from) = self.order.get(i).map(|e| usize::from(e.part)) {
            if let Some(p) = self.partitions.get_mut(from) {
                p.usage -= 1;
            }
        }
        if let Some(p) = self.partitions.get_mut(usize::from(part)) {
            p.usage += 1;
        }
        self.order.claim(i, part);
    }

    /// The block to evict for a new block of partition `part`, per the partition rules.
    fn victim(&mut self, part: u16) -> Option<u32> {
        let mut best: Option<(u32, u32)> = None;
        for q in 0..self.partitions.len() {
            let q16 = q as u16;
            let over = self.partitions.get(q).is_some_and(|p| p.usage > p.reserved);
            if q16 == part || !over {
                continue;
            }
            if let Some(c) = self.order.victim(q16) {
                best = Some(best.map_or(c, |b| b.min(c)));
            }
        }
        let reclaiming = self
            .partitions
            .get(usize::from(part))
            .is_some_and(|p| p.usage < p.reserved);
        if !(reclaiming && best.is_some()) {
            if let Some(c) = self.order.victim(part) {
                best = Some(best.map_or(c, |b| b.min(c)));
            }
        }
        best.map(|(_, i)| i)
    }

    /// Evicts the unpinned leaf `i`, appending its hash to `evicted`.
    fn evict(&mut self, i: u32, evicted: &mut Vec<u64>) {
        let (hash, part) = self.order.remove(i);
        self.table.remove(hash, i);
        // The next victim is usually the new head of this list (often the parent just re-linked):
        // start loading its table slot now.
        if let Some(next) = self.order.head_hash(part) {
            self.table.prefetch(next);
        }
        if let Some(p) = self.partitions.get_mut(usize::from(part)) {
            p.usage -= 1;
        }
        self.len -= 1;
        evicted.push(hash);
    }
}

#[cfg(test)]
mod tests;
