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
        self.expire(now)?;
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
        self.expire(now)?;
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

    /// The cache's clock: the largest `now` passed so far (`-inf` before any).
    pub fn clock(&self) -> f64 {
        self.order.now()
    }

    /// When block `hash` was last touched (with [`track_idle`](Self::track_idle) on).
    pub fn last_touch(&self, hash: u64) -> Option<f64> {
        self.order.time(self.find(hash)?)
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
mod tests {
    //! The cache against a naive model of the documented semantics (O(n) per step), driven by a
    //! seeded generator, plus targeted cases.

    use super::*;
    use std::collections::HashMap as StdMap;

    #[derive(Clone, Debug)]
    struct NaiveBlock {
        parent: Option<u64>,
        part: u16,
        tick: u64,
        pins: u32,
        lease: Option<(f64, u64)>,
    }

    /// Straight transcription of the module documentation.
    struct Naive {
        capacity: usize,
        reserved: Vec<usize>,
        blocks: StdMap<u64, NaiveBlock>,
        clock: u64,
        lease_seq: u64,
    }

    impl Naive {
        fn usage(&self, q: u16) -> usize {
            self.blocks.values().filter(|b| b.part == q).count()
        }

        fn touch(&mut self, h: u64) {
            self.clock += 1;
            let tick = self.clock;
            self.blocks.get_mut(&h).unwrap().tick = tick;
        }

        fn sweep(&mut self, now: f64) {
            loop {
                let due = self
                    .blocks
                    .iter()
                    .filter_map(|(&h, b)| b.lease.map(|(end, seq)| (end, seq, h)))
                    .filter(|&(end, _, _)| end <= now)
                    .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                let Some((_, _, h)) = due else { return };
                let b = self.blocks.get_mut(&h).unwrap();
                b.lease = None;
                if b.pins == 0 {
                    self.touch(h);
                }
            }
        }

        fn evictable(&self, h: u64, protect_from: u64) -> bool {
            let b = &self.blocks[&h];
            b.pins == 0
                && b.lease.is_none()
                && b.tick < protect_from
                && !self.blocks.values().any(|c| c.parent == Some(h))
        }

        fn victim(&self, part: u16, protect_from: u64) -> Option<u64> {
            let oldest = |pred: &dyn Fn(u16) -> bool| {
                self.blocks
                    .iter()
                    .filter(|(&h, b)| pred(b.part) && self.evictable(h, protect_from))
                    .min_by_key(|(_, b)| b.tick)
                    .map(|(&h, _)| h)
            };
            let over = |q: u16| self.usage(q) > self.reserved[q as usize];
            let borrowed = oldest(&|q| q != part && over(q));
            if self.usage(part) < self.reserved[part as usize] && borrowed.is_some() {
                return borrowed;
            }
            oldest(&|q| q == part || over(q))
        }

        fn insert(
            &mut self,
            hashes: &[u64],
            part: u16,
            parent: Option<u64>,
            now: f64,
        ) -> Option<(usize, Vec<u64>)> {
            if parent.is_some_and(|p| !self.blocks.contains_key(&p)) {
                return None;
            }
            self.sweep(now);
            let protect_from = self.clock + 1;
            if let Some(p) = parent {
                self.touch(p);
            }
            let mut prev = parent;
            let mut evicted = Vec::new();
            for (k, &h) in hashes.iter().enumerate() {
                if let Some(b) = self.blocks.get_mut(&h) {
                    if part != 0 {
                        b.part = part;
                    }
                    self.touch(h);
                    prev = Some(h);
                    continue;
                }
                if self.blocks.len() >= self.capacity {
                    match self.victim(part, protect_from) {
                        Some(v) => {
                            self.blocks.remove(&v);
                            evicted.push(v);
                        }
                        None => return Some((k, evicted)),
                    }
                }
                let block = NaiveBlock {
                    parent: prev,
                    part,
                    tick: 0,
                    pins: 0,
                    lease: None,
                };
                self.blocks.insert(h, block);
                self.touch(h);
                prev = Some(h);
            }
            Some((hashes.len(), evicted))
        }

        fn match_prefix(&mut self, hashes: &[u64]) -> usize {
            for (k, &h) in hashes.iter().enumerate() {
                if !self.blocks.contains_key(&h) {
                    return k;
                }
                self.touch(h);
            }
            hashes.len()
        }

        fn pin(&mut self, hashes: &[u64], now: f64) -> bool {
            if hashes.iter().any(|h| !self.blocks.contains_key(h)) {
                return false;
            }
            self.sweep(now);
            for h in hashes {
                self.blocks.get_mut(h).unwrap().pins += 1;
            }
            true
        }

        fn lease(&mut self, hashes: &[u64], ttl: f64, now: f64) -> bool {
            if hashes.iter().any(|h| !self.blocks.contains_key(h)) {
                return false;
            }
            self.sweep(now);
            for h in hashes {
                let b = self.blocks.get_mut(h).unwrap();
                if b.lease.is_none_or(|(end, _)| end < now + ttl) {
                    self.lease_seq += 1;
                    b.lease = Some((now + ttl, self.lease_seq));
                }
            }
            true
        }

        fn unpin(&mut self, hashes: &[u64], now: f64) -> bool {
            let mut left: StdMap<u64, u32> = StdMap::new();
            for h in hashes {
                let Some(b) = self.blocks.get(h) else {
                    return false;
                };
                let n = left.entry(*h).or_insert(b.pins);
                if *n == 0 {
                    return false;
                }
                *n -= 1;
            }
            self.sweep(now);
            for &h in hashes {
                let b = self.blocks.get_mut(&h).unwrap();
                b.pins -= 1;
                if b.pins == 0 && b.lease.is_none() {
                    self.touch(h);
                }
            }
            true
        }
    }

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    fn check_same(cache: &BlockCache, naive: &Naive, universe: u64, parts: u16) {
        assert_eq!(cache.len(), naive.blocks.len());
        assert!(cache.len() <= cache.capacity());
        for h in 0..universe {
            let b = naive.blocks.get(&h);
            assert_eq!(cache.contains(h), b.is_some(), "block {h}");
            assert_eq!(cache.pins(h), b.map(|b| b.pins), "pins of {h}");
            assert_eq!(cache.lease_end(h), b.and_then(|b| b.lease.map(|l| l.0)));
            if let Some(p) = b.and_then(|b| b.parent) {
                assert!(naive.blocks.contains_key(&p), "parent of {h} evicted");
            }
        }
        for q in 0..parts {
            assert_eq!(cache.usage(PartitionId(q)), naive.usage(q), "usage of {q}");
        }
    }

    /// A chain: either a random walk down the cached forest, extended by fresh blocks, or a
    /// random sequence over the universe (duplicates, re-parenting attempts and all).
    fn chain(rng: &mut Rng, naive: &Naive, universe: u64) -> Vec<u64> {
        let len = 1 + rng.below(6) as usize;
        if rng.below(3) == 0 {
            return (0..len).map(|_| rng.below(universe)).collect();
        }
        let mut out: Vec<u64> = Vec::new();
        let mut parent: Option<u64> = None;
        while out.len() < len {
            let kids: Vec<u64> = naive
                .blocks
                .iter()
                .filter(|(_, b)| b.parent == parent)
                .map(|(&h, _)| h)
                .collect();
            let next = if !kids.is_empty() && rng.below(3) > 0 {
                let mut kids = kids;
                kids.sort_unstable();
                kids[rng.below(kids.len() as u64) as usize]
            } else {
                rng.below(universe)
            };
            out.push(next);
            parent = Some(next);
        }
        out
    }

    fn run(seed: u64, steps: usize) {
        let mut rng = Rng(seed | 1);
        let universe = 24 + rng.below(40);
        let capacity = rng.below(14) as usize;
        let parts = rng.below(4) as usize;
        let mut left = capacity;
        let reserved: Vec<(String, usize)> = (0..parts)
            .map(|q| {
                let r = rng.below(left as u64 / 2 + 1) as usize;
                left -= r;
                (format!("p{q}"), r)
            })
            .collect();
        let mut cache = BlockCache::with_reserved(capacity, &reserved).unwrap();
        let mut naive = Naive {
            capacity,
            reserved: std::iter::once(0)
                .chain(reserved.iter().map(|r| r.1))
                .collect(),
            blocks: StdMap::new(),
            clock: 0,
            lease_seq: 0,
        };
        let mut now = 0.0;
        let mut evicted = Vec::new();
        for _ in 0..steps {
            if rng.below(4) == 0 {
                now += rng.below(3) as f64;
            }
            let hashes = chain(&mut rng, &naive, universe);
            let part = rng.below(parts as u64 + 1) as u16;
            match rng.below(10) {
                0..=3 => {
                    let parent = (rng.below(4) == 0).then(|| rng.below(universe));
                    evicted.clear();
                    let got = cache
                        .insert_into(&hashes, PartitionId(part), parent, now, &mut evicted)
                        .ok()
                        .map(|n| (n, evicted.clone()));
                    assert_eq!(got, naive.insert(&hashes, part, parent, now));
                }
                4 | 5 => assert_eq!(cache.match_prefix(&hashes), naive.match_prefix(&hashes)),
                6 => assert_eq!(cache.pin(&hashes, now).is_ok(), naive.pin(&hashes, now)),
                7 => {
                    let ttl = rng.below(4) as f64;
                    let ok = cache.lease(&hashes, ttl, now).is_ok();
                    assert_eq!(ok, naive.lease(&hashes, ttl, now));
                }
                _ => {
                    // Unpin something that is likely pinned: a prefix of a pinned block's chain.
                    let pinned: Vec<u64> = {
                        let mut v: Vec<u64> = naive
                            .blocks
                            .iter()
                            .filter(|(_, b)| b.pins > 0)
                            .map(|(&h, _)| h)
                            .collect();
                        v.sort_unstable();
                        v
                    };
                    let hashes = if pinned.is_empty() || rng.below(4) == 0 {
                        hashes
                    } else {
                        let k = 1 + rng.below(pinned.len() as u64) as usize;
                        pinned[..k].to_vec()
                    };
                    assert_eq!(cache.unpin(&hashes, now).is_ok(), naive.unpin(&hashes, now));
                }
            }
            check_same(&cache, &naive, universe, parts as u16 + 1);
        }
    }

    #[test]
    fn agrees_with_the_naive_model() {
        for seed in 1..400u64 {
            run(seed.wrapping_mul(0x2545_F491_4F6C_DD1D), 300);
        }
    }

    #[test]
    fn leaves_go_before_their_prefix_and_lru_among_leaves() {
        let mut c = BlockCache::new(4).unwrap();
        let s = PartitionId::SHARED;
        assert_eq!(c.insert(&[1, 2, 3], s, None, 0.0).unwrap(), (3, vec![]));
        assert_eq!(c.insert(&[9], s, None, 0.0).unwrap(), (1, vec![]));
        // 1 is the oldest block but has a child: the oldest leaf is 3.
        assert_eq!(c.insert(&[10], s, None, 0.0).unwrap(), (1, vec![3]));
        // A touch of the prefix alone refreshes it, not its descendants.
        assert_eq!(c.match_prefix(&[1]), 1);
        // 2 is now a leaf, older than 9 and 10; then 9, then 10; 1 was refreshed last of all.
        assert_eq!(
            c.insert(&[20, 21, 22], s, None, 0.0).unwrap(),
            (3, vec![2, 9, 10])
        );
        assert_eq!(c.insert(&[30], s, None, 0.0).unwrap(), (1, vec![1]));
    }

    #[test]
    fn a_chain_never_evicts_itself_and_pins_hold() {
        let mut c = BlockCache::new(3).unwrap();
        let s = PartitionId::SHARED;
        assert_eq!(
            c.insert(&[1, 2, 3, 4, 5], s, None, 0.0).unwrap(),
            (3, vec![])
        );
        c.pin(&[1, 2, 3], 0.0).unwrap();
        assert_eq!(c.insert(&[7], s, None, 0.0).unwrap(), (0, vec![]));
        c.unpin(&[3], 0.0).unwrap();
        assert_eq!(c.insert(&[7], s, None, 0.0).unwrap(), (1, vec![3]));
        assert!(c.unpin(&[3], 0.0).is_err());
        // A failing unpin changes nothing: 1 keeps its pin although it is listed first.
        assert!(c.unpin(&[1, 1], 0.0).is_err());
        assert_eq!(c.pins(1), Some(1));
    }

    #[test]
    fn reservations_are_only_evicted_by_their_owner() {
        let mut c = BlockCache::with_reserved(4, &[("e", 2)]).unwrap();
        let e = c.partition("e").unwrap();
        let s = PartitionId::SHARED;
        assert!(c.partition("nope").is_err());
        c.insert(&[1], e, None, 0.0).unwrap();
        for h in [10, 11, 12] {
            c.insert(&[h], s, None, 0.0).unwrap();
        }
        // The shared pool borrowed e's unused slot; e takes it back from the borrower, although
        // its own block 1 is older.
        assert_eq!(c.insert(&[2], e, None, 0.0).unwrap(), (1, vec![10]));
        // Shared inserts cannot touch e's reserved blocks, however old.
        assert_eq!(c.insert(&[13], s, None, 0.0).unwrap(), (1, vec![11]));
        // e at its reservation competes by LRU with the borrowers: its own 1 is the oldest.
        assert_eq!(c.insert(&[3], e, None, 0.0).unwrap(), (1, vec![1]));
        // e inserts the shared block 12: e claims it and goes over its reservation ...
        assert_eq!(c.insert(&[12], e, None, 0.0).unwrap(), (1, vec![]));
        assert_eq!((c.usage(e), c.usage(s)), (3, 1));
        // ... so its least recently used block is fair game for the shared pool.
        assert_eq!(c.insert(&[14], s, None, 0.0).unwrap(), (1, vec![2]));
        assert_eq!((c.usage(e), c.usage(s)), (2, 2));
        assert!(BlockCache::with_reserved(3, &[("a", 2), ("b", 2)]).is_err());
    }

    #[test]
    fn limits_are_errors_that_change_nothing() {
        assert!(BlockCache::new(MAX_CAPACITY).is_ok());
        assert!(BlockCache::new(MAX_CAPACITY + 1).is_err());
        let mut c = BlockCache::new(2).unwrap();
        c.insert(&[1, 2], PartitionId::SHARED, None, 0.0).unwrap();
        c.pin(&vec![1; usize::from(u16::MAX) - 1], 0.0).unwrap();
        c.lease(&[1], 5.0, 0.0).unwrap();
        // 1 now holds 65 535 references counting its lease: another pin fails, changing nothing.
        assert!(c.pin(&[2, 1], 0.0).is_err());
        assert_eq!((c.pins(1), c.pins(2)), (Some(65_534), Some(0)));
        c.unpin(&vec![1; 65_534], 0.0).unwrap();
        assert!(c.lease(&[2], 1.0, 0.0).is_ok() && c.pin(&[1], 0.0).is_ok());
    }

    #[test]
    fn leases_end_lazily_in_end_order() {
        let mut c = BlockCache::new(2).unwrap();
        let s = PartitionId::SHARED;
        c.insert(&[1], s, None, 0.0).unwrap();
        c.insert(&[2], s, None, 0.0).unwrap();
        c.lease(&[2], 5.0, 0.0).unwrap();
        c.lease(&[1], 3.0, 0.0).unwrap();
        assert_eq!(c.insert(&[3], s, None, 2.0).unwrap(), (0, vec![]));
        assert!(c.unpin(&[1], 2.0).is_err());
        // At t=6 both end: 1 (ended at 3) is released first, so it is older than 2.
        assert_eq!(c.insert(&[3], s, None, 6.0).unwrap(), (1, vec![1]));
        assert_eq!(c.leases(), 0);
        assert!(c.lease(&[2], f64::NAN, 0.0).is_err());
        assert!(c.insert(&[4], s, None, f64::INFINITY).is_err());
    }

    #[test]
    fn idle_blocks_expire_leaves_first() {
        let s = PartitionId::SHARED;
        let mut c = BlockCache::new(100).unwrap();
        let mut out = Vec::new();
        assert!(c.expire_idle_into(0.0, 1.0, &mut out).is_err());
        c.track_idle();
        c.insert(&[1, 2, 3], s, None, 0.0).unwrap();
        c.insert(&[1, 2, 9], s, None, 5.0).unwrap(); // 1 and 2 refreshed at 5
        c.insert(&[7], s, None, 6.0).unwrap();
        c.pin(&[7], 6.0).unwrap();
        assert_eq!(c.last_touch(3), Some(0.0));
        assert_eq!(c.last_touch(2), Some(5.0));
        // At 10: with max_idle 5 only 3 (idle 10) goes; with 4, 9, 2, 1 (idle 5) go too; 7 is
        // pinned.
        let next = c.expire_idle_into(10.0, 5.0, &mut out).unwrap();
        assert_eq!(out, vec![3]);
        assert_eq!(next, Some(5.0));
        out.clear();
        let next = c.expire_idle_into(10.0, 4.0, &mut out).unwrap();
        assert_eq!(out, vec![9, 2, 1]);
        assert_eq!(next, None);
        assert_eq!(c.len(), 1);
        // The pin's release is a touch at the cache's clock.
        c.unpin(&[7], 10.0).unwrap();
        out.clear();
        assert_eq!(c.expire_idle_into(12.0, 3.0, &mut out).unwrap(), Some(10.0));
        assert!(out.is_empty());
        assert!(c.expire_idle_into(f64::NAN, 3.0, &mut out).is_err());
        assert!(c.expire_idle_into(1.0, -3.0, &mut out).is_err());
        // A clock that goes back stamps touches with the latest time seen.
        c.insert(&[8], s, None, 1.0).unwrap();
        assert_eq!(c.last_touch(8), Some(12.0));
    }

    #[test]
    fn a_parent_expires_once_its_last_child_is_gone() {
        let s = PartitionId::SHARED;
        let mut c = BlockCache::new(3).unwrap();
        c.track_idle();
        c.insert(&[1, 2], s, None, 0.0).unwrap();
        c.insert(&[1, 3], s, None, 10.0).unwrap(); // 1 refreshed; 2 stays old
        let mut out = Vec::new();
        assert_eq!(c.expire_idle_into(11.0, 5.0, &mut out).unwrap(), Some(10.0));
        assert_eq!(out, vec![2]);
        // Capacity eviction of 3 turns 1 into a leaf again: it is next.
        out.clear();
        c.insert(&[4, 5], s, None, 12.0).unwrap();
        assert_eq!(c.len(), 3);
        c.insert(&[6], s, None, 13.0).unwrap();
        assert!(!c.contains(1) || !c.contains(3));
    }

    #[test]
    fn partitions_can_be_added_and_resized() {
        let mut c = BlockCache::with_reserved(10, &[("a", 4)]).unwrap();
        let b = c.add_partition("b", 6).unwrap();
        assert!(c.add_partition("b", 0).is_err());
        assert!(c.add_partition("c", 1).is_err());
        assert!(c.set_reserved(b, 7).is_err());
        assert_eq!(c.reserved(b), 6);
        assert!(c.set_reserved(PartitionId::SHARED, 1).is_err());
        c.insert(&[1, 2, 3, 4, 5, 6], b, None, 0.0).unwrap();
        // b's blocks are protected from the shared pool while reserved...
        let (stored, _) = c
            .insert(&[10, 11, 12, 13, 14, 15], PartitionId::SHARED, None, 0.0)
            .unwrap();
        assert_eq!(stored, 4);
        assert_eq!(c.usage(b), 6);
        // ...and become borrowers when the reservation goes.
        c.set_reserved(b, 0).unwrap();
        let (stored, evicted) = c.insert(&[20, 21], PartitionId::SHARED, None, 1.0).unwrap();
        assert_eq!(stored, 2);
        assert_eq!(evicted, vec![6, 5]);
        assert_eq!(c.partition("b").unwrap(), b);
    }

    #[test]
    fn remove_takes_descendants_first_and_changes_nothing_on_error() {
        let s = PartitionId::SHARED;
        let mut c = BlockCache::new(10).unwrap();
        c.insert(&[1, 2, 3], s, None, 0.0).unwrap();
        c.insert(&[1, 2, 4], s, None, 0.0).unwrap();
        c.pin(&[4], 0.0).unwrap();
        let mut out = Vec::new();
        assert!(c.remove_into(&[2], &mut out).is_err());
        assert!(c.remove_into(&[3, 4, 2], &mut out).is_err());
        assert!(c.remove_into(&[2, 3], &mut out).is_err());
        assert_eq!(c.len(), 4);
        assert!(out.is_empty());
        c.unpin(&[4], 0.0).unwrap();
        assert_eq!(c.remove_into(&[3, 3, 99, 4, 2], &mut out).unwrap(), 3);
        assert_eq!(out, vec![3, 4, 2]);
        assert_eq!(c.len(), 1);
        assert_eq!(c.usage(s), 1);
        // The parent left behind is a leaf again and the first to go.
        let mut small = c.clone();
        small
            .insert(&[5, 6, 7, 8, 9, 10, 11, 12, 13], s, None, 1.0)
            .unwrap();
        let (_, evicted) = small.insert(&[14], s, None, 2.0).unwrap();
        assert_eq!(evicted, vec![1]);
    }
}
