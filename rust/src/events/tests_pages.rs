//! Engine pages smaller than the router's block (`pages`), against a reference: an engine that
//! emits events as SGLang's radix cache does (one `BlockStored` per page, `block_size` the
//! page's length, each page's parent the one before; removals leaf first), and the rule that the
//! index holds a request's first `m` router blocks exactly when the engine holds every page of
//! them. A child module of `tests`, sharing its payload writer.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

use super::*;

/// SplitMix64: the tests' deterministic draws.
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn hashes(tokens: &[u64], block: usize, profile: Profile, salt: Option<&str>) -> Vec<u64> {
    let options = Options {
        salt: salt.map(str::to_owned),
        ..Options::default()
    };
    let h = BlockHasher::new(block, profile, options).expect("hasher");
    let mut out = Vec::new();
    h.hash_into(tokens, &ChainState::Root, &[], &mut out)
        .expect("hash");
    out
}

/// An engine holding pages of `page` tokens, SGLang's way: page hashes chained per salt, a
/// page's parent the page before it, eviction of leaf pages only.
struct Engine {
    page: usize,
    /// Held page → (its parent, how many held pages have it as parent).
    held: HashMap<u64, (Option<u64>, usize)>,
}

impl Engine {
    /// The events of caching `tokens` (cut to whole pages): one `BlockStored` per new page.
    fn insert(&mut self, w: &mut W, tokens: &[u64], salt: Option<&str>) -> usize {
        let pages = hashes(tokens, self.page, Profile::Sglang, salt);
        let mut events = 0;
        let mut parent = None;
        for (i, &h) in pages.iter().enumerate() {
            if let Entry::Vacant(slot) = self.held.entry(h) {
                slot.insert((parent, 0));
                if let Some(p) = parent {
                    self.held.get_mut(&p).expect("parent held").1 += 1;
                }
                let page = &tokens[i * self.page..(i + 1) * self.page];
                let e = Ev {
                    hashes: &[h],
                    parent,
                    tokens: page,
                    block_size: self.page as u64,
                    medium: None,
                };
                match salt {
                    // SGLang names a salted request's salt on each of its stores.
                    Some(s) => stored_with(w, &e, |more| {
                        more.s("cache_salt").s(s);
                        1
                    }),
                    None => stored(w, &e),
                }
                events += 1;
            }
            parent = Some(h);
        }
        events
    }

    /// Evicts up to `n` leaf pages (one `BlockRemoved` naming them); returns the events written.
    fn evict(&mut self, w: &mut W, n: usize, draw: &mut Draw) -> usize {
        let mut gone = Vec::new();
        for _ in 0..n {
            let mut leaves: Vec<u64> = self
                .held
                .iter()
                .filter(|(_, &(_, children))| children == 0)
                .map(|(&h, _)| h)
                .collect();
            if leaves.is_empty() {
                break;
            }
            leaves.sort_unstable();
            let h = leaves[draw.below(leaves.len())];
            let (parent, _) = self.held.remove(&h).expect("leaf");
            if let Some(p) = parent {
                self.held.get_mut(&p).expect("parent").1 -= 1;
            }
            gone.push(h);
        }
        if gone.is_empty() {
            return 0;
        }
        removed(w, &gone, None);
        1
    }

    /// Tokens of `tokens`' longest prefix whose every page is held.
    fn held_prefix(&self, tokens: &[u64], salt: Option<&str>) -> usize {
        let pages = hashes(tokens, self.page, Profile::Sglang, salt);
        pages
            .iter()
            .take_while(|h| self.held.contains_key(h))
            .count()
            * self.page
    }
}

