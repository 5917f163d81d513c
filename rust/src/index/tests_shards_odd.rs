//! Index tests written for the cargo-mutants survivors of the odd shards 23/40 to 39/40 (old
//! numbering: `--exclude-re 'codec.rs:188:'`), one per class of bug. `tests.rs` and
//! `tests_mutants.rs` are near the size limit. A module of `index` beside `tests`.

use super::*;

/// The ticks (last use) of every live node of `ix`, the root's excepted.
fn ticks(ix: &PrefixIndex) -> Vec<u64> {
    let mut out = Vec::new();
    let mut stack = vec![ROOT];
    while let Some(id) = stack.pop() {
        for c in ix.tree.children(id) {
            out.push(ix.tree.node(c).tick());
            stack.push(c);
        }
    }
    out
}

/// The tick of the node holding block `h`.
fn tick_of(ix: &PrefixIndex, h: u64) -> u64 {
    let (node, _) = ix.tree.find(h).expect("stored");
    ix.tree.node(node).tick()
}

/// cargo-mutants survivor (shard 37/40): `tree.node(ROOT).tick() + 1` → `* 1` in `load` restarted
/// the recency clock at the newest tick of the image, so the first store after loading was
/// stamped as old as the newest loaded node (a tie in the eviction order) instead of newer. For
/// the class — recency is a logical clock that only moves forward, across `dump` / `load` too —
/// images of indexes whose newest node is a leaf, an inner node, or one touched by a match under a
/// budget are loaded with and without a budget: each loaded node keeps its tick, and a store and
/// then a match after loading are each stamped strictly newer than everything before them.
#[test]
fn the_recency_clock_continues_past_every_tick_of_a_loaded_image() {
    let budget = Some(1 << 20);
    let mut images = Vec::new();
    for shape in 0..3 {
        let mut ix = PrefixIndex::new(budget).unwrap();
        ix.store("a", &[1, 2, 3], None).unwrap();
        ix.store("b", &[1, 2, 7], None).unwrap();
        ix.store("c", &[20, 21], None).unwrap();
        match shape {
            // The newest node a leaf.
            0 => ix.store("a", &[4], Some(3)).unwrap(),
            // The newest node an inner one: c's run split by f's shorter store.
            1 => ix.store("f", &[20], None).unwrap(),
            // A match under a budget stamps the path it takes.
            _ => {
                let mut out = Vec::new();
                ix.match_into(&[20, 21], &mut out);
            }
        }
        ix.check_invariants().unwrap();
        images.push((shape, ticks(&ix), ix.dump()));
    }
    for (shape, before, image) in images {
        for max in [None, budget] {
            let mut ix = PrefixIndex::load(&image, max).unwrap();
            let mut loaded = ticks(&ix);
            let mut want = before.clone();
            loaded.sort_unstable();
            want.sort_unstable();
            assert_eq!(loaded, want, "shape {shape}: the loaded ticks");
            let newest = *want.last().expect("nodes");
            ix.store("d", &[100, 101], None).unwrap();
            let stored = tick_of(&ix, 100);
            assert!(
                stored > newest,
                "shape {shape}, {max:?}: {stored} <= {newest}"
            );
            ix.store("e", &[200], None).unwrap();
            assert!(
                tick_of(&ix, 200) > stored,
                "shape {shape}, {max:?}: a later store"
            );
            if max.is_some() {
                let mut out = Vec::new();
                ix.match_into(&[1, 2], &mut out);
                let matched = tick_of(&ix, 1);
                assert!(
                    matched > tick_of(&ix, 200),
                    "shape {shape}: a match after load"
                );
            }
            ix.check_invariants().unwrap();
        }
    }
}

/// cargo-mutants survivor (shard 39/40): `k < c.hashes.len()` → `k > …` in `match_into` went on
/// into a run's children after a query left the run part-way, so a query that diverged there on a
/// hash the tree holds deeper (the first block of one of the run's children) was credited with
/// blocks past its divergence. For the class — a worker's answer is the longest *leading* run of
/// the query it holds, whatever else the tree holds — queries that follow a stored chain for a
/// while and then jump to a hash held anywhere in the tree (deeper on the same branch, on another
/// branch, at the root), against a reference of each worker's held prefixes.
#[test]
fn a_match_counts_only_the_leading_blocks_whatever_the_tree_holds_elsewhere() {
    use std::collections::{HashMap, HashSet};

    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut draw = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for round in 0..40 {
        // A trie of unique block hashes (node k's hash: 1000 + k), 3 children per node at most.
        let mut children: Vec<Vec<usize>> = vec![Vec::new()];
        let mut path_of: Vec<Vec<u64>> = vec![Vec::new()];
        let mut ix = PrefixIndex::new(None).unwrap();
        let mut held: HashMap<&str, HashSet<Vec<u64>>> = HashMap::new();
        let workers = ["a", "b", "c"];
        for _ in 0..12 {
            // A chain from the root: at each level an existing child or a new one.
            let (mut node, depth) = (0usize, 1 + draw(8) as usize);
            for _ in 0..depth {
                let kids = &children[node];
                node = if !kids.is_empty() && (kids.len() == 3 || draw(2) == 0) {
                    kids[draw(kids.len() as u64) as usize]
                } else {
                    let id = path_of.len();
                    let mut path = path_of[node].clone();
                    path.push(1000 + id as u64);
                    path_of.push(path);
                    children.push(Vec::new());
                    children[node].push(id);
                    id
                };
            }
            let w = workers[draw(3) as usize];
            let chain = path_of[node].clone();
            ix.store(w, &chain, None).unwrap();
            let set = held.entry(w).or_default();
            for k in 1..=chain.len() {
                set.insert(chain[..k].to_vec());
            }
        }
        let all: Vec<u64> = path_of.iter().filter_map(|p| p.last().copied()).collect();
        for q in 0..60 {
            let along = &path_of[1 + draw(path_of.len() as u64 - 1) as usize];
            let mut query = along[..draw(along.len() as u64 + 1) as usize].to_vec();
            for _ in 0..1 + draw(3) {
                query.push(all[draw(all.len() as u64) as usize]);
            }
            let mut expected: Vec<(String, u32)> = workers
                .iter()
                .filter_map(|&w| {
                    let set = held.get(w)?;
                    let n = (1..=query.len())
                        .take_while(|&k| set.contains(&query[..k]))
                        .count();
                    (n > 0).then(|| (w.to_owned(), n as u32))
                })
                .collect();
            expected.sort();
            let mut got: Vec<(String, u32)> = ix
                .match_names(&query)
                .into_iter()
                .map(|(w, n)| (w.to_string(), n))
                .collect();
            got.sort();
            assert_eq!(got, expected, "round {round}, query {q}: {query:?}");
        }
    }
}
