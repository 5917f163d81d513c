//! Hash table from block hash to slab index: open addressing with linear probing and
//! backward-shift deletion (no tombstones), a power-of-two number of 8-byte slots, at most half
//! full.
//!
//! A slot holds the slab index and a 32-bit *tag* of the block hash (the high half of its mixed
//! hash); the slot's home is derived from the tag alone, so growing and deleting never read the
//! slab. A lookup compares tags (eight slots per cache line) and confirms a matching tag against
//! the slab entry's full hash, which the caller reads anyway to touch the block. Batch callers
//! can [`prefetch`](Table::prefetch) the line of a hash they will look up soon.
//!
//! Invariant: every stored block sits in the run of occupied slots that starts at its home slot,
//! so a lookup stops at the first empty slot.

/// Slot layout: `tag << 32 | (index + 1)`; `0` marks an empty slot, so a fresh table is all
/// zeroes (and its pages come from the OS already zeroed).
type Slot = u64;

/// The tag of a block hash: the high half of a folded 64×64→128 multiply, so structured inputs
/// (small integers, multiples of a power of two) spread over the slots as well as random ones.
#[inline]
pub(super) fn tag(h: u64) -> u32 {
    let p = u128::from(h).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (((p as u64) ^ ((p >> 64) as u64)) >> 32) as u32
}

/// Result of [`Table::probe`].
pub(super) enum Probe {
    /// The hash is stored, with this slab index.
    Found(u32),
    /// The hash is absent; this is the empty slot that ends its probe run.
    Vacant(usize),
}

#[derive(Clone, Debug, Default)]
pub(super) struct Table {
    slots: Vec<Slot>,
    pub(super) len: usize,
}

impl Table {
    #[inline]
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// Home slot of a tag: its top bits scaled to the table size.
    #[inline]
    fn home(&self, tag: u32) -> usize {
        ((u128::from(tag) * self.slots.len() as u128) >> 32) as usize
    }

    /// Slab index stored for `hash`; `is_hash(index)` confirms a candidate whose tag matches.
    #[inline]
    pub fn get(&self, hash: u64, is_hash: impl Fn(u32) -> bool) -> Option<u32> {
        match self.probe(hash, is_hash) {
            Probe::Found(index) => Some(index),
            Probe::Vacant(_) => None,
        }
    }

    /// Where `hash` is: its slab index, or the empty slot where [`fill`](Self::fill) may store
    /// it (valid until the next `insert`, `remove` or `reserve`). `is_hash(index)` confirms a
    /// candidate whose tag matches.
    #[inline]
    pub fn probe(&self, hash: u64, is_hash: impl Fn(u32) -> bool) -> Probe {
        let tag = tag(hash);
        let mask = self.mask();
        let mut i = self.home(tag);
        loop {
            let Some(&slot) = self.slots.get(i) else {
                return Probe::Vacant(usize::MAX);
            };
            if slot == 0 {
                return Probe::Vacant(i);
            }
            if (slot >> 32) as u32 == tag {
                let index = (slot as u32).wrapping_sub(1);
                if is_hash(index) {
                    return Probe::Found(index);
                }
            }
            i = (i + 1) & mask;
        }
    }

    /// Hints the CPU to load the cache line where a lookup of `hash` starts.
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        crate::mem::prefetch(self.slots.get(self.home(tag(hash))));
    }

    /// Makes room for `additional` more hashes without exceeding half-full.
    #[inline]
    pub fn reserve(&mut self, additional: usize) {
        let needed = self.len.saturating_add(additional).saturating_mul(2);
        if needed > self.slots.len() {
            self.grow(needed.max(16));
        }
    }

    #[cold]
    fn grow(&mut self, needed: usize) {
        let size = needed.checked_next_power_of_two().unwrap_or(needed);
        let old = std::mem::replace(&mut self.slots, vec![0; size]);
        crate::mem::advise_huge_pages(&self.slots);
        self.len = 0;
        for slot in old.into_iter().filter(|&s| s != 0) {
            self.place(slot);
        }
    }

    /// Puts an occupied slot value at the end of its home's run.
    #[inline]
    fn place(&mut self, slot: Slot) {
        let mask = self.mask();
        let mut i = self.home((slot >> 32) as u32);
        while let Some(s) = self.slots.get_mut(i) {
            if *s == 0 {
                *s = slot;
                self.len += 1;
                return;
            }
            i = (i + 1) & mask;
        }
    }

    /// Stores `hash → index`; `hash` must not be present.
    #[inline]
    pub fn insert(&mut self, hash: u64, index: u32) {
        self.reserve(1);
        self.place(u64::from(tag(hash)) << 32 | u64::from(index + 1));
    }

    /// Stores `hash → index` in the empty slot `at` that [`probe`](Self::probe) returned for
    /// `hash`, if room was reserved; otherwise (a stale slot) falls back to [`insert`](Self::insert).
    #[inline]
    pub fn fill(&mut self, at: usize, hash: u64, index: u32) {
        let room = (self.len + 1) * 2 <= self.slots.len();
        match self.slots.get_mut(at) {
            Some(slot) if room && *slot == 0 => {
                *slot = u64::from(tag(hash)) << 32 | u64::from(index + 1);
                self.len += 1;
            }
            _ => self.insert(hash, index),
        }
    }

    /// Removes the entry for slab index `index` (stored for `hash`), shifting later slots of its
    /// run back so no lookup stops early.
    pub fn remove(&mut self, hash: u64, index: u32) {
        let target = u64::from(tag(hash)) << 32 | u64::from(index + 1);
        let mask = self.mask();
        let mut hole = self.home(tag(hash));
        loop {
            match self.slots.get(hole) {
                Some(&s) if s == target => break,
                Some(&s) if s != 0 => hole = (hole + 1) & mask,
                _ => return,
            }
        }
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let Some(&slot) = self.slots.get(j) else {
                return;
            };
            if slot == 0 {
                break;
            }
            // `slot` may fill the hole if the hole lies between its home and `j` (cyclically).
            let home = self.home((slot >> 32) as u32);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                if let Some(h) = self.slots.get_mut(hole) {
                    *h = slot;
                }
                hole = j;
            }
        }
        if let Some(h) = self.slots.get_mut(hole) {
            *h = 0;
        }
        self.len -= 1;
    }
}