/// Requests drawn from a few shared prefixes (system prompts, documents) and random tails, some
/// salted; after each insertion or eviction every request seen is matched against the rule.
fn follow_engine(page: usize, router: usize, profile: Profile, seed: u64) {
    let mut draw = Draw(seed);
    let index = shared();
    let config = Config {
        block_size: router,
        profile,
        ..Config::default()
    };
    let mut a = Applier::new(index.clone(), config).expect("applier");
    let mut engine = Engine {
        page,
        held: HashMap::new(),
    };
    let prefixes: Vec<Vec<u64>> = (0..3)
        .map(|p| (0..(5 + 13 * p)).map(|t| (t * 7 + p) as u64 % 11).collect())
        .collect();
    let mut seen: Vec<(Vec<u64>, Option<&str>)> = Vec::new();
    for step in 0..60 {
        let payload = if step % 3 == 2 {
            batch(|w| engine.evict(w, 1 + draw.below(12), &mut draw))
        } else {
            let mut tokens = prefixes[draw.below(prefixes.len())].clone();
            let tail = draw.below(40);
            tokens.extend((0..tail).map(|_| draw.below(5) as u64));
            let salt = (draw.below(4) == 0).then_some("tenant-a");
            let tokens = tokens[..tokens.len() / page * page].to_vec();
            seen.push((tokens.clone(), salt));
            batch(|w| engine.insert(w, &tokens, salt))
        };
        a.apply("w", &payload).expect("apply");
        for (tokens, salt) in &seen {
            let own = hashes(tokens, router, profile, *salt);
            let want = (engine.held_prefix(tokens, *salt) / router) as u32;
            assert_eq!(
                matched(&index, &own, "w"),
                want,
                "page {page}, router {router}, {profile:?}, step {step}, salt {salt:?}: {tokens:?} {:?}",
                a.counters("w")
            );
        }
    }
    let c = a.counters("w").expect("counters");
    assert_eq!(
        (
            c.skipped_partial,
            c.skipped_unknown_parent,
            c.skipped_unsupported
        ),
        (0, 0, 0)
    );
    assert_eq!(c.index_rejected, 0);
    assert_eq!(c.engine_block_size, page as u64);
}

#[test]
fn pages_smaller_than_the_router_block_index_exactly_the_blocks_the_engine_holds() {
    for (page, router) in [(1, 16), (2, 16), (4, 16), (8, 16), (1, 4), (16, 64)] {
        let vllm = Profile::Vllm(Default::default());
        for profile in [Profile::Native, Profile::Sglang, vllm] {
            for seed in 0..3 {
                follow_engine(page, router, profile, seed);
            }
        }
    }
}

#[test]
fn a_page_shorter_than_the_engines_is_a_partial_block() {
    let tokens: Vec<u64> = (0..16).collect();
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    // Pages of 4: three whole ones, then SGLang's short last page (2 tokens, `block_size` 2):
    // skipped, and the chain never completes a router block.
    let p = batch(|w| {
        for (i, chunk) in tokens[..14].chunks(4).enumerate() {
            let parent = i.checked_sub(1).map(|p| p as u64 + 100);
            let e = Ev {
                hashes: &[i as u64 + 100],
                parent,
                tokens: chunk,
                block_size: chunk.len() as u64,
                medium: None,
            };
            stored(w, &e);
        }
        4
    });
    a.apply("w", &p).expect("apply");
    let c = a.counters("w").expect("counters");
    assert_eq!((c.blocks_stored, c.skipped_partial), (3, 1));
    assert_eq!(matched(&index, &own_hashes(&tokens, 16), "w"), 0);
    // The last whole page completes the block.
    let last = batch(|w| {
        let e = Ev {
            hashes: &[103],
            parent: Some(102),
            tokens: &tokens[12..],
            block_size: 4,
            medium: None,
        };
        stored(w, &e);
        1
    });
    a.apply("w", &last).expect("apply");
    assert_eq!(matched(&index, &own_hashes(&tokens, 16), "w"), 1);
    // Removing a page inside the block forgets it: a child of it has an unknown parent.
    a.apply(
        "w",
        &batch(|w| {
            removed(w, &[103], None);
            removed(w, &[102], None);
            2
        }),
    )
    .expect("apply");
    assert_eq!(matched(&index, &own_hashes(&tokens, 16), "w"), 0);
    a.apply("w", &last).expect("apply");
    let c = a.counters("w").expect("counters");
    assert_eq!((c.blocks_stored, c.skipped_unknown_parent), (4, 1));
    assert_eq!(matched(&index, &own_hashes(&tokens, 16), "w"), 0);
}

#[test]
fn pages_in_direct_mode_or_not_dividing_the_router_block_are_skipped() {
    let tokens: Vec<u64> = (0..16).collect();
    for (mode, page) in [(Mode::Direct, 4usize), (Mode::Rehash, 3), (Mode::Rehash, 5)] {
        let index = shared();
        let config = Config {
            mode,
            ..Config::default()
        };
        let mut a = Applier::new(index.clone(), config).expect("applier");
        let n = 16 / page;
        let p = batch(|w| {
            for i in 0..n {
                let e = Ev {
                    hashes: &[i as u64 + 1],
                    parent: i.checked_sub(1).map(|p| p as u64 + 1),
                    tokens: &tokens[i * page..(i + 1) * page],
                    block_size: page as u64,
                    medium: None,
                };
                stored(w, &e);
            }
            n
        });
        a.apply("w", &p).expect("apply");
        let c = a.counters("w").expect("counters");
        assert_eq!(
            (c.blocks_stored, c.skipped_partial),
            (0, n as u64),
            "{mode} {page}"
        );
        assert!(index.read().is_empty(), "{mode} {page}");
    }
}

