//! Compact sets of internal worker ids, one per tree node.
//!
//! Invariant: the representation is canonical — ids below 64 only ⇒ `Inline`; otherwise `Spilled`
//! with at least two words and a non-zero last word — so derived equality is set equality.

use super::ALLOC_OVERHEAD;

/// A set of worker ids as a bitset: one inline word for ids < 64 (no allocation), a boxed word
/// slice beyond that.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WorkerSet {
    Inline(u64),
    Spilled(Box<[u64]>),
}

impl Default for WorkerSet {
    fn default() -> Self {
        WorkerSet::Inline(0)
    }
}

impl WorkerSet {
    /// The set `{id}`.
    pub fn single(id: u32) -> Self {
        let mut set = WorkerSet::default();
        set.insert(id);
        set
    }

    /// Builds the canonical set from words (trailing zero words are dropped).
    pub fn from_words(mut words: Vec<u64>) -> Self {
        while words.last() == Some(&0) {
            words.pop();
        }
        match words.len() {
            0 => WorkerSet::Inline(0),
            1 => WorkerSet::Inline(words.first().copied().unwrap_or(0)),
            _ => WorkerSet::Spilled(words.into_boxed_slice()),
        }
    }

    pub fn words(&self) -> &[u64] {
        match self {
            WorkerSet::Inline(w) => std::slice::from_ref(w),
            WorkerSet::Spilled(b) => b,
        }
    }

    pub fn contains(&self, id: u32) -> bool {
        let (word, bit) = (id as usize / 64, id % 64);
        self.words().get(word).is_some_and(|w| (w >> bit) & 1 == 1)
    }

    pub fn insert(&mut self, id: u32) {
        let (word, bit) = (id as usize / 64, id % 64);
        match self {
            WorkerSet::Inline(w) if word == 0 => *w |= 1 << bit,
            WorkerSet::Spilled(b) if word < b.len() => {
                if let Some(w) = b.get_mut(word) {
                    *w |= 1 << bit;
                }
            }
            _ => {
                let mut words = self.words().to_vec();
                words.resize(word + 1, 0);
                if let Some(w) = words.get_mut(word) {
                    *w |= 1 << bit;
                }
                *self = WorkerSet::from_words(words);
            }
        }
    }

    pub fn remove(&mut self, id: u32) {
        let (word, bit) = (id as usize / 64, id % 64);
        match self {
            WorkerSet::Inline(w) => {
                if word == 0 {
                    *w &= !(1 << bit);
                }
            }
            WorkerSet::Spilled(b) => {
                if let Some(w) = b.get_mut(word) {
                    *w &= !(1 << bit);
                }
                if b.last() == Some(&0) {
                    *self = WorkerSet::from_words(b.to_vec());
                }
            }
        }
    }

    /// True when the set is exactly `{id}`.
    pub fn is_only(&self, id: u32) -> bool {
        match self {
            WorkerSet::Inline(w) => id < 64 && *w == 1 << id,
            // Canonical form: a spilled set holds some id >= 64, so it has one element only
            // if that element is `id` and every other word is zero.
            WorkerSet::Spilled(b) => {
                let word = id as usize / 64;
                b.iter()
                    .enumerate()
                    .all(|(i, &x)| x == if i == word { 1 << (id % 64) } else { 0 })
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        matches!(self, WorkerSet::Inline(0))
    }

    pub fn len(&self) -> usize {
        self.words().iter().map(|w| w.count_ones() as usize).sum()
    }

    /// True when every id of `self` is in `other`.
    pub fn is_subset(&self, other: &WorkerSet) -> bool {
        let theirs = other.words();
        self.words()
            .iter()
            .enumerate()
            .all(|(i, w)| w & !theirs.get(i).copied().unwrap_or(0) == 0)
    }

    /// The ids in increasing order.
    pub fn iter(&self) -> Ids<'_> {
        Ids::new(self.words(), &[])
    }

    /// The ids of `self` that are not in `other`, in increasing order.
    pub fn iter_minus<'a>(&'a self, other: &'a WorkerSet) -> Ids<'a> {
        Ids::new(self.words(), other.words())
    }

    /// Bytes allocated on the heap for this set.
    pub fn heap_bytes(&self) -> usize {
        match self {
            WorkerSet::Inline(_) => 0,
            WorkerSet::Spilled(b) => b.len() * 8 + ALLOC_OVERHEAD,
        }
    }
}

/// Iterator over the set bits of `words & !minus`.
pub(crate) struct Ids<'a> {
    words: &'a [u64],
    minus: &'a [u64],
    index: usize,
    current: u64,
}

impl<'a> Ids<'a> {
    fn new(words: &'a [u64], minus: &'a [u64]) -> Self {
        let mut ids = Ids {
            words,
            minus,
            index: 0,
            current: 0,
        };
        ids.current = ids.word_at(0);
        ids
    }

    fn word_at(&self, i: usize) -> u64 {
        self.words.get(i).copied().unwrap_or(0) & !self.minus.get(i).copied().unwrap_or(0)
    }
}

impl Iterator for Ids<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        while self.current == 0 {
            self.index += 1;
            if self.index >= self.words.len() {
                return None;
            }
            self.current = self.word_at(self.index);
        }
        let bit = self.current.trailing_zeros();
        self.current &= self.current - 1;
        Some(self.index as u32 * 64 + bit)
    }
}
