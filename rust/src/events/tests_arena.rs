//! The pages' token arena (`pages.rs`): every live page keeps its tokens through compactions,
//! and the arena compacts exactly by its documented rule. A child module of `tests`.

use std::collections::HashMap;

use super::super::pages::{Cursor, Pages};

/// The arena holds the live pages' tokens plus the dead ones, and those never exceed the larger
/// of 4,096 and the live ones.
fn assert_bounded(pages: &Pages, live: &HashMap<u64, Vec<u32>>) {
    let held: usize = live.values().map(Vec::len).sum();
    assert_eq!(pages.tokens.len(), held + pages.dead);
    assert!(
        pages.dead <= held.max(4096),
        "{} dead, {held} live",
        pages.dead
    );
}

/// Pages stored and forgotten in bulk: every live page keeps its own tokens through the
/// compactions, the arena holds the live tokens plus the dead ones not yet compacted away, and
/// those never exceed the larger of 4,096 and the live ones.
#[test]
fn the_arena_keeps_each_pages_tokens_and_stays_bounded() {
    let mut pages = Pages::default();
    let mut live: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut compactions = 0;
    for round in 0..60u64 {
        for i in 0..100u64 {
            let h = round * 1000 + i;
            let tokens: Vec<u32> = (0..(1 + i % 4)).map(|k| (h * 7 + k) as u32).collect();
            let at = Cursor {
                prev: None,
                filled: tokens.len(),
                salted: false,
            };
            assert!(pages.insert(h, at, &tokens));
            live.insert(h, tokens);
        }
        let mut gone: Vec<u64> = live.keys().copied().filter(|h| h % 10 != 0).collect();
        gone.sort_unstable();
        for h in gone {
            let before = pages.tokens.len();
            assert!(pages.remove(h));
            assert!(!pages.remove(h), "removed once");
            compactions += usize::from(pages.tokens.len() < before);
            live.remove(&h);
            assert_bounded(&pages, &live);
        }
        for (h, tokens) in &live {
            let page = pages.map[h];
            let (at, len) = (page.at as usize, page.len as usize);
            assert_eq!(&pages.tokens[at..at + len], &tokens[..], "page {h}");
        }
    }
    assert!(compactions > 0);
    // Then more live tokens than 4,096, most of them forgotten: compacted past 4,096 too.
    for i in 0..4000u64 {
        let h = 1_000_000 + i;
        let tokens = vec![i as u32; 4];
        let at = Cursor {
            prev: None,
            filled: 4,
            salted: false,
        };
        assert!(pages.insert(h, at, &tokens));
        live.insert(h, tokens);
    }
    for h in 1_000_000..1_003_000u64 {
        assert!(pages.remove(h));
        live.remove(&h);
        assert_bounded(&pages, &live);
    }
    for h in live.keys().copied().collect::<Vec<_>>() {
        assert!(pages.remove(h));
    }
    assert!(pages.is_empty() && pages.tokens.is_empty() && pages.dead == 0);
}

