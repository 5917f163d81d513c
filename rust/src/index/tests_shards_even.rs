//! Index tests written for the cargo-mutants survivors of shards 22/40 to 38/40, even (old
//! numbering: `--exclude-re 'codec.rs:188:'`), the shards no run had reached. `tests.rs` and
//! `tests_mutants.rs` are near their size limit.

use super::tree::{Tree, ROOT};
use super::worker_set::WorkerSet;
use super::PrefixIndex;

/// cargo-mutants survivor (shard 24/40): `max - max / 16` → `max - max % 16` in
/// `PrefixIndex::enforce_budget` evicted only down to the budget (no test read where an eviction
/// stops). For the class — the documented target of an eviction pass: the least recently used
/// leaves are dropped until the index is at most 15/16 of the budget, and no more — one worker
/// stores sequences of 1, 5 or 40 blocks (each a leaf under the root, so the store order is the LRU
/// order) under budgets at and off multiples of 16; after every store that evicted, the index is
/// within 15/16 of its budget, holds the newest sequences whole, and the sequence evicted last
/// would not have fitted beside them (an index holding it too is, compacted, above the target);
/// 8 evictions each. Also closes 36/40's `size_of::<Self>() + workers` → `*` in
/// `PrefixIndex::compacted_bytes`: an estimate too high, every sequence evicted.
#[test]
fn an_eviction_stops_at_fifteen_sixteenths_of_the_budget_having_dropped_no_more_than_needed() {
    let seq = |s: u64, len: u64| -> Vec<u64> { (1..=len).map(|i| (s << 32) | i).collect() };
    for len in [1u64, 5, 40] {
        for budget in [9_600, 9_613, 16_000, 16_008, 30_720, 30_735] {
            let target = budget - budget / 16;
            let mut ix = PrefixIndex::new(Some(budget)).unwrap();
            assert_eq!(ix.add_worker("w"), Ok(0));
            // The worker table at its compacted size, as it is after any eviction, so that the
            // reference below (compacted too) has the same one.
            ix.compact();
            let mut here = 0;
            for s in 0..10_000 {
                if here == 8 {
                    break;
                }
                let before = ix.len();
                ix.store_id(0, &seq(s, len), None).unwrap();
                if ix.len() == before + len as usize {
                    assert!(ix.memory_bytes() <= budget);
                    continue;
                }
                here += 1;
                let at = format!("{len}-block sequences, budget {budget}, after sequence {s}");
                assert!(
                    ix.memory_bytes() <= target,
                    "{at}: {} > 15/16 of the budget ({target})",
                    ix.memory_bytes()
                );
                let kept: Vec<u64> = (0..=s).filter(|&t| ix.contains(t << 32 | 1)).collect();
                let Some(&oldest) = kept.first() else {
                    panic!("{at}: every sequence evicted, {} bytes", ix.memory_bytes());
                };
                assert!(oldest > 0, "{at}: nothing evicted");
                assert_eq!(
                    kept,
                    (oldest..=s).collect::<Vec<_>>(),
                    "{at}: not the oldest"
                );
                assert_eq!(
                    ix.len(),
                    kept.len() * len as usize,
                    "{at}: a sequence in part"
                );
                let mut more = PrefixIndex::new(None).unwrap();
                assert_eq!(more.add_worker("w"), Ok(0));
                for t in oldest - 1..=s {
                    more.store_id(0, &seq(t, len), None).unwrap();
                }
                more.compact();
                assert!(
                    more.compacted_bytes() > target,
                    "{at}: sequence {} evicted, but {} bytes with it fit the target {target}",
                    oldest - 1,
                    more.compacted_bytes()
                );
                ix.check_invariants().unwrap();
            }
            assert_eq!(here, 8, "{len}-block sequences, budget {budget}: evictions");
        }
    }
}

