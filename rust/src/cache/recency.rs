//! The recency order of the cache's blocks: a slab of entries addressed by `u32` index and, per
//! partition, one intrusive doubly-linked list of that partition's unpinned blocks.
//!
//! # What the structure maintains
//!
//! Every cached block has a *tick*: a value of a counter that increases by one at each touch of
//! any block, so ticks are unique and order the touches. An unpinned block is in one of three
//! places: `Listed` (in its partition's list), `Stale` (in that list too — see below) or `Parked`
//! (in no list; only a block with a cached child is ever parked). A pinned block is in no list.
//!
//! * A touch gives the block the next tick and, if it is unpinned, appends it to the tail of its
//!   partition's list (`Listed`). Unpinning a block (its last pin released) is a touch.
//! * To find a partition's victim, the list is read from its head: a head with a cached child is
//!   not evictable, so it is *parked* (unlinked) and the next head is read; the first head without
//!   a child is the partition's least recently used unpinned leaf.
//! * When a block loses its last cached child (the child was evicted) and it is `Parked`, it
//!   is linked back among the `Stale` blocks at the head of its list, in tick order (`Stale`
//!   marks such a block until its next touch).
//!
//! # Why the head is the true least recently used unpinned leaf
//!
//! Claim: for every partition list L,
//! (S1) L is sorted by tick, head oldest; and
//! (S2) every `Parked` block `n` of L's partition is older than every `Listed` block of L.
//!
//! Each operation keeps both:
//! * a touch appends the newest tick at the tail (S1), and that tick is newer than every parked
//!   block (S2); touching a parked block only removes it from the parked set;
//! * pinning and evicting only remove blocks;
//! * parking removes the head `x`, which by (S1) is older than every other block of L, so each
//!   `Listed` block stays newer than `x` (S2 for `x`); every block parked earlier was older than
//!   `x` by (S2), since `x` was `Listed` (a `Stale` block has no child, so it is never parked);
//! * re-linking a parked `n` among the `Stale` prefix at its tick position keeps (S1): by (S2)
//!   `n` is older than every `Listed` block, and the `Stale` blocks always form the head of L
//!   (they are only ever inserted there, and a touch moves one to the tail as `Listed`).
//!
//! A block gains a child only when it is touched in the same operation (the previous block of an
//! inserted chain, or the explicit parent), so a `Parked` or `Stale` block never silently becomes
//! a non-leaf, and a parked block is re-linked exactly when it becomes a leaf. Hence every
//! unpinned leaf of a partition is in its list, the list is in tick order, and reading it from
//! the head while parking non-leaves yields the partition's unpinned leaf with the smallest tick:
//! the least recently used one under the definition "recency = the last touch of the block
//! itself" — a touch of a prefix refreshes the prefix alone, and a block whose descendants are
//! all evicted competes with its own (possibly recent) tick, never an inherited one.
//!
//! Ticks are 32-bit: when the counter would overflow, the live blocks are renumbered 1, 2, … in
//! tick order (O(n log n) once per ~4 billion touches), which keeps every comparison above.
//!
//! # Cost
//!
//! A touch, pin, unpin and eviction are O(1); each parking is paid for by the touch or re-link
//! that put the block in the list. Re-linking a parked block walks the `Stale` blocks older than
//! it. Within a partition a `Stale` block is evicted before any other eviction from that list can
//! produce another one, so the walk is O(1) unless chains cross partitions (a parent owned by one
//! partition whose children are owned by others), where it is bounded by the number of such
//! blocks waiting at the head.

/// "No entry": the end of a list, the root's parent, an empty free list.
pub(super) const NIL: u32 = u32::MAX;

/// `parent` of a free slab slot (never a valid index: see `MAX_CAPACITY`).
const FREED: u32 = u32::MAX - 1;

/// `Entry::bits`: the entry is in its partition's list.
const LINKED: u32 = 1 << 31;
/// `Entry::bits`: a linked entry is among the `Stale` blocks at the head.
const STALE: u32 = 1 << 30;
/// `Entry::bits`: the number of cached children.
const CHILDREN: u32 = STALE - 1;

/// Largest number of blocks (so a child count always fits in `CHILDREN`).
pub(super) const MAX_BLOCKS: usize = CHILDREN as usize;

/// Ticks are renumbered before the counter passes this.
const TICK_LIMIT: u32 = if cfg!(test) { 64 } else { u32::MAX - 1 };

