//! Unit tests of [`crate::index`]: the module root's first, then one module per source file.

//! Hand-written cases and a randomized comparison with a naive model.

use std::collections::{HashMap, HashSet};

use super::*;

fn m(index: &PrefixIndex, q: &[u64]) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> = index
        .match_names(q)
        .into_iter()
        .map(|(n, c)| (n.to_string(), c))
        .collect();
    out.sort();
    out
}

fn pairs(v: &[(&str, u32)]) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> = v.iter().map(|(n, c)| (n.to_string(), *c)).collect();
    out.sort();
    out
}

#[test]
fn store_match_split_merge() {
    let mut ix = PrefixIndex::new(None).unwrap();
    ix.store("a", &[1, 2, 3, 4], None).unwrap();
    assert_eq!(ix.num_nodes(), 1);
    ix.store("b", &[1, 2], None).unwrap();
    assert_eq!(ix.num_nodes(), 2);
    ix.store("b", &[5, 6], Some(2)).unwrap();
    assert_eq!(ix.num_nodes(), 3);
    assert_eq!(m(&ix, &[1, 2, 3, 4]), pairs(&[("a", 4), ("b", 2)]));
    assert_eq!(m(&ix, &[1, 2, 5, 6, 7]), pairs(&[("a", 2), ("b", 4)]));
    assert_eq!(m(&ix, &[1, 9]), pairs(&[("a", 1), ("b", 1)]));
    assert_eq!(m(&ix, &[2]), pairs(&[]));
    assert_eq!(ix.len(), 6);
    assert_eq!(ix.num_blocks("b").unwrap(), 4);
    // Dropping b's branch makes the split at 2 unnecessary: back to one node.
    assert_eq!(ix.remove("b", &[5]).unwrap(), 2);
    assert_eq!(ix.num_nodes(), 2);
    assert_eq!(ix.remove("b", &[1]).unwrap(), 2);
    assert_eq!(ix.num_nodes(), 1);
    ix.check_invariants().unwrap();
    assert_eq!(m(&ix, &[1, 2, 3, 4]), pairs(&[("a", 4)]));
}

#[test]
fn remove_middle_drops_descendants() {
    let mut ix = PrefixIndex::new(None).unwrap();
    ix.store("a", &[1, 2, 3, 4], None).unwrap();
    ix.store("b", &[1, 2, 3, 4], None).unwrap();
    assert_eq!(ix.remove("a", &[3, 99]).unwrap(), 2);
    assert_eq!(ix.num_blocks("a").unwrap(), 2);
    assert_eq!(m(&ix, &[1, 2, 3, 4]), pairs(&[("a", 2), ("b", 4)]));
    assert_eq!(ix.remove("a", &[3]).unwrap(), 0);
    ix.store("a", &[3], Some(2)).unwrap();
    assert_eq!(m(&ix, &[1, 2, 3, 4]), pairs(&[("a", 3), ("b", 4)]));
    ix.check_invariants().unwrap();
}

#[test]
fn batched_removal_cuts_once_per_node() {
    let mut ix = PrefixIndex::new(None).unwrap();
    let chain: Vec<u64> = (1..=10).collect();
    ix.store("a", &chain, None).unwrap();
    ix.store("b", &chain[..6], None).unwrap();
    ix.store("a", &[20, 21], Some(4)).unwrap();
    assert_eq!(ix.num_nodes(), 4);
    // vLLM order: a's tail 10, 9, 8, 7 one block each, then a block of the branch, an
    // unknown block and a repeat.
    assert_eq!(ix.remove("a", &[10, 9, 8, 7, 21, 99, 9]).unwrap(), 5);
    assert_eq!(ix.num_blocks("a").unwrap(), 7);
    assert_eq!(m(&ix, &[1, 2, 3, 4, 5, 6, 7]), pairs(&[("a", 6), ("b", 6)]));
    assert_eq!(m(&ix, &[1, 2, 3, 4, 20, 21]), pairs(&[("a", 5), ("b", 4)]));
    ix.check_invariants().unwrap();
    // Shared run: b drops its tail block by block; a keeps it; the runs merge back.
    assert_eq!(ix.remove("b", &[6, 5]).unwrap(), 2);
    assert_eq!(m(&ix, &[1, 2, 3, 4, 5, 6]), pairs(&[("a", 6), ("b", 4)]));
    ix.check_invariants().unwrap();
    // A block and its ancestor in one batch, descendant first.
    assert_eq!(ix.remove("a", &[20, 3]).unwrap(), 5);
    assert_eq!(m(&ix, &[1, 2, 3]), pairs(&[("a", 2), ("b", 3)]));
    ix.check_invariants().unwrap();
    // Continuing a chain the worker alone holds extends its leaf in place; a conflicting
    // continuation changes nothing.
    ix.store("a", &[30, 31], Some(2)).unwrap();
    let before = ix.dump();
    assert!(matches!(
        ix.store("a", &[32, 3], Some(31)),
        Err(Error::Value(_))
    ));
    assert!(matches!(
        ix.store("a", &[32, 33, 32], Some(31)),
        Err(Error::Value(_))
    ));
    assert_eq!(ix.dump(), before);
    ix.store("a", &[32], Some(31)).unwrap();
    assert_eq!(m(&ix, &[1, 2, 30, 31, 32]), pairs(&[("a", 5), ("b", 2)]));
    ix.check_invariants().unwrap();
}

