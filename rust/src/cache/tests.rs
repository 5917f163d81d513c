//! Unit tests of [`crate::cache`]: the module root's first, then one module per source file.

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

/// `leases_due(now)` is true exactly when a call taking `now` has lease work to do first: a lease
/// (or an extended lease's earlier queued end) ending at or before `now`; false once done.
#[test]
fn leases_due_says_when_a_call_would_release_leases_first() {
    let mut c = BlockCache::new(4).unwrap();
    let s = PartitionId::SHARED;
    c.insert(&[1, 2], s, None, 0.0).unwrap();
    assert!(!c.leases_due(f64::MAX));
    c.lease(&[1], 1.0, 0.0).unwrap();
    c.lease(&[1], 3.0, 0.0).unwrap();
    c.lease(&[2], 2.0, 0.0).unwrap();
    assert!(!c.leases_due(0.5));
    // The extended lease's first end is queued: due at 1.0, though it releases nothing.
    assert!(c.leases_due(1.0));
    assert_eq!(c.expire(1.0).unwrap(), 0);
    assert!(!c.leases_due(1.5) && c.leases_due(2.0));
    c.pin(&[2], 2.0).unwrap();
    assert!(!c.leases_due(2.5) && c.leases_due(3.0));
    assert_eq!(c.expire(3.0).unwrap(), 1);
    assert!(!c.leases_due(f64::MAX));
}

#[test]
fn expire_counts_the_leases_it_releases() {
    // The simulator and the Python `BlockCache.expire` report how many leases ended: each lease
    // counts once, when `now` reaches its end, and a block whose lease ended is evictable.
    let mut c = BlockCache::new(4).unwrap();
    let s = PartitionId::SHARED;
    c.insert(&[1, 2, 3], s, None, 0.0).unwrap();
    c.lease(&[1], 1.0, 0.0).unwrap();
    c.lease(&[2], 1.0, 0.0).unwrap();
    c.lease(&[3], 4.0, 0.0).unwrap();
    assert_eq!(c.expire(0.5).unwrap(), 0);
    assert_eq!(c.expire(2.0).unwrap(), 2);
    assert_eq!(
        (c.leases(), c.lease_end(1), c.lease_end(3)),
        (1, None, Some(4.0))
    );
    assert_eq!(c.expire(3.0).unwrap(), 0);
    assert_eq!(c.expire(4.0).unwrap(), 1);
    assert_eq!(c.expire(9.0).unwrap(), 0);
    assert_eq!(c.leases(), 0);
}