#[test]
fn a_salted_chain_needs_its_salt_where_its_first_block_completes() {
    let tokens: Vec<u64> = (0..32).collect();
    let salted = hashes(&tokens, 16, Profile::Native, Some("s"));
    // vLLM's way: the salt on the root store's extra keys only; the block completes in a later
    // payload whose store does not name it, so the chain's first block is skipped.
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let root = batch(|w| {
        let e = Ev {
            hashes: &[1],
            parent: None,
            tokens: &tokens[..8],
            block_size: 8,
            medium: None,
        };
        stored_with(w, &e, |more| {
            more.s("extra_keys").arr(1).arr(1).s("s");
            1
        });
        1
    });
    a.apply("w", &root).expect("apply");
    let next = batch(|w| {
        let e = Ev {
            hashes: &[2],
            parent: Some(1),
            tokens: &tokens[8..16],
            block_size: 8,
            medium: None,
        };
        stored(w, &e);
        1
    });
    a.apply("w", &next).expect("apply");
    let c = a.counters("w").expect("counters");
    assert_eq!((c.blocks_stored, c.skipped_unsupported), (1, 1));
    assert_eq!(matched(&index, &salted, "w"), 0);
    // The same chain stored whole by its root: the salt seeds the block it completes.
    let whole = batch(|w| {
        let e = Ev {
            hashes: &[1, 2, 3, 4],
            parent: None,
            tokens: &tokens,
            block_size: 8,
            medium: None,
        };
        stored_with(w, &e, |more| {
            more.s("extra_keys").arr(4).arr(1).s("s").nil().nil().nil();
            1
        });
        1
    });
    a.apply("w", &whole).expect("apply");
    assert_eq!(matched(&index, &salted, "w"), 2);
    let plain = hashes(&tokens, 16, Profile::Native, None);
    assert_eq!(
        matched(&index, &plain, "w"),
        0,
        "a salted chain is not the plain one"
    );
}

#[test]
fn a_clear_forgets_pages_and_the_arena_survives_many_removals() {
    let mut draw = Draw(7);
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let mut engine = Engine {
        page: 1,
        held: HashMap::new(),
    };
    let mut all = HashSet::new();
    // Many short chains stored and evicted: the arena is compacted along the way, and every
    // chain still held matches as the rule says.
    for round in 0..40 {
        let tokens: Vec<u64> = (0..(16 + draw.below(40)))
            .map(|_| draw.below(3) as u64)
            .collect();
        all.insert(tokens.clone());
        a.apply("w", &batch(|w| engine.insert(w, &tokens, None)))
            .expect("apply");
        if round % 2 == 1 {
            a.apply("w", &batch(|w| engine.evict(w, 200, &mut draw)))
                .expect("apply");
        }
        for t in &all {
            let want = (engine.held_prefix(t, None) / 16) as u32;
            assert_eq!(matched(&index, &own_hashes(t, 16), "w"), want, "{t:?}");
        }
    }
    a.clear_worker("w");
    for t in &all {
        assert_eq!(matched(&index, &own_hashes(t, 16), "w"), 0);
    }
    // After a clear, a child of a page held before it has an unknown parent.
    let some = all.iter().next().expect("a chain").clone();
    let pages = hashes(&some, 1, Profile::Sglang, None);
    let p = batch(|w| {
        let e = Ev {
            hashes: &[pages[1]],
            parent: Some(pages[0]),
            tokens: &some[1..2],
            block_size: 1,
            medium: None,
        };
        stored(w, &e);
        1
    });
    a.apply("w", &p).expect("apply");
    assert_eq!(a.counters("w").expect("c").skipped_unknown_parent, 1);
}