/// cargo-mutants survivor (shard 24/40): `len == 0 || len >= old` → `&&` in `Tree::truncate`
/// (the index only cuts inside a run, so no index test reached the guard). For the class —
/// `truncate`'s documented contract on one node — a run of 1 to 10 blocks, at its exact size and
/// with spare capacity, truncated to every length from 0 to two past its end: inside the run
/// (0 < len < run) the run keeps its first `len` blocks, the rest lose their table entries, and
/// the allocation shrinks exactly when at most half of it stays in use; at 0 (outside the
/// precondition) and at or past the run's end nothing changes — blocks, entries, allocation,
/// memory. Under the mutant a truncation to the run's length shrank a half-empty allocation and a
/// truncation to 0 left a live node with an empty run.
#[test]
fn truncating_a_run_cuts_it_inside_and_changes_nothing_at_zero_or_past_its_end() {
    for len in 1..=10usize {
        let hashes: Vec<u64> = (1..=len as u64).map(|h| h * 11).collect();
        for spare in [0, 1, len, 2 * len + 1] {
            for to in 0..=len + 2 {
                let mut t = Tree::new();
                let mut run = Vec::with_capacity(len + spare);
                run.extend_from_slice(&hashes);
                let cap = run.capacity();
                let id = t.alloc(run, WorkerSet::single(0), 1);
                t.link(id, ROOT);
                t.insert_entries(id).unwrap();
                t.set_start(hashes[0], id);
                t.check().unwrap();
                let memory = t.memory_bytes();
                t.truncate(id, to);
                let at = format!("a run of {len} (capacity {cap}) truncated to {to}");
                t.check().unwrap_or_else(|e| panic!("{at}: {e}"));
                let kept = if 0 < to && to < len { to } else { len };
                let run = &t.node(id).hashes;
                assert_eq!(run[..], hashes[..kept], "{at}");
                for (j, &h) in hashes.iter().enumerate() {
                    let want = (j < kept).then_some((id, j));
                    assert_eq!(t.find(h), want, "{at}: block {j}");
                }
                if kept < len {
                    let want = if 2 * to <= cap { to } else { cap };
                    assert_eq!(run.capacity(), want, "{at}: the allocation");
                } else {
                    assert_eq!(run.capacity(), cap, "{at}: the allocation");
                    assert_eq!(t.memory_bytes(), memory, "{at}: the memory");
                }
            }
        }
    }
}

/// cargo-mutants survivor (shard 32/40): `mix` → 1 put every block in one probe sequence of the
/// block table and the table of run starts: the same answers, each lookup a scan of the whole
/// table (the suite ran 10× slower), which no test can time. For the class — `mix`'s documented
/// spread, the property every table operation's O(1) cost rests on — 4,096 block hashes of five
/// shapes (sequential, strided by 2^32 and by 2^48, the top of the range, random) map to 4,096
/// distinct hashes, over at least half of 4,096 buckets (a uniform hash fills ~63%) and over all
/// 128 tags (the top 7 bits). Also `u128::from(h) * C` → `/ C` (a constant) and the fold's `^`
/// → `&` (shards 34/40, 36/40).
#[test]
fn the_table_hash_spreads_every_shape_of_block_hashes_over_buckets_and_tags() {
    use super::tree::mix;
    use std::collections::HashSet;
    let n = 4096u64;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let random: Vec<u64> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect();
    let shapes: [(&str, Vec<u64>); 5] = [
        ("sequential", (1..=n).collect()),
        ("strided by 2^32", (0..n).map(|i| i << 32 | 1).collect()),
        ("strided by 2^48", (1..=n).map(|i| i << 48).collect()),
        (
            "the top of the range",
            (0..n).map(|i| u64::MAX - i).collect(),
        ),
        ("random", random),
    ];
    for (shape, keys) in shapes {
        let hashes: Vec<u64> = keys.iter().map(|&h| mix(h)).collect();
        let distinct =
            |f: &dyn Fn(u64) -> u64| hashes.iter().map(|&h| f(h)).collect::<HashSet<_>>().len();
        assert_eq!(distinct(&|h| h), n as usize, "{shape}: hashes");
        let buckets = distinct(&|h| h % n);
        assert!(
            buckets >= n as usize / 2,
            "{shape}: {buckets} of {n} buckets"
        );
        assert_eq!(distinct(&|h| h >> 57), 128, "{shape}: tags");
    }
}