#[test]
fn idle_blocks_expire_leaves_first() {
    let s = PartitionId::SHARED;
    let mut c = BlockCache::new(100).unwrap();
    let mut out = Vec::new();
    // cargo-mutants survivor (shard 4/40): `tracks_idle` is off until `track_idle`.
    assert!(!c.tracks_idle());
    assert!(c.expire_idle_into(0.0, 1.0, &mut out).is_err());
    c.track_idle();
    assert!(c.tracks_idle());
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

/// cargo-mutants survivor (shard 6/40): the clock is the largest `now` passed, and a `now` that
/// is not larger leaves it — `now > self.now` → `>=` in `Recency::advance` took an equal one,
/// which is seen only as a zero's sign: after `0.0`, a `-0.0` (smaller in IEEE 754's total order)
/// moved the clock, and the touches stamped with it, to `-0.0`.
#[test]
fn the_clock_keeps_the_largest_now_and_ignores_one_not_larger() {
    let mut c = BlockCache::new(4).unwrap();
    c.track_idle();
    assert_eq!(c.clock(), f64::NEG_INFINITY);
    c.insert(&[1], PartitionId::SHARED, None, 0.0).unwrap();
    c.insert(&[2], PartitionId::SHARED, None, -0.0).unwrap();
    c.expire(-0.0).unwrap();
    assert!(
        c.clock() == 0.0 && c.clock().is_sign_positive(),
        "{}",
        c.clock()
    );
    for h in [1, 2] {
        let t = c.last_touch(h).unwrap();
        assert!(t == 0.0 && t.is_sign_positive(), "block {h}: {t}");
    }
    c.insert(&[3], PartitionId::SHARED, None, -5.0).unwrap();
    assert_eq!((c.clock(), c.last_touch(3)), (0.0, Some(0.0)));
    c.expire(7.5).unwrap();
    assert_eq!(c.clock(), 7.5);
}

/// `table.rs`.
mod table {
    use super::super::table::*;
    use std::collections::HashMap;

    #[test]
    fn agrees_with_a_map_through_growth_wraparound_and_deletion() {
        let mut table = Table::default();
        let mut model: HashMap<u64, u32> = HashMap::new();
        // The "slab": index -> hash, so lookups can confirm tags.
        let mut slab: Vec<u64> = Vec::new();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct keys, some structured (multiples of 2^32), so runs collide and wrap.
            let key = if x.is_multiple_of(3) {
                (x % 50) << 32
            } else {
                x % 300
            };
            if let Some(index) = model.remove(&key) {
                table.remove(key, index);
            } else {
                slab.push(key);
                let index = (slab.len() - 1) as u32;
                table.insert(key, index);
                model.insert(key, index);
            }
            if slab.len().is_multiple_of(997) {
                for k in (0..300).chain((0..50).map(|k| k << 32)) {
                    let got = table.get(k, |i| slab[i as usize] == k);
                    assert_eq!(got, model.get(&k).copied(), "key {k}");
                }
            }
        }
        assert_eq!(table.len, model.len());
    }

    /// cargo-mutants survivor (shard 6/40): `Table::fill` stores into the probed slot only when
    /// room was reserved, and otherwise is `insert` (which grows the table to stay at most half
    /// full) — `(len + 1) * 2 <= slots` → `>` stored past half full without growing. A table built
    /// by `probe` + `fill`, with and without room reserved first, through removals and wrapping
    /// runs, is the table `insert` builds from the same steps (same slots), checked after each of
    /// the first 300 steps (every growth of a small table) and every 250th after.
    #[test]
    fn fill_builds_the_table_insert_builds_with_or_without_room_reserved() {
        for reserved in [0, 5, 1500] {
            let (mut by_insert, mut by_fill) = (Table::default(), Table::default());
            by_insert.reserve(reserved);
            by_fill.reserve(reserved);
            let mut slab: Vec<u64> = Vec::new();
            let mut live: Vec<(u64, u32)> = Vec::new();
            for step in 0..2500u64 {
                if step % 5 == 4 {
                    let (key, index) = live.swap_remove((step as usize * 7) % live.len());
                    by_insert.remove(key, index);
                    by_fill.remove(key, index);
                } else {
                    let key = if step % 3 == 0 { step << 40 } else { step };
                    slab.push(key);
                    let index = (slab.len() - 1) as u32;
                    by_insert.insert(key, index);
                    match by_fill.probe(key, |i| slab[i as usize] == key) {
                        Probe::Vacant(at) => by_fill.fill(at, key, index),
                        Probe::Found(i) => panic!("{key} found at {i} before it was stored"),
                    }
                    live.push((key, index));
                }
                if step < 300 || step % 250 == 0 {
                    assert_eq!(
                        format!("{by_fill:?}"),
                        format!("{by_insert:?}"),
                        "step {step}"
                    );
                }
            }
            assert_eq!(by_fill.len, live.len());
        }
    }

    /// cargo-mutants survivor (shard 7/40): `Table::home` → 0 put every entry in one run from slot
    /// 0 — every answer the same, a lookup walking the whole run. The homes spread over the table
    /// (the tag's top bits scaled to its size): in a table of 1,500 entries (4,096 slots), the
    /// empty slots where 8,000 absent hashes' probes end are most of its 2,596 empty slots (a
    /// single home gives every absent hash the one empty slot after the single run).
    #[test]
    fn absent_hashes_end_their_probes_all_over_the_table() {
        let mut table = Table::default();
        let keys: Vec<u64> = (0..1500u64)
            .map(|k| {
                if k % 2 == 0 {
                    k << 32
                } else {
                    k.wrapping_mul(0x2545_f491_4f6c_dd1d)
                }
            })
            .collect();
        for (i, &k) in keys.iter().enumerate() {
            table.insert(k, i as u32);
        }
        let mut ends = std::collections::HashSet::new();
        for k in 1_000_000..1_008_000u64 {
            match table.probe(k, |i| keys[i as usize] == k) {
                Probe::Vacant(at) => ends.insert(at),
                Probe::Found(i) => panic!("absent hash {k} found at {i}"),
            };
        }
        assert!(ends.len() > 1500, "{} distinct ends", ends.len());
        assert!(ends.iter().all(|&at| at < 4096));
    }

    /// cargo-mutants survivor (shard 2/40): the tag (which also picks the home slot) of
    /// structured hashes has balanced bits, as a uniform one would: each of the 32 bits is set in
    /// 45–55% of ~8,000 tags (combining the product's halves with `|` instead of `^` sets each
    /// in ~75%, crowding the homes into the slots whose index bits are mostly ones).
    #[test]
    fn tags_of_structured_hashes_have_balanced_bits() {
        let tags: Vec<u32> = (0..4096u64)
            .chain((1..4096u64).map(|k| k << 32))
            .map(tag)
            .collect();
        for bit in 0..32 {
            let ones = tags.iter().filter(|&&t| t >> bit & 1 == 1).count();
            let share = ones as f64 / tags.len() as f64;
            assert!((0.45..=0.55).contains(&share), "bit {bit}: {share}");
        }
    }

    /// cargo-mutants survivor (shard 4/40): the tag folds in the product's high half. Hashes
    /// `j * C⁻¹ (mod 2⁶⁴)` (C the multiplier) have products whose low halves are just `j`, so a
    /// tag made of the low half alone gives 4,095 of them one tag; folded, they are all distinct
    /// (32-bit tags of 4,095 hashes: a shared one is a one-in-~500 event).
    #[test]
    fn tags_depend_on_the_high_half_of_the_product() {
        const C: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut inverse = C; // Newton's iteration: each step doubles the correct low bits.
        for _ in 0..6 {
            inverse = inverse.wrapping_mul(2u64.wrapping_sub(C.wrapping_mul(inverse)));
        }
        assert_eq!(C.wrapping_mul(inverse), 1);
        let tags: std::collections::HashSet<u32> =
            (1..4096u64).map(|j| tag(j.wrapping_mul(inverse))).collect();
        assert_eq!(tags.len(), 4095);
    }

    /// The module's promise: structured hashes (small integers, multiples of a power of two)
    /// get distinct tags, so a lookup confirms about one candidate against the slab, however
    /// full the table — not every block of a long run.
    #[test]
    fn structured_hashes_cost_one_slab_read_per_lookup() {
        let keys: Vec<u64> = (0..4096u64)
            .chain((1..4096u64).map(|k| k << 32))
            .chain((1..1024u64).map(|k| k << 52))
            .collect();
        let mut table = Table::default();
        for (i, &k) in keys.iter().enumerate() {
            table.insert(k, i as u32);
        }
        let reads = std::cell::Cell::new(0usize);
        for (i, &k) in keys.iter().enumerate() {
            let got = table.get(k, |j| {
                reads.set(reads.get() + 1);
                keys[j as usize] == k
            });
            assert_eq!(got, Some(i as u32));
        }
        // 32-bit tags of ~9,200 keys: a shared tag is a one-in-~100 event per run.
        assert!(reads.get() <= keys.len() + 8, "{} reads", reads.get());
    }
}