/// Each way a page store is skipped, counted where it happens: a store the router cannot rehash
/// (lookahead tokens), an index that cannot register the worker, a block whose earlier page went
/// out of order (the walk back finds it gone).
#[test]
fn every_skip_of_the_pages_path_is_counted() {
    let tokens: Vec<u64> = (0..16).collect();
    let page = |w: &mut W, i: usize, lookahead: bool| {
        let e = Ev {
            hashes: &[i as u64 + 1],
            parent: i.checked_sub(1).map(|p| p as u64 + 1),
            tokens: &tokens[i * 4..(i + 1) * 4],
            block_size: 4,
            medium: None,
        };
        match lookahead {
            true => stored_with(w, &e, |more| {
                more.s("lookahead_token_ids").arr(1).ints(&[99]);
                1
            }),
            false => stored(w, &e),
        }
    };
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    a.apply(
        "w",
        &batch(|w| {
            page(w, 0, false);
            page(w, 1, true); // lookahead: skipped, its child has no parent
            page(w, 2, false);
            3
        }),
    )
    .expect("apply");
    let c = a.counters("w").expect("counters");
    assert_eq!(
        (
            c.blocks_stored,
            c.skipped_unsupported,
            c.skipped_unknown_parent
        ),
        (1, 1, 1)
    );
    // Out of order: page 1 forgotten while page 2 stays; page 3 then finds the walk broken.
    a.apply(
        "w",
        &batch(|w| {
            page(w, 1, false);
            page(w, 2, false);
            removed(w, &[2], None);
            page(w, 3, false);
            4
        }),
    )
    .expect("apply");
    let c = a.counters("w").expect("counters");
    assert_eq!((c.blocks_stored, c.skipped_unknown_parent), (3, 2));
    assert_eq!(matched(&index, &own_hashes(&tokens, 16), "w"), 0);
    // An index too small to register the worker refuses every store.
    let tiny = Arc::new(RwLock::new(PrefixIndex::new(Some(440)).expect("index")));
    let mut a = Applier::new(tiny, Config::default()).expect("applier");
    a.apply(
        "w",
        &batch(|w| {
            page(w, 0, false);
            1
        }),
    )
    .expect("apply");
    let c = a.counters("w").expect("counters");
    assert_eq!((c.blocks_stored, c.index_rejected), (0, 1));
}

/// An engine hash first stored as a block of two router blocks, then (other tokens, pages of
/// 4) as the page completing a router block: its removal drops the block it now stands for.
#[test]
fn a_hash_reused_as_a_completing_page_is_removed_as_that_page() {
    let old: Vec<u64> = (100..132).collect();
    let new: Vec<u64> = (0..16).collect();
    let index = shared();
    let mut a = Applier::new(index, Config::default()).expect("applier");
    let cpu = Some("CPU"); // no GPU block size: pages of 4 after a block of 32 are not partial
    a.apply(
        "w",
        &batch(|w| {
            let e = Ev {
                hashes: &[7],
                parent: None,
                tokens: &old,
                block_size: 32,
                medium: cpu,
            };
            stored(w, &e);
            for i in 0..4usize {
                let e = Ev {
                    hashes: &[if i == 3 { 7 } else { 50 + i as u64 }],
                    parent: i.checked_sub(1).map(|p| 50 + p as u64),
                    tokens: &new[i * 4..(i + 1) * 4],
                    block_size: 4,
                    medium: cpu,
                };
                stored(w, &e);
            }
            5
        }),
    )
    .expect("apply");
    let tier = a.tier_index("CPU").expect("CPU tier");
    assert_eq!(matched(&tier, &own_hashes(&new, 16), "w"), 1);
    assert_eq!(matched(&tier, &own_hashes(&old, 16), "w"), 2);
    a.apply(
        "w",
        &batch(|w| {
            removed(w, &[7], cpu);
            1
        }),
    )
    .expect("apply");
    assert_eq!(matched(&tier, &own_hashes(&new, 16), "w"), 0);
}

