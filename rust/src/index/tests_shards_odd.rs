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