#[test]
fn bad_input_changes_nothing() {
    let mut ix = PrefixIndex::new(None).unwrap();
    ix.store("a", &[1, 2, 3], None).unwrap();
    let before = ix.dump();
    assert!(matches!(ix.store("a", &[7], Some(99)), Err(Error::Key(_))));
    assert!(matches!(ix.store("b", &[7], Some(1)), Err(Error::Key(_))));
    assert!(matches!(ix.store("a", &[2], None), Err(Error::Value(_))));
    assert!(matches!(
        ix.store("a", &[5, 6, 5], None),
        Err(Error::Value(_))
    ));
    assert!(matches!(
        ix.store("a", &[1, 2, 3, 8, 1], None),
        Err(Error::Value(_))
    ));
    assert!(matches!(ix.store("c", &[1, 3], None), Err(Error::Value(_))));
    assert!(matches!(ix.remove("zz", &[1]), Err(Error::Key(_))));
    assert_eq!(ix.dump(), before);
    assert_eq!(ix.workers().len(), 1);
    ix.check_invariants().unwrap();
}

#[test]
fn many_workers_spill() {
    let mut ix = PrefixIndex::new(None).unwrap();
    for w in 0..200u64 {
        let chain: Vec<u64> = (0..=w % 7).map(|i| 1000 + i).collect();
        ix.store(&format!("w{w}"), &chain, None).unwrap();
    }
    ix.check_invariants().unwrap();
    let got = m(&ix, &[1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007]);
    assert_eq!(got.len(), 200);
    for (name, count) in got {
        let w: u64 = name[1..].parse().unwrap();
        assert_eq!(u64::from(count), w % 7 + 1);
    }
    for w in 0..200 {
        ix.remove_worker(&format!("w{w}")).unwrap();
        ix.check_invariants().unwrap();
    }
    assert_eq!(ix.num_nodes(), 0);
    assert!(ix.is_empty());
}

/// Naive model: global parent links plus per-worker block sets.
#[derive(Default, Clone)]
struct Model {
    parent: HashMap<u64, Option<u64>>,
    held: HashMap<String, HashSet<u64>>,
}

impl Model {
    fn holders(&self, b: u64) -> Vec<&str> {
        let mut v: Vec<&str> = self
            .held
            .iter()
            .filter(|(_, s)| s.contains(&b))
            .map(|(n, _)| n.as_str())
            .collect();
        v.sort();
        v
    }

    fn prune(&mut self) {
        let live: HashSet<u64> = self.held.values().flatten().copied().collect();
        self.parent.retain(|b, _| live.contains(b));
    }

    fn store(
        &mut self,
        w: &str,
        chain: &[u64],
        parent: Option<u64>,
    ) -> std::result::Result<(), char> {
        if let Some(p) = parent {
            if !self.held.get(w).is_some_and(|s| s.contains(&p)) {
                return Err('K');
            }
        }
        let mut prev = parent;
        let mut seen = HashSet::new();
        for &b in chain {
            if !seen.insert(b) || self.parent.get(&b).is_some_and(|&p| p != prev) {
                return Err('V');
            }
            prev = Some(b);
        }
        let mut prev = parent;
        let set = self.held.entry(w.to_string()).or_default();
        for &b in chain {
            self.parent.insert(b, prev);
            set.insert(b);
            prev = Some(b);
        }
        Ok(())
    }