/// The compaction rule at its bounds, against a model of the documented rule: after a page is
/// forgotten the arena is rewritten with the live pages' tokens only when more than 4,096 of
/// its tokens are dead *and* more than half of them (an emptied map clears it). Each case
/// sits on one side of a bound; then a long drawn sequence of pages of sizes around the bounds
/// (some replacing a page of the same hash), checked after every step.
#[test]
fn the_arena_compacts_exactly_when_over_4096_and_over_half_its_tokens_are_dead() {
    struct Model {
        live: HashMap<u64, Vec<u32>>,
        len: usize,
        dead: usize,
    }
    impl Model {
        fn forget(&mut self, h: u64) {
            let Some(tokens) = self.live.remove(&h) else {
                return;
            };
            self.dead += tokens.len();
            if self.live.is_empty() {
                (self.len, self.dead) = (0, 0);
            } else if self.dead > 4096 && 2 * self.dead > self.len {
                (self.len, self.dead) = (self.live.values().map(Vec::len).sum(), 0);
            }
        }
    }
    fn check(pages: &Pages, model: &Model, what: &str) {
        assert_eq!(
            (pages.tokens.len(), pages.dead, pages.map.len()),
            (model.len, model.dead, model.live.len()),
            "{what}"
        );
        for (h, tokens) in &model.live {
            let page = pages.map[h];
            let (at, len) = (page.at as usize, page.len as usize);
            assert_eq!(&pages.tokens[at..at + len], &tokens[..], "{what}: page {h}");
        }
    }
    /// (insert or forget, hash, tokens)
    type Op = (bool, u64, usize);
    fn step(pages: &mut Pages, model: &mut Model, op: Op, what: &str) {
        let (insert, h, len) = op;
        if insert {
            let tokens: Vec<u32> = (0..len).map(|k| (h as u32) ^ ((k as u32) << 8)).collect();
            let at = Cursor {
                prev: None,
                filled: len,
                salted: false,
            };
            assert!(pages.insert(h, at, &tokens), "{what}");
            model.forget(h); // insert forgets a page of the same hash first
            model.len += len;
            model.live.insert(h, tokens);
        } else {
            assert_eq!(pages.remove(h), model.live.contains_key(&h), "{what}");
            model.forget(h);
        }
        check(pages, model, what);
    }
    let (put, drop) = (|h, len| (true, h, len), |h| (false, h, 0));
    let cases: Vec<(&str, Vec<Op>)> = vec![
        (
            "4,096 dead of 4,097: not over 4,096",
            vec![put(1, 4096), put(2, 1), drop(1)],
        ),
        (
            "4,097 dead of 4,098",
            vec![put(1, 4097), put(2, 1), drop(1)],
        ),
        (
            "4,096 dead in two pages",
            vec![put(1, 2048), put(2, 2048), put(3, 1), drop(1), drop(2)],
        ),
        (
            "4,097 dead in two pages",
            vec![put(1, 2048), put(2, 2049), put(3, 1), drop(2), drop(1)],
        ),
        (
            "half dead: not over half",
            vec![put(1, 5000), put(2, 5000), drop(1)],
        ),
        (
            "just over half dead",
            vec![put(1, 5001), put(2, 5000), drop(1)],
        ),
        (
            "over 4,096 dead, under half",
            vec![put(1, 5000), put(2, 6000), drop(1)],
        ),
        ("over half dead, few", vec![put(1, 10), put(2, 1), drop(1)]),
        (
            "a page replaced by its hash",
            vec![put(1, 4097), put(2, 1), put(1, 3)],
        ),
        (
            "a replacement at half",
            vec![put(1, 5000), put(2, 5000), put(1, 7)],
        ),
        (
            "emptied",
            vec![put(1, 5), put(2, 6), drop(2), drop(1), put(3, 2)],
        ),
        (
            "gone twice",
            vec![put(1, 5000), put(2, 1), drop(1), drop(1), drop(7)],
        ),
    ];
    for (what, ops) in cases {
        let mut pages = Pages::default();
        let mut model = Model {
            live: HashMap::new(),
            len: 0,
            dead: 0,
        };
        for op in ops {
            step(&mut pages, &mut model, op, what);
        }
    }
    let sizes = [1, 2, 3, 1024, 2047, 2048, 2049, 4095, 4096, 4097, 5000];
    let mut pages = Pages::default();
    let mut model = Model {
        live: HashMap::new(),
        len: 0,
        dead: 0,
    };
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for i in 0..3000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let h = x % 24; // few hashes: many replacements and removals of pages held
        let op = match (x >> 8) % 3 {
            0 => drop(h),
            _ => put(h, sizes[((x >> 16) % sizes.len() as u64) as usize]),
        };
        step(&mut pages, &mut model, op, &format!("draw {i}"));
    }
}

impl Pages {
    /// Test-only: pads the arena to `len` tokens that no page holds (counted dead), with room
    /// for `capacity`, without touching them — `vec![0; n]` is calloc'd, so the padding costs
    /// address space, not memory — so a test can take an insert to the arena's bound (`u32`
    /// offsets: 4 Gi tokens) without 16 GiB of pages. `None`, changing nothing, when the
    /// address space is not there (checked first with a reservation that touches nothing).
    pub(in crate::events) fn pad_arena(&mut self, len: usize, capacity: usize) -> Option<()> {
        let mut probe: Vec<u32> = Vec::new();
        probe.try_reserve_exact(capacity).ok()?;
        drop(probe);
        let mut tokens = vec![0; capacity];
        tokens
            .get_mut(..self.tokens.len())?
            .copy_from_slice(&self.tokens);
        tokens.truncate(len);
        self.dead += len.checked_sub(self.tokens.len())?;
        self.tokens = tokens;
        Some(())
    }
}