/// The documented order of a call that takes `now`: ended leases are released first (a block
/// left with no pin is touched at `now`), then the call's own work. Pinning a block whose lease
/// ended releases the lease (a touch) before adding the pin.
#[test]
fn leases_end_before_a_pin_or_unpin_does_its_work() {
    let mut c = BlockCache::new(4).unwrap();
    c.track_idle();
    c.insert(&[1], PartitionId::SHARED, None, 0.0).unwrap();
    c.lease(&[1], 1.0, 0.0).unwrap();
    c.pin(&[1], 5.0).unwrap();
    assert_eq!(c.last_touch(1), Some(5.0));
    assert_eq!(c.pins(1), Some(1));
    c.lease(&[1], 1.0, 5.0).unwrap();
    c.unpin(&[1], 7.0).unwrap();
    assert_eq!(c.last_touch(1), Some(7.0));
    assert_eq!(c.pins(1), Some(0));
}

mod touch_mark {
    use super::super::*;

    #[test]
    fn touches_after_a_mark_are_seen_until_the_ticks_are_renumbered() {
        let mut c = BlockCache::new(8).unwrap();
        let none: &mut Vec<u64> = &mut Vec::new();
        c.insert_into(&[1, 2], PartitionId::SHARED, None, 0.0, none)
            .unwrap();
        let mark = c.touch_mark();
        assert_eq!(c.touched_since(2, mark), Some(false));
        assert_eq!(c.touched_since(9, mark), None);
        c.insert_into(&[1], PartitionId::SHARED, None, 0.0, none)
            .unwrap();
        assert_eq!(c.touched_since(1, mark), Some(true));
        assert_eq!(c.touched_since(2, mark), Some(false));
        // Tests renumber after 64 ticks: the mark can no longer tell.
        for _ in 0..70 {
            c.insert_into(&[1], PartitionId::SHARED, None, 0.0, none)
                .unwrap();
        }
        assert_eq!(c.touched_since(2, mark), None);
    }
}