    fn remove(&mut self, w: &str, blocks: &[u64]) -> u64 {
        let mut dropped = 0;
        for &b in blocks {
            let Some(set) = self.held.get(w) else {
                return 0;
            };
            if !set.contains(&b) {
                continue;
            }
            let gone: Vec<u64> = set
                .iter()
                .copied()
                .filter(|&x| {
                    let mut y = Some(x);
                    while let Some(z) = y {
                        if z == b {
                            return true;
                        }
                        y = self.parent.get(&z).copied().flatten();
                    }
                    false
                })
                .collect();
            let set = self.held.get_mut(w).unwrap();
            for x in gone {
                set.remove(&x);
                dropped += 1;
            }
        }
        self.prune();
        dropped
    }

    fn matches(&self, q: &[u64]) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        for (w, set) in &self.held {
            let mut prev = None;
            let mut n = 0;
            for &b in q {
                if !set.contains(&b) || self.parent.get(&b) != Some(&prev) {
                    break;
                }
                prev = Some(b);
                n += 1;
            }
            if n > 0 {
                out.push((w.clone(), n));
            }
        }
        out.sort();
        out
    }

    fn canonical_nodes(&self) -> usize {
        let mut children: HashMap<Option<u64>, usize> = HashMap::new();
        for p in self.parent.values() {
            *children.entry(*p).or_default() += 1;
        }
        self.parent
            .iter()
            .filter(|(b, p)| match p {
                None => true,
                Some(p) => children[&Some(*p)] > 1 || self.holders(**b) != self.holders(*p),
            })
            .count()
    }
}

