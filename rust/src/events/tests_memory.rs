//! The memory rule of the module docs: each worker's per-tier maps hold one entry per engine
//! block the worker holds, and removals and clears prune them. `links` names every engine block
//! that ends a router block, `firsts` those spanning several router blocks, `digests` (digest
//! profiles) the same blocks as `links`, and `pages` the engine pages that do not complete a
//! router block. The reference is an engine model that stores chains under held blocks, evicts
//! leaf first (several blocks to a `BlockRemoved`, several events to a batch) and clears, on the
//! GPU and a CPU tier; the maps are read back after every batch (`tests_state.rs`). A child
//! module of `tests`, sharing its payload writer.

use std::collections::HashMap;

use super::*;
use crate::events::apply::state::MapKeys;

const ROUTER: usize = 16;

/// SplitMix64: the test's deterministic draws.
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

/// A held engine block: its depth in its chain (1 for a root), its parent and how many held
/// blocks have it as parent.
struct Block {
    depth: usize,
    parent: Option<u64>,
    children: usize,
}

/// An engine of `size`-token blocks holding, per tier (GPU, CPU), chains of blocks.
struct Engine {
    size: usize,
    next: u64,
    tiers: [HashMap<u64, Block>; 2],
}

/// A tier's medium as the engine names it (`None` and `"GPU"` are the GPU tier).
fn medium(draw: &mut Draw) -> (usize, Option<&'static str>) {
    match draw.below(3) {
        0 => (0, None),
        1 => (0, Some("GPU")),
        _ => (1, Some("CPU")),
    }
}

fn sorted_keys<'a>(blocks: impl Iterator<Item = (&'a u64, &'a Block)>) -> Vec<u64> {
    let mut keys: Vec<u64> = blocks.map(|(&h, _)| h).collect();
    keys.sort_unstable();
    keys
}

impl Engine {
    /// One `BlockStored` of 1 to 3 new blocks, at a root or under a held block.
    fn store(&mut self, w: &mut W, draw: &mut Draw) -> usize {
        let (tier, medium) = medium(draw);
        let held = &mut self.tiers[tier];
        let keys = sorted_keys(held.iter());
        let parent = match draw.below(4) {
            0 => None,
            _ => keys.get(draw.below(keys.len().max(1))).copied(),
        };
        let n = 1 + draw.below(3);
        let hashes: Vec<u64> = (0..n as u64).map(|i| self.next + i).collect();
        self.next += n as u64;
        let tokens: Vec<u64> = (0..n * self.size)
            .map(|_| draw.below(1000) as u64)
            .collect();
        let first = parent.map_or(0, |p| held[&p].depth) + 1;
        let mut up = parent;
        for (depth, &h) in (first..).zip(&hashes) {
            if let Some(p) = up {
                held.get_mut(&p).expect("parent held").children += 1;
            }
            let block = Block {
                depth,
                parent: up,
                children: 0,
            };
            held.insert(h, block);
            up = Some(h);
        }
        let e = Ev {
            hashes: &hashes,
            parent,
            tokens: &tokens,
            block_size: self.size as u64,
            medium,
        };
        stored(w, &e);
        1
    }

    /// One `BlockRemoved` of up to 3 leaf blocks, evicted one after another.
    fn evict(&mut self, w: &mut W, draw: &mut Draw) -> usize {
        let (tier, medium) = medium(draw);
        let held = &mut self.tiers[tier];
        let mut gone = Vec::new();
        for _ in 0..1 + draw.below(3) {
            let leaves = sorted_keys(held.iter().filter(|(_, b)| b.children == 0));
            if leaves.is_empty() {
                break;
            }
            let h = leaves[draw.below(leaves.len())];
            let block = held.remove(&h).expect("leaf");
            if let Some(p) = block.parent {
                held.get_mut(&p).expect("parent held").children -= 1;
            }
            gone.push(h);
        }
        removed(w, &gone, medium);
        1
    }

    fn clear(&mut self, w: &mut W) -> usize {
        w.map(1).s("type").s("AllBlocksCleared");
        self.tiers.iter_mut().for_each(HashMap::clear);
        1
    }

    /// What the rule says tier `tier`'s maps hold.
    fn expected(&self, tier: usize, digests: bool) -> MapKeys {
        let held = &self.tiers[tier];
        let ends = |b: &Block| self.size >= ROUTER || (b.depth * self.size).is_multiple_of(ROUTER);
        let links = sorted_keys(held.iter().filter(|(_, b)| ends(b)));
        MapKeys {
            firsts: match self.size > ROUTER {
                true => links.clone(),
                false => Vec::new(),
            },
            digests: match digests {
                true => links.clone(),
                false => Vec::new(),
            },
            pages_empty: links.len() == held.len(),
            links,
        }
    }
}

fn empty() -> MapKeys {
    MapKeys {
        links: Vec::new(),
        firsts: Vec::new(),
        digests: Vec::new(),
        pages_empty: true,
    }
}

#[test]
fn the_per_worker_maps_hold_exactly_the_engine_blocks_held() {
    let vllm = Profile::Vllm(Default::default());
    for profile in [Profile::Native, Profile::Sglang, vllm] {
        // Pages of half a router block, blocks of one and of two router blocks.
        for size in [ROUTER / 2, ROUTER, 2 * ROUTER] {
            let config = Config {
                profile,
                ..Config::default()
            };
            let mut a = Applier::new(shared(), config).expect("applier");
            let mut engine = Engine {
                size,
                next: 1 << 20,
                tiers: [HashMap::new(), HashMap::new()],
            };
            let mut draw = Draw(size as u64);
            let (mut evicted, mut most) = (0, 0);
            for step in 0..400 {
                let what = format!("{profile} blocks of {size}, batch {step}");
                let payload = batch(|w| {
                    (0..1 + draw.below(4))
                        .map(|_| match draw.below(20) {
                            0 => engine.clear(w),
                            1..=10 => engine.store(w, &mut draw),
                            _ => {
                                evicted += 1;
                                engine.evict(w, &mut draw)
                            }
                        })
                        .sum()
                });
                a.apply("w", &payload).expect(&what);
                let c = a.counters("w").expect("counters");
                assert_eq!(
                    (c.skipped_unknown_parent, c.skipped_unsupported),
                    (0, 0),
                    "{what}"
                );
                let keys = a.map_keys("w");
                let none = empty();
                for tier in 0..2 {
                    let got = keys.get(tier).unwrap_or(&none);
                    let want = engine.expected(tier, profile.chains_on_digest());
                    assert_eq!(got, &want, "{what}, tier {tier}");
                    most = most.max(want.links.len());
                }
            }
            assert!(evicted > 100 && most > 10, "the workload evicts and holds");
            a.clear_worker("w");
            for keys in a.map_keys("w") {
                assert_eq!(keys, empty(), "{profile} blocks of {size}, cleared");
            }
            assert!(a.remove_worker("w"));
            assert!(a.map_keys("w").is_empty());
        }
    }
}