/// A block whose parent the index has evicted under its memory budget is refused by the index:
/// counted as `index_rejected`, the pages before it kept.
#[test]
fn a_block_whose_parent_the_index_evicted_is_counted_rejected() {
    let index = Arc::new(RwLock::new(
        PrefixIndex::new(Some(16 << 10)).expect("index"),
    ));
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let tokens: Vec<u64> = (0..32).collect();
    let pages = |first: usize, last: usize| {
        batch(|w| {
            for i in first..last {
                let e = Ev {
                    hashes: &[i as u64 + 1],
                    parent: i.checked_sub(1).map(|p| p as u64 + 1),
                    tokens: &tokens[i * 4..(i + 1) * 4],
                    block_size: 4,
                    medium: None,
                };
                stored(w, &e);
            }
            last - first
        })
    };
    a.apply("w", &pages(0, 7)).expect("apply"); // block 0, and 3 pages of block 1
    assert_eq!(matched(&index, &own_hashes(&tokens, 16), "w"), 1);
    // Other prompts' blocks until the index has evicted block 0.
    let first = own_hashes(&tokens, 16)[0];
    let mut n = 1000u64;
    while index.read().contains(first) {
        // A 16-token root of 4 pages of 4 (the engine's page size stays 4).
        let other: Vec<u64> = (n..n + 16).collect();
        let filler = batch(|w| {
            for (i, chunk) in other.chunks(4).enumerate() {
                let i = i as u64;
                let e = Ev {
                    hashes: &[n + i],
                    parent: i.checked_sub(1).map(|p| n + p),
                    tokens: chunk,
                    block_size: 4,
                    medium: None,
                };
                stored(w, &e);
            }
            4
        });
        a.apply("w", &filler).expect("apply");
        n += 16;
        assert!(n < 1_000_000, "the index never evicted block 0");
    }
    let before = a.counters("w").expect("counters");
    a.apply("w", &pages(7, 8)).expect("apply");
    let c = a.counters("w").expect("counters");
    assert_eq!(
        c.index_rejected,
        before.index_rejected + 1,
        "{before:?} {c:?}"
    );
    assert_eq!(c.blocks_stored, before.blocks_stored);
}

/// The arena of pages' tokens is addressed by `u32` offsets, so it holds at most `u32::MAX`
/// tokens (`Pages::insert`: "false when the arena is full (4 Gi tokens), which skips the
/// page"): a page that would end past that is refused, its store counted once as unsupported
/// and the store's later pages skipped; one ending exactly there is kept, and the router block
/// pages at the top of the arena complete is indexed with their tokens. The arena is padded
/// with tokens no page holds (`Pages::pad_arena`: address space, no memory) after the chain's
/// root page, each case on either side of the bound and at the two ways past it (the arena's
/// length itself past `u32`, its end past `u32`).
#[test]
fn a_page_past_the_arenas_u32_offsets_is_refused_and_counted_once() {
    const MAX: usize = u32::MAX as usize;
    let tokens: Vec<u64> = (0..16).collect();
    // Pages of 4 under the router's block of 16: pages 1 to 3 wait in the arena, 4 completes.
    // `pages` pages from page `from` (0-based) in one store.
    let store = |w: &mut W, from: usize, pages: usize| {
        let hashes: Vec<u64> = (from..from + pages).map(|i| i as u64 + 1).collect();
        let e = Ev {
            hashes: &hashes,
            parent: from.checked_sub(1).map(|p| p as u64 + 1),
            tokens: &tokens[from * 4..(from + pages) * 4],
            block_size: 4,
            medium: None,
        };
        stored(w, &e);
        1
    };
    // (arena length after the padding, pages 2 and 3 kept): each kept page adds 4 tokens.
    for (len, kept) in [
        (MAX - 8, 2),
        (MAX - 7, 1),
        (MAX - 4, 1),
        (MAX - 3, 0),
        (MAX, 0),
        (MAX + 1, 0),
    ] {
        let index = shared();
        let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
        a.apply("w", &batch(|w| store(w, 0, 1))).expect("apply");
        let pages = a.pages_mut("w", 0).expect("the worker's GPU pages");
        if pages.pad_arena(len, len + 8).is_none() {
            eprintln!("skipped: no 16 GiB of address space for the arena of {len} tokens");
            return;
        }
        // One store of pages 2 and 3: refused at the first that would pass the bound, and the
        // rest of the store with it.
        a.apply("w", &batch(|w| store(w, 1, 2))).expect("apply");
        let c = a.counters("w").expect("counters");
        let refused = u64::from(kept < 2);
        assert_eq!(
            (c.blocks_stored, c.skipped_unsupported),
            (1 + kept, refused),
            "arena of {len} tokens"
        );
        // Page 4 completes the block from the kept pages' tokens, or finds its parent missing.
        a.apply("w", &batch(|w| store(w, 3, 1))).expect("apply");
        let c = a.counters("w").expect("counters");
        let complete = kept == 2;
        assert_eq!(
            (
                c.blocks_stored,
                c.skipped_unknown_parent,
                c.skipped_unsupported
            ),
            (
                1 + kept + u64::from(complete),
                u64::from(!complete),
                refused
            ),
            "arena of {len} tokens"
        );
        let want = u32::from(complete);
        assert_eq!(
            matched(&index, &own_hashes(&tokens, 16), "w"),
            want,
            "arena of {len}"
        );
    }
}