/// xorshift64*: a small deterministic generator for the randomized tests.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn random_ops(seed: u64, steps: usize, workers: u64, budget: Option<usize>) {
    let mut rng = Rng(seed);
    let mut ix = PrefixIndex::new(budget).unwrap();
    let mut model = Model::default();
    // Sequences: a few shared "system prompts", then private continuations.
    let mut chains: Vec<Vec<u64>> = Vec::new();
    let mut fresh = 1u64;
    for step in 0..steps {
        let w = format!("w{}", rng.below(workers));
        match rng.below(10) {
            0..=4 => {
                // Extend a known chain (or start a new one) by some blocks.
                let (base, parent) = if !chains.is_empty() && rng.below(4) > 0 {
                    let c = chains[rng.below(chains.len() as u64) as usize].clone();
                    let cut = rng.below(c.len() as u64 + 1) as usize;
                    (
                        c[..cut].to_vec(),
                        if cut > 0 { Some(c[cut - 1]) } else { None },
                    )
                } else {
                    (Vec::new(), None)
                };
                let mut chain = base.clone();
                for _ in 0..rng.below(12) {
                    chain.push(fresh * 7919);
                    fresh += 1;
                }
                // Store either the whole chain from the root or just the tail after `parent`.
                let (hashes, par) = if rng.below(2) == 0 {
                    (chain.clone(), None)
                } else {
                    (chain[base.len()..].to_vec(), parent)
                };
                let want = model.store(&w, &hashes, par);
                let got = ix.store(&w, &hashes, par);
                match (&want, &got) {
                    (Ok(()), Ok(())) => {}
                    (Err('K'), Err(Error::Key(_))) | (Err('V'), Err(Error::Value(_))) => {}
                    _ if budget.is_some() && got.is_err() => {}
                    _ => panic!("step {step}: store {hashes:?} {par:?}: {want:?} vs {got:?}"),
                }
                if budget.is_some() && got.is_err() && want.is_ok() {
                    // Evicted parent: the model stays a superset of the index.
                }
                chains.push(chain);
            }
            5 | 6 => {
                // One block; or a batch: a chain's tail, last block first (as vLLM reports
                // evictions, one event per block), and blocks of other chains.
                let mut blocks = Vec::new();
                for part in 0..=rng.below(3) {
                    let pick = rng.below(chains.len().max(1) as u64) as usize;
                    if let Some(c) = chains.get(pick).filter(|c| !c.is_empty()) {
                        let at = rng.below(c.len() as u64) as usize;
                        if part == 0 && rng.below(2) == 0 {
                            blocks.extend(c[at..].iter().rev());
                        } else {
                            blocks.push(c[at]);
                        }
                    }
                }
                if !blocks.is_empty() {
                    let before = model.clone();
                    let want = model.remove(&w, &blocks);
                    let mut listed = Vec::new();
                    let id = ix.worker_id(&w);
                    let got = id.map(|id| ix.remove_id_into(id, &blocks, &mut listed));
                    if let (Some(Ok(got)), None) = (got, budget) {
                        assert_eq!(got, want, "step {step}: remove {blocks:?}");
                        // The listed blocks are exactly the dropped ones, each after all
                        // of its descendants.
                        let held = |m: &Model| m.held.get(&w).cloned().unwrap_or_default();
                        let gone: HashSet<u64> =
                            held(&before).difference(&held(&model)).copied().collect();
                        assert_eq!(listed.len() as u64, got, "step {step}");
                        assert_eq!(listed.iter().copied().collect::<HashSet<_>>(), gone);
                        for (i, &b) in listed.iter().enumerate() {
                            let mut up = before.parent.get(&b).copied().flatten();
                            while let Some(a) = up {
                                if let Some(j) = listed.iter().position(|&x| x == a) {
                                    assert!(j > i, "step {step}: {a} listed before {b}");
                                }
                                up = before.parent.get(&a).copied().flatten();
                            }
                        }
                    }
                }
            }
            7 => {
                if rng.below(3) == 0 {
                    model.held.remove(&w);
                    model.prune();
                    let _ = ix.remove_worker(&w);
                } else {
                    if let Some(s) = model.held.get_mut(&w) {
                        s.clear();
                    }
                    model.prune();
                    let _ = ix.clear(&w);
                }
            }
            _ => {}
        }
        ix.check_invariants()
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        for c in chains.iter().rev().take(3) {
            let want = model.matches(c);
            let got = m(&ix, c);
            if budget.is_none() {
                assert_eq!(got, want, "step {step}: match {c:?}");
            } else {
                let want: HashMap<String, u32> = want.into_iter().collect();
                for (w, n) in got {
                    assert!(
                        n <= want.get(&w).copied().unwrap_or(0),
                        "step {step}: unsound"
                    );
                }
            }
        }
        if budget.is_none() {
            assert_eq!(ix.num_nodes(), model.canonical_nodes(), "step {step}");
            assert_eq!(ix.len(), model.parent.len(), "step {step}");
            // The readers against the model (index 15/40: `is_empty` → `true` passed, read only
            // on an empty index): emptiness both ways, and each block of the recent chains.
            assert_eq!(ix.is_empty(), model.parent.is_empty(), "step {step}");
            for h in chains.iter().rev().take(3).flatten() {
                assert_eq!(
                    ix.contains(*h),
                    model.parent.contains_key(h),
                    "step {step}: {h}"
                );
            }
            if step % 50 == 0 {
                let copy = PrefixIndex::load(&ix.dump(), None).unwrap();
                copy.check_invariants().unwrap();
                assert_eq!(copy.dump().len(), ix.dump().len());
                for c in chains.iter().rev().take(5) {
                    assert_eq!(m(&copy, c), m(&ix, c));
                }
            }
        }
    }
}

#[test]
fn random_against_model() {
    for seed in 1..=20 {
        random_ops(seed * 0x9E37_79B9, 400, 5, None);
    }
    random_ops(77, 300, 100, None);
}

#[test]
fn random_with_budget_is_sound() {
    for seed in 1..=10 {
        random_ops(
            seed * 31 + 7,
            400,
            6,
            Some(PrefixIndex::min_budget() + 6000),
        );
    }
}

/// Issue 14: storing 3 blocks and removing them left the removal's buffers over a tight budget.
#[test]
fn budget_holds_after_a_removal_empties_the_tree() {
    for budget in (PrefixIndex::min_budget()..2_000).step_by(3) {
        let mut ix = PrefixIndex::new(Some(budget)).unwrap();
        if ix.store("w", &[1, 2, 3], None).is_err() {
            continue; // too small for the worker table
        }
        assert!(ix.memory_bytes() <= budget, "{budget}");
        ix.remove("w", &[3, 2, 1]).unwrap();
        assert!(ix.memory_bytes() <= budget, "{budget}");
        ix.check_invariants().unwrap();
    }
}