/// Where an entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// A free slab slot (its `next` links the free list).
    Free,
    /// In its partition's list, placed by its own touch.
    Listed,
    /// In its partition's list among the head blocks re-linked after losing their last child.
    Stale,
    /// Unpinned, has a cached child, in no list.
    Parked,
    /// Pinned (manually or by a lease), in no list.
    Pinned,
}

/// One cached block: 32 bytes, so an entry never straddles two cache lines.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    pub hash: u64,
    tick: u32,
    prev: u32,
    next: u32,
    parent: u32,
    /// Number of cached children (low bits) and the `LINKED`/`STALE` flags.
    bits: u32,
    /// Manual pins, plus one while a lease is held.
    pub pins: u16,
    pub part: u16,
}

impl Entry {
    #[inline]
    fn children(&self) -> u32 {
        self.bits & CHILDREN
    }

    #[inline]
    fn place(&self) -> Place {
        if self.bits & LINKED != 0 {
            if self.bits & STALE != 0 {
                Place::Stale
            } else {
                Place::Listed
            }
        } else if self.parent == FREED {
            Place::Free
        } else if self.pins > 0 {
            Place::Pinned
        } else {
            Place::Parked
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Ends {
    head: u32,
    tail: u32,
}

const EMPTY: Ends = Ends {
    head: NIL,
    tail: NIL,
};

/// Slab of entries plus the per-partition recency lists.
#[derive(Clone, Debug)]
pub(super) struct Recency {
    entries: Vec<Entry>,
    free: u32,
    lists: Vec<Ends>,
    clock: u32,
    /// How many times the ticks were renumbered (a tick is comparable only within one epoch).
    epoch: u32,
    /// Blocks touched at or after this tick are not victims (the running insert's own).
    protect_from: u32,
    /// Idle tracking: the time of each entry's last touch (indexed like `entries`), kept only
    /// while `timed`; `now` is the time given to touches.
    times: Vec<f64>,
    timed: bool,
    now: f64,
}

impl Recency {
    pub fn new(partitions: usize) -> Self {
        Recency {
            entries: Vec::new(),
            free: NIL,
            lists: vec![EMPTY; partitions],
            clock: 0,
            epoch: 0,
            protect_from: u32::MAX,
            times: Vec::new(),
            timed: false,
            now: f64::NEG_INFINITY,
        }
    }

    /// Starts recording each block's last-touch time; blocks already cached count as touched
    /// at the current time.
    pub fn track_times(&mut self) {
        if !self.timed {
            self.timed = true;
            let now = self.now;
            self.times = vec![now; self.entries.len()];
        }
    }

    /// Whether last-touch times are recorded.
    pub fn tracks_times(&self) -> bool {
        self.timed
    }

    /// Sets the time given to later touches: the largest `now` seen so far (so times never
    /// decrease along the tick order).
    #[inline]
    pub fn advance(&mut self, now: f64) {
        if now > self.now {
            self.now = now;
        }
    }

    /// The current time (the largest `now` seen; `-inf` before any).
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Last-touch time of block `i` (only while times are tracked).
    #[inline]
    pub fn time(&self, i: u32) -> Option<f64> {
        self.times.get(i as usize).copied()
    }

    #[inline]
    fn stamp(&mut self, i: u32) {
        if self.timed {
            let now = self.now;
            match self.times.get_mut(i as usize) {
                Some(t) => *t = now,
                None => {
                    self.times.resize(i as usize + 1, now);
                }
            }
        }
    }

    /// Adds the recency list of a new partition (numbered after the existing ones).
    pub fn add_list(&mut self) {
        self.lists.push(EMPTY);
    }

    /// Number of cached children of block `i`.
    pub fn children(&self, i: u32) -> u32 {
        self.entries.get(i as usize).map_or(0, |e| e.children())
    }

    /// The slab index of block `i`'s parent (`NIL` for a root).
    pub fn parent(&self, i: u32) -> u32 {
        self.entries.get(i as usize).map_or(NIL, |e| e.parent)
    }

    /// From now until [`unprotect`](Self::unprotect), blocks touched are not victims.
    pub fn protect_from_now(&mut self) {
        self.protect_from = self.clock + 1;
    }

    /// Ends [`protect_from_now`](Self::protect_from_now).
    pub fn unprotect(&mut self) {
        self.protect_from = u32::MAX;
    }

    #[inline]
    pub fn get(&self, i: u32) -> Option<&Entry> {
        self.entries.get(i as usize)
    }

    #[inline]
    pub fn get_mut(&mut self, i: u32) -> Option<&mut Entry> {
        self.entries.get_mut(i as usize)
    }

    /// Appends the slab index of every cached block to `out`, least recently touched first.
    pub fn live_by_tick(&self, out: &mut Vec<u32>) {
        let start = out.len();
        out.extend(
            (0u32..)
                .zip(&self.entries)
                .filter(|(_, e)| e.place() != Place::Free)
                .map(|(i, _)| i),
        );
        if let Some(live) = out.get_mut(start..) {
            let entries = &self.entries;
            live.sort_unstable_by_key(|&i| entries.get(i as usize).map_or(0, |e| e.tick));
        }
    }

    /// Makes room in the slab for `additional` more entries.
    pub fn reserve(&mut self, additional: usize) {
        let before = self.entries.capacity();
        self.entries.reserve(additional);
        if self.entries.capacity() != before {
            crate::mem::advise_huge_pages(&self.entries);
            crate::mem::advise_huge_pages(self.entries.spare_capacity_mut());
        }
    }

    /// The next tick, renumbering first if the counter is about to overflow.
    #[inline]
    fn tick(&mut self) -> u32 {
        if self.clock >= TICK_LIMIT {
            self.renumber();
        }
        self.clock += 1;
        self.clock
    }

    /// Renumbers the live blocks' ticks 1, 2, … in their order, and `protect_from` with them.
    #[cold]
    fn renumber(&mut self) {
        let mut live: Vec<(u32, u32)> = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.parent != FREED)
            .map(|(i, e)| (e.tick, i as u32))
            .collect();
        live.sort_unstable();
        let protected = live.partition_point(|&(tick, _)| tick < self.protect_from);
        for (rank, &(_, i)) in live.iter().enumerate() {
            if let Some(e) = self.entries.get_mut(i as usize) {
                e.tick = rank as u32 + 1;
            }
        }
        if self.protect_from != u32::MAX {
            self.protect_from = protected as u32 + 1;
        }
        self.clock = live.len() as u32;
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// `(epoch, last tick given)`: ticks compare only within one epoch.
    pub fn clock(&self) -> (u32, u32) {
        (self.epoch, self.clock)
    }

    /// The tick of block `i`'s last touch.
    pub fn tick_of(&self, i: u32) -> Option<u32> {
        self.get(i).map(|e| e.tick)
    }

    /// Adds an unpinned block owned by `part`, child of `parent` (or `NIL`), as the most recent
    /// block of its list. Returns its index.
    #[inline]
    pub fn add(&mut self, hash: u64, parent: u32, part: u16) -> u32 {
        let tick = self.tick();
        let tail = self.lists.get(part as usize).map_or(NIL, |l| l.tail);
        let entry = Entry {
            hash,
            tick,
            prev: tail,
            next: NIL,
            parent,
            bits: LINKED,
            pins: 0,
            part,
        };
        let i = match self.entries.get_mut(self.free as usize) {
            Some(slot) => {
                let i = self.free;
                self.free = slot.next;
                *slot = entry;
                i
            }
            None => {
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        if let Some(ends) = self.lists.get_mut(part as usize) {
            if tail == NIL {
                ends.head = i;
            }
            ends.tail = i;
        }
        if let Some(t) = self.entries.get_mut(tail as usize) {
            t.next = i;
        }
        if let Some(p) = self.entries.get_mut(parent as usize) {
            p.bits += 1;
        }
        self.stamp(i);
        i
    }

    /// Removes block `i` (an unpinned leaf) and frees its slot; its parent, if it was parked and
    /// this was its last child, is re-linked as `Stale`. Returns the block's hash and partition.
    pub fn remove(&mut self, i: u32) -> (u64, u16) {
        self.unlink(i);
        let Some(e) = self.entries.get_mut(i as usize) else {
            return (0, 0);
        };
        let (hash, part, parent) = (e.hash, e.part, e.parent);
        e.parent = FREED;
        e.next = self.free;
        self.free = i;
        if let Some(p) = self.entries.get_mut(parent as usize) {
            if p.children() > 0 {
                p.bits -= 1;
            }
            if p.children() == 0 && p.place() == Place::Parked {
                self.link_stale(parent);
            }
        }
        (hash, part)
    }

    /// Gives block `i` the next tick; if unpinned, it becomes the most recent block of its list.
    #[inline]
    pub fn touch(&mut self, i: u32) {
        let tick = self.tick();
        let Some(e) = self.entries.get_mut(i as usize) else {
            return;
        };
        e.tick = tick;
        let (part, place) = (e.part, e.place());
        let pinned = e.pins > 0;
        self.stamp(i);
        if pinned {
            self.hold(i);
            return;
        }
        if place == Place::Listed && self.lists.get(part as usize).is_some_and(|l| l.tail == i) {
            return;
        }
        self.unlink(i);
        self.push_back(i, part);
    }

    /// Moves block `i` to partition `part` and touches it.
    pub fn claim(&mut self, i: u32, part: u16) {
        self.unlink(i);
        if let Some(e) = self.entries.get_mut(i as usize) {
            e.part = part;
        }
        self.touch(i);
    }

    /// Takes block `i` out of the recency order once it has a pin.
    #[inline]
    pub fn hold(&mut self, i: u32) {
        self.unlink(i);
    }

    /// Hash of the block at the head of `part`'s list (the next eviction candidate).
    #[inline]
    pub fn head_hash(&self, part: u16) -> Option<u64> {
        let head = self.lists.get(part as usize)?.head;
        self.entries.get(head as usize).map(|e| e.hash)
    }

    /// Partition `part`'s least recently used unpinned leaf that the running operation has not
    /// touched (see [`protect_from_now`](Self::protect_from_now)). Non-leaves met at the head are
    /// parked on the way. Returns `(tick, index)`.
    pub fn victim(&mut self, part: u16) -> Option<(u32, u32)> {
        loop {
            let i = self.lists.get(part as usize)?.head;
            let e = self.entries.get(i as usize)?;
            if e.children() == 0 {
                return (e.tick < self.protect_from).then_some((e.tick, i));
            }
            self.unlink(i);
        }
    }

    /// Unlinks block `i` if it is in a list (it becomes `Parked`, or `Pinned` if it has a pin).
    #[inline]
    fn unlink(&mut self, i: u32) {
        let Some(&e) = self.entries.get(i as usize) else {
            return;
        };
        if e.bits & LINKED == 0 {
            return;
        }
        let Some(ends) = self.lists.get_mut(e.part as usize) else {
            return;
        };
        match self.entries.get_mut(e.prev as usize) {
            Some(p) => p.next = e.next,
            None => ends.head = e.next,
        }
        match self.entries.get_mut(e.next as usize) {
            Some(n) => n.prev = e.prev,
            None => ends.tail = e.prev,
        }
        if let Some(e) = self.entries.get_mut(i as usize) {
            e.prev = NIL;
            e.next = NIL;
            e.bits &= CHILDREN;
        }
    }

    /// Links the unlinked block `i` at the tail of `part`'s list.
    #[inline]
    fn push_back(&mut self, i: u32, part: u16) {
        let Some(ends) = self.lists.get_mut(part as usize) else {
            return;
        };
        let tail = ends.tail;
        ends.tail = i;
        match self.entries.get_mut(tail as usize) {
            Some(t) => t.next = i,
            None => ends.head = i,
        }
        if let Some(e) = self.entries.get_mut(i as usize) {
            e.prev = tail;
            e.next = NIL;
            e.bits = (e.bits & CHILDREN) | LINKED;
        }
    }

    /// Links the parked block `i` among the `Stale` blocks at the head of its list, by tick.
    fn link_stale(&mut self, i: u32) {
        let Some(&e) = self.entries.get(i as usize) else {
            return;
        };
        let Some(ends) = self.lists.get(e.part as usize) else {
            return;
        };
        let mut before = ends.head;
        while let Some(b) = self.entries.get(before as usize) {
            if b.place() != Place::Stale || b.tick > e.tick {
                break;
            }
            before = b.next;
        }
        let Some(b) = self.entries.get_mut(before as usize) else {
            self.push_back(i, e.part);
            if let Some(e) = self.entries.get_mut(i as usize) {
                e.bits |= STALE;
            }
            return;
        };
        let after = b.prev;
        b.prev = i;
        match self.entries.get_mut(after as usize) {
            Some(a) => a.next = i,
            None => {
                if let Some(ends) = self.lists.get_mut(e.part as usize) {
                    ends.head = i;
                }
            }
        }
        if let Some(e) = self.entries.get_mut(i as usize) {
            e.prev = after;
            e.next = before;
            e.bits = (e.bits & CHILDREN) | LINKED | STALE;
        }
    }
}