/// cargo-mutants survivor (shard 10/40): after an eviction `insert_into` probes the table again
/// for the hash it stores (the eviction shifted later slots of a run back); `e.hash == h` → `!=`
/// in that probe's check took a resident hash with the same 32-bit tag for the new one, so the new
/// hash went to the slot found before the eviction, past the hole the eviction left: stored, then
/// never found. No test had two resident hashes sharing a tag. For the class — every probe
/// meeting a tag twin (lookups, the inserts before and after an eviction, removal) — hashes `a`
/// and `b` with one tag and `v` with the same home in any table of up to 2^16 slots, inserted in
/// each order into caches of 2 and 3 blocks, each answer read back after every step.
#[test]
fn hashes_sharing_a_tag_are_told_apart_by_every_probe() {
    let tag = super::table::tag;
    let mut seen: StdMap<u32, u64> = StdMap::new();
    let (a, b) = (1u64..)
        .map(|x| x.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .find_map(|h| seen.insert(tag(h), h).map(|twin| (twin, h)))
        .expect("a tag collision");
    assert_eq!(tag(a), tag(b));
    let v = (1u64..)
        .find(|&h| tag(h) >> 16 == tag(a) >> 16 && tag(h) != tag(a))
        .expect("a hash of the same home");
    let s = PartitionId::SHARED;
    for (x, y) in [(a, b), (b, a)] {
        // Full: `v`, the oldest leaf, is evicted for `y`, shifting `x` back into the home slot.
        let mut c = BlockCache::new(2).unwrap();
        c.insert(&[v], s, None, 1.0).unwrap();
        c.insert(&[x], s, None, 2.0).unwrap();
        assert!(c.contains(x) && !c.contains(y), "{x:x} {y:x}");
        assert_eq!(c.insert(&[y], s, None, 3.0).unwrap(), (1, vec![v]));
        assert!(
            c.contains(y) && c.contains(x) && !c.contains(v),
            "{x:x} {y:x}"
        );
        assert_eq!(
            (c.peek_prefix(&[y]), c.peek_prefix(&[x]), c.len()),
            (1, 1, 2)
        );
        // Not full: both twins stored side by side, then one removed.
        let mut c = BlockCache::new(3).unwrap();
        c.insert(&[v], s, None, 1.0).unwrap();
        c.insert(&[x], s, None, 2.0).unwrap();
        assert_eq!(c.insert(&[y], s, None, 3.0).unwrap(), (1, vec![]));
        assert!(c.contains(v) && c.contains(x) && c.contains(y));
        let mut removed = Vec::new();
        assert_eq!(c.remove_into(&[x], &mut removed).unwrap(), 1);
        assert_eq!(removed, [x]);
        assert!(
            c.contains(v) && !c.contains(x) && c.contains(y),
            "{x:x} {y:x}"
        );
        assert_eq!(c.insert(&[x], s, None, 4.0).unwrap(), (1, vec![]));
        assert!(c.contains(x) && c.contains(y) && c.len() == 3);
    }
}