#[test]
fn budget_holds_and_evicts_lru_first() {
    let budget = 200_000;
    let mut ix = PrefixIndex::new(Some(budget)).unwrap();
    for s in 0..200u64 {
        let chain: Vec<u64> = (0..100).map(|i| (s << 32) | (i + 1)).collect();
        ix.store(&format!("w{}", s % 4), &chain, None).unwrap();
        assert!(ix.memory_bytes() <= budget);
        // Keep sequence 0 hot.
        let hot: Vec<u64> = (0..100).map(|i| i + 1).collect();
        let _ = ix.match_names(&hot);
        ix.check_invariants().unwrap();
    }
    let hot: Vec<u64> = (0..100).map(|i| i + 1).collect();
    assert_eq!(m(&ix, &hot), pairs(&[("w0", 100)]));
    assert!(ix.len() < 200 * 100);
    assert!(PrefixIndex::new(Some(10)).is_err());
}

#[test]
fn load_rejects_garbage_without_panicking() {
    let mut ix = PrefixIndex::new(None).unwrap();
    ix.store("a", &[1, 2, 3], None).unwrap();
    ix.store("b", &[1, 2, 9], None).unwrap();
    let image = ix.dump();
    let copy = PrefixIndex::load(&image, None).unwrap();
    assert_eq!(copy.dump(), image);
    let mut rng = Rng(5);
    for _ in 0..2000 {
        let mut bad = image.clone();
        match rng.below(3) {
            0 => bad.truncate(rng.below(image.len() as u64) as usize),
            1 => {
                let i = rng.below(bad.len() as u64) as usize;
                bad[i] ^= 1 << rng.below(8);
            }
            _ => {
                // Corrupt the body and fix the checksum, so structural validation must catch it.
                let body = bad.len() - 8;
                let i = rng.below(body as u64) as usize;
                bad[i] = rng.next() as u8;
                let sum = xxhash_rust::xxh3::xxh3_64(&bad[..body]).to_le_bytes();
                bad[body..].copy_from_slice(&sum);
            }
        }
        if let Ok(loaded) = PrefixIndex::load(&bad, None) {
            loaded.check_invariants().unwrap();
        }
    }
}

#[test]
fn remove_into_lists_descendants_first() {
    let mut ix = PrefixIndex::new(None).unwrap();
    ix.store("a", &[1, 2, 3, 4], None).unwrap();
    ix.store("a", &[5, 6], Some(2)).unwrap();
    ix.store("b", &[1, 2, 3], None).unwrap();
    let a = ix.worker_id("a").unwrap();
    let mut dropped = Vec::new();
    assert_eq!(ix.remove_id_into(a, &[2, 77], &mut dropped).unwrap(), 5);
    let pos = |h: u64| dropped.iter().position(|&x| x == h).unwrap();
    let mut sorted = dropped.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, vec![2, 3, 4, 5, 6]);
    assert!(pos(4) < pos(3) && pos(3) < pos(2));
    assert!(pos(6) < pos(5) && pos(5) < pos(2));
    assert_eq!(m(&ix, &[1, 2, 3]), pairs(&[("a", 1), ("b", 3)]));
    ix.check_invariants().unwrap();
}

#[test]
fn worker_names_by_id() {
    let mut ix = PrefixIndex::new(None).unwrap();
    ix.store("a", &[1], None).unwrap();
    ix.store("b", &[2], None).unwrap();
    for name in ["a", "b"] {
        let id = ix.worker_id(name).unwrap();
        assert_eq!(ix.worker_name(id), Some(name));
        let shared = ix.worker_name_ref(id).unwrap();
        assert_eq!(&**shared, name);
        // The index's own string: a caller may cache a conversion keyed by its identity.
        assert!(Arc::ptr_eq(shared, &ix.worker_name_arc(id).unwrap()));
    }
    let gone = ix.worker_id("b").unwrap();
    ix.remove_worker("b").unwrap();
    assert_eq!(ix.worker_name_ref(gone), None);
    assert_eq!(ix.worker_name(gone), None);
}

/// cargo-mutants survivor (shard 1/40): a worker is admitted exactly when the table with it fits,
/// the budget being the bytes an unbudgeted index with that one worker reports.
#[test]
fn add_worker_admits_a_table_that_exactly_fits() {
    for name in ["w", "a-longer-worker-name"] {
        let mut free = PrefixIndex::new(None).unwrap();
        free.add_worker(name).unwrap();
        let fits = free.memory_bytes();
        let mut ix = PrefixIndex::new(Some(fits)).unwrap();
        assert_eq!(ix.add_worker(name).unwrap(), 0);
        assert_eq!(ix.memory_bytes(), fits);
        let mut ix = PrefixIndex::new(Some(fits - 1)).unwrap();
        assert!(matches!(ix.add_worker(name), Err(Error::Value(_))));
        assert_eq!(ix.num_workers(), 0);
    }
}

/// cargo-mutants survivor (shard 1/40): a run held by workers 0, 64 and 65 (a spilled set) is not
/// one only worker 65 holds, so 65's next block is not appended to it in place, nor is 65's
/// removal a truncation of it.
#[test]
fn a_run_shared_in_a_spilled_set_is_not_changed_in_place() {
    let mut ix = PrefixIndex::new(None).unwrap();
    for w in 0..66 {
        ix.add_worker(&format!("w{w}")).unwrap();
    }
    for w in ["w0", "w64", "w65"] {
        ix.store(w, &[1, 2], None).unwrap();
    }
    ix.store("w65", &[3], Some(2)).unwrap();
    let held = |n| pairs(&[("w0", 2), ("w64", 2), ("w65", n)]);
    assert_eq!(m(&ix, &[1, 2, 3]), held(3));
    assert_eq!(ix.remove("w65", &[2]).unwrap(), 2);
    assert_eq!(m(&ix, &[1, 2, 3]), held(1));
    ix.check_invariants().unwrap();
}

/// cargo-mutants survivor (shard 1/40): the buffers a removal grows stay in the index and are
/// counted, so an index that removed 1,000 blocks reports at least their bytes more than one in
/// the same state that never removed anything.
#[test]
fn memory_counts_the_buffers_a_removal_keeps() {
    let chain: Vec<u64> = (1..=1000).collect();
    let mut removed = PrefixIndex::new(None).unwrap();
    removed.store("a", &chain, None).unwrap();
    removed.store("b", &chain, None).unwrap();
    // Each listed block the worker holds is one entry of the removal's buffer of cuts.
    let tail_first: Vec<u64> = chain.iter().rev().copied().collect();
    assert_eq!(removed.remove("a", &tail_first).unwrap(), 1000);
    let mut fresh = PrefixIndex::new(None).unwrap();
    fresh.add_worker("a").unwrap();
    fresh.store("b", &chain, None).unwrap();
    assert_eq!(m(&removed, &chain), pairs(&[("b", 1000)]));
    assert_eq!((removed.num_nodes(), removed.num_workers()), (1, 2));
    let cuts = 1000 * std::mem::size_of::<(u32, usize, u64)>();
    assert!(
        removed.memory_bytes() >= fresh.memory_bytes() + cuts,
        "{} vs {} + {cuts}",
        removed.memory_bytes(),
        fresh.memory_bytes()
    );
}

/// cargo-mutants survivor (shard 1/40): eviction takes a child before its parent when a match
/// stamped both with the same tick, so a newer leaf is never evicted while an older run is kept.
#[test]
fn eviction_takes_an_equally_old_parent_before_a_newer_leaf() {
    let long: Vec<u64> = (1..=40).collect();
    let newer: Vec<u64> = (1001..=1040).collect();
    let newest: Vec<u64> = (2001..=2040).collect();
    let mut checked = 0;
    // `a` holds 1..=40 and `b` its first `cut` blocks: two nodes, the parent and the child. A
    // split moves the shorter half to a new node, so the parent's id is the larger for a short
    // prefix and the smaller for a long one.
    for (budget, cut) in (PrefixIndex::min_budget()..12_000)
        .step_by(7)
        .flat_map(|b| [(b, 10), (b, 30)])
    {
        let Ok(mut ix) = PrefixIndex::new(Some(budget)) else {
            continue;
        };
        if ix.store("a", &long, None).is_err() || ix.store("b", &long[..cut], None).is_err() {
            continue;
        }
        if ix.num_nodes() != 2 {
            continue;
        }
        let _ = ix.match_names(&long); // parent and child: the same tick
        if ix.store("c", &newer, None).is_err() || ix.len() != 80 {
            continue;
        }
        if ix.store("d", &newest, None).is_err() {
            continue;
        }
        ix.check_invariants().unwrap();
        let kept = |q: &[u64]| !ix.match_names(q).is_empty();
        if !kept(&newer) {
            checked += 1;
            assert!(!kept(&long[..1]), "budget {budget}: {:?}", ix.dump());
        }
    }
    assert!(checked > 0);
}

/// cargo-mutants survivor (shard 0/40): an image loads under a budget equal to the bytes the
/// index it rebuilds takes (what an unbudgeted load of the same image reports), whole.
#[test]
fn load_admits_an_image_that_exactly_fits() {
    let mut ix = PrefixIndex::new(None).unwrap();
    let chain: Vec<u64> = (1..=300).collect();
    ix.store("a", &chain, None).unwrap();
    ix.store("b", &chain[..120], None).unwrap();
    let image = ix.dump();
    let fits = PrefixIndex::load(&image, None).unwrap().memory_bytes();
    let loaded = PrefixIndex::load(&image, Some(fits)).unwrap();
    assert_eq!(loaded.memory_bytes(), fits);
    assert_eq!(m(&loaded, &chain), pairs(&[("a", 300), ("b", 120)]));
}

/// cargo-mutants survivor (shard 0/40): every part of the tree is counted. Each live node is a
/// slot of the node slab and a 16-byte `(first block, node)` entry of the table of run starts;
/// each stored block an 8-byte hash in its node's run and an 8-byte entry in the block table. So
/// an index reports at least that much, whatever its shape: one long run, or 1,023 one-block runs.
#[test]
fn memory_counts_every_node_and_block() {
    let floor = |ix: &PrefixIndex| {
        ix.num_nodes() * (std::mem::size_of::<super::tree::Node>() + 16) + ix.len() * 16
    };
    let mut long = PrefixIndex::new(None).unwrap();
    let chain: Vec<u64> = (1..=10_000).collect();
    long.store("w", &chain, None).unwrap();
    assert_eq!((long.num_nodes(), long.len()), (1, 10_000));
    assert!(
        long.memory_bytes() >= floor(&long),
        "{}",
        long.memory_bytes()
    );
    let mut star = PrefixIndex::new(None).unwrap();
    for k in 1..=1023u64 {
        star.store("w", &[k], None).unwrap();
    }
    assert_eq!((star.num_nodes(), star.len()), (1023, 1023));
    assert!(
        star.memory_bytes() >= floor(&star),
        "{}",
        star.memory_bytes()
    );
}

/// cargo-mutants survivor (shard 4/40): the mutations' reused buffers are counted as the module
/// docs account every heap allocation — its bytes plus one `ALLOC_OVERHEAD` allowance — and a
/// buffer never allocated as nothing.
#[test]
fn scratch_buffers_count_their_bytes_and_one_allowance_each() {
    let mut s = super::Scratch::default();
    assert_eq!(s.heap_bytes(), 0);
    s.cuts.reserve_exact(10);
    s.stack.reserve_exact(3);
    let cuts = s.cuts.capacity() * std::mem::size_of::<(u32, usize, u64)>();
    let stack = s.stack.capacity() * 4;
    assert_eq!(s.heap_bytes(), cuts + stack + 2 * super::ALLOC_OVERHEAD);
}

/// cargo-mutants survivor (shard 4/40): the invariant checker the state-machine tests rely on
/// reports a child whose sibling link is wrong even when its parent link is right.
#[test]
fn the_checker_reports_a_broken_sibling_link() {
    let mut ix = PrefixIndex::new(None).unwrap();
    for k in 1..=3u64 {
        ix.store("w", &[k], None).unwrap();
    }
    ix.check_invariants().unwrap();
    let second = (1..ix.tree.nodes.len() as u32)
        .find(|&c| ix.tree.node(c).prev_sibling != super::tree::NIL)
        .expect("a second child of the root");
    ix.tree.nodes[second as usize].prev_sibling = second;
    let err = ix.check_invariants().unwrap_err();
    assert!(err.contains("bad links"), "{err}");
}

/// `worker_set.rs`.
mod worker_set {
    use super::super::worker_set::*;

    #[test]
    fn insert_remove_canonical() {
        let mut s = WorkerSet::default();
        s.insert(3);
        s.insert(200);
        assert!(matches!(s, WorkerSet::Spilled(_)));
        assert!(s.contains(3) && s.contains(200) && !s.contains(4) && !s.contains(1000));
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![3, 200]);
        s.remove(200);
        assert_eq!(s, WorkerSet::single(3));
        s.remove(3);
        assert!(s.is_empty());
    }

    /// cargo-mutants survivor (shard 1/40): a spilled set is `{id}` only if it holds nothing else.
    #[test]
    fn is_only_on_spilled_sets() {
        let mut s = WorkerSet::default();
        s.insert(65);
        assert!(matches!(s, WorkerSet::Spilled(_)));
        assert!(s.is_only(65) && !s.is_only(64) && !s.is_only(1) && !s.is_only(129));
        for id in [0, 64] {
            s.insert(id);
        }
        for id in [0, 1, 64, 65, 66] {
            assert!(!s.is_only(id), "{id}");
        }
        assert!(WorkerSet::single(3).is_only(3) && !WorkerSet::single(3).is_only(67));
    }

    /// cargo-mutants survivor (shard 5/40): `insert` into a spilled set below its last word
    /// (the in-place path; without it the general path resized the words to the inserted id's,
    /// dropping every id above it). Random inserts and removes of ids 0..260 against a
    /// `BTreeSet`: after each, membership, order, size, `is_only`, subset and difference with
    /// a second set, and the canonical form (derived equality is set equality).
    #[test]
    fn sets_follow_a_reference_set() {
        use std::collections::BTreeSet;
        let mut rng = crate::router::SplitMix64(5);
        let (mut a, mut b) = (WorkerSet::default(), WorkerSet::default());
        let (mut ma, mut mb) = (BTreeSet::new(), BTreeSet::new());
        for step in 0..4000 {
            let r = rng.next_u64();
            // Ids mostly low (inline sets), sometimes in later words.
            let id = if r & 3 == 0 {
                (r >> 8) % 260
            } else {
                (r >> 8) % 70
            } as u32;
            let (set, model) = if r & 16 == 0 {
                (&mut a, &mut ma)
            } else {
                (&mut b, &mut mb)
            };
            if r & 32 == 0 || model.len() < 3 {
                set.insert(id);
                model.insert(id);
            } else {
                set.remove(id);
                model.remove(&id);
            }
            let at = format!("step {step}: id {id}");
            for (set, model) in [(&a, &ma), (&b, &mb)] {
                assert_eq!(
                    set.iter().collect::<Vec<_>>(),
                    model.iter().copied().collect::<Vec<_>>(),
                    "{at}"
                );
                assert_eq!(
                    (set.len(), set.is_empty()),
                    (model.len(), model.is_empty()),
                    "{at}"
                );
                for probe in [id, id ^ 1, id + 64, 0, 63, 64, 130, 259] {
                    assert_eq!(set.contains(probe), model.contains(&probe), "{at}: {probe}");
                    let only = model.len() == 1 && model.contains(&probe);
                    assert_eq!(set.is_only(probe), only, "{at}: {probe}");
                }
                let words: Vec<u64> = set.words().to_vec();
                assert_eq!(&WorkerSet::from_words(words), set, "{at}: canonical");
            }
            assert_eq!(a.is_subset(&b), ma.is_subset(&mb), "{at}");
            let minus: Vec<u32> = ma.difference(&mb).copied().collect();
            assert_eq!(a.iter_minus(&b).collect::<Vec<_>>(), minus, "{at}");
            assert_eq!(a == b, ma == mb, "{at}");
        }
    }

    #[test]
    fn minus_and_subset() {
        let mut a = WorkerSet::default();
        let mut b = WorkerSet::default();
        for id in [0, 63, 64, 130] {
            a.insert(id);
        }
        for id in [63, 130] {
            b.insert(id);
        }
        assert_eq!(a.iter_minus(&b).collect::<Vec<_>>(), vec![0, 64]);
        assert!(b.is_subset(&a) && !a.is_subset(&b));
        assert_eq!(a.len(), 4);
        assert_eq!(
            WorkerSet::single(5).iter_minus(&a).collect::<Vec<_>>(),
            vec![5]
        );
    }
}

/// Tests written for cargo-mutants survivors since shard 6/40 (`tests_mutants.rs`).
#[path = "tests_mutants.rs"]
mod mutants;

/// `load`'s refusals against a hand-written image (`tests_image.rs`).
#[path = "tests_image.rs"]
mod image;
