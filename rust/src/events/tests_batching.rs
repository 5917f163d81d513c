//! A batch's events apply as if each came in a batch of its own. The applier gathers the
//! removals of consecutive `BlockRemoved` events of one tier and applies them in one index call
//! (`Ctx::flush_removals`), flushing when the tier changes, before any other event and at the
//! batch's end; the reference is the same events applied one batch each, where nothing is
//! gathered. A child module of `tests`, so it shares its payload writer and helpers.

use super::*;

/// The router's block size (tokens). In rehash mode chain 1 stores 32-token engine blocks (two
/// router blocks each), chain 2 8-token pages (two to a router block: gathered, `pages`; on the
/// GPU, below the 32-token blocks seen there, they are partial windows and skipped), the others
/// 16-token blocks.
const ROUTER: usize = 16;

/// One event of the workload.
#[derive(Clone, Debug)]
enum Op {
    /// `blocks` engine blocks of chain `chain` from block `from`, on `medium`.
    Store {
        chain: usize,
        from: usize,
        blocks: usize,
        medium: Option<&'static str>,
    },
    /// The engine blocks `blocks` (chain, block) of `medium`.
    Remove {
        blocks: Vec<(usize, usize)>,
        medium: Option<&'static str>,
    },
    Clear,
}

const CHAINS: usize = 4;
const BLOCKS: usize = 6;
/// `None` and `"GPU"` are the same tier.
const MEDIA: [Option<&str>; 4] = [None, Some("GPU"), Some("CPU"), Some("DISK")];

fn engine_size(mode: Mode, chain: usize) -> usize {
    match (mode, chain) {
        (Mode::Rehash, 1) => 2 * ROUTER,
        (Mode::Rehash, 2) => ROUTER / 2,
        _ => ROUTER,
    }
}

fn engine_hash(chain: usize, block: usize) -> u64 {
    1_000 * (chain as u64 + 1) + block as u64
}

fn chain_tokens(mode: Mode, chain: usize) -> Vec<u64> {
    let n = BLOCKS * engine_size(mode, chain);
    (0..n as u64).map(|t| 10_000 * chain as u64 + t).collect()
}

fn write(w: &mut W, mode: Mode, op: &Op) {
    match op {
        Op::Store {
            chain,
            from,
            blocks,
            medium,
        } => {
            let size = engine_size(mode, *chain);
            let tokens = chain_tokens(mode, *chain);
            let hashes: Vec<u64> = (*from..from + blocks)
                .map(|b| engine_hash(*chain, b))
                .collect();
            let e = Ev {
                hashes: &hashes,
                parent: from.checked_sub(1).map(|b| engine_hash(*chain, b)),
                tokens: &tokens[from * size..(from + blocks) * size],
                block_size: size as u64,
                medium: *medium,
            };
            stored(w, &e);
        }
        Op::Remove { blocks, medium } => {
            let hashes: Vec<u64> = blocks.iter().map(|&(c, b)| engine_hash(c, b)).collect();
            removed(w, &hashes, *medium);
        }
        Op::Clear => {
            w.map(1).s("type").s("AllBlocksCleared");
        }
    }
}

fn payload(mode: Mode, ops: &[Op]) -> Vec<u8> {
    batch(|w| {
        for op in ops {
            write(w, mode, op);
        }
        ops.len()
    })
}

/// What a tier of `a` holds for worker "w": for each chain, the blocks matched of its router
/// chain (rehash) or engine chain (direct), whether each of those hashes is present, and the
/// worker's block count.
fn tier_view(a: &Applier, profile: Profile, medium: &str) -> Option<(Vec<u32>, Vec<bool>, u64)> {
    let index = a.tier_index(medium)?;
    let mode = a.config().mode;
    let (mut matched_blocks, mut present) = (Vec::new(), Vec::new());
    for chain in 0..CHAINS {
        let query = match mode {
            Mode::Rehash => {
                let h = BlockHasher::new(ROUTER, profile, Options::default()).expect("hasher");
                let mut out = Vec::new();
                h.hash_into(&chain_tokens(mode, chain), &ChainState::Root, &[], &mut out)
                    .expect("hash");
                out
            }
            Mode::Direct => (0..BLOCKS).map(|b| engine_hash(chain, b)).collect(),
        };
        matched_blocks.push(matched(&index, &query, "w"));
        present.extend(query.iter().map(|&h| index.read().contains(h)));
    }
    let blocks = index.read().num_blocks("w").unwrap_or(0);
    Some((matched_blocks, present, blocks))
}

/// Applies `ops` in batches of `sizes` (cycled) to one applier and one batch each to another,
/// and compares every tier's contents and the counters (but `batches`).
fn check(config: &Config, ops: &[Op], sizes: &[usize]) -> u64 {
    let mut whole = Applier::new(shared(), config.clone()).expect("applier");
    let mut each = Applier::new(shared(), config.clone()).expect("applier");
    let mut rest = ops;
    for &n in sizes.iter().cycle() {
        if rest.is_empty() {
            break;
        }
        let (now, later) = rest.split_at(n.min(rest.len()));
        whole.apply("w", &payload(config.mode, now)).expect("apply");
        rest = later;
    }
    for op in ops {
        each.apply("w", &payload(config.mode, std::slice::from_ref(op)))
            .expect("apply");
    }
    for medium in ["GPU", "CPU", "DISK"] {
        assert_eq!(
            tier_view(&whole, config.profile, medium),
            tier_view(&each, config.profile, medium),
            "{medium} tier, {config:?}, batches of {sizes:?}"
        );
    }
    let counters = |a: &Applier| WorkerCounters {
        batches: 0,
        ..a.counters("w").expect("counters")
    };
    assert_eq!(counters(&whole), counters(&each), "{config:?}, {sizes:?}");
    counters(&whole).blocks_stored
}

/// A workload that moves between tiers often: stores of whole chains and of continuations,
/// runs of removals whose tier changes from one event to the next (and stays, and comes back),
/// stores and clears between removals, blocks removed and at once stored again.
fn workload(seed: u64, n: usize) -> Vec<Op> {
    let mut s = seed;
    let mut next = |bound: usize| -> usize {
        s = s
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((s >> 33) % bound as u64) as usize
    };
    let mut ops = Vec::with_capacity(n);
    // Every chain whole on every tier first, so the removals find blocks.
    for chain in 0..CHAINS {
        for medium in MEDIA.into_iter().skip(1) {
            ops.push(Op::Store {
                chain,
                from: 0,
                blocks: BLOCKS,
                medium,
            });
        }
    }
    while ops.len() < n {
        let medium = MEDIA[next(MEDIA.len())];
        match next(12) {
            0..=5 => {
                let blocks = (0..1 + next(3))
                    .map(|_| (next(CHAINS), next(BLOCKS)))
                    .collect();
                ops.push(Op::Remove { blocks, medium });
            }
            6..=8 => {
                let from = next(BLOCKS);
                ops.push(Op::Store {
                    chain: next(CHAINS),
                    from,
                    blocks: 1 + next(BLOCKS - from),
                    medium,
                });
            }
            9 => ops.push(Op::Clear),
            _ => {
                // A block removed and stored again at once (on the same tier): present after.
                let (chain, from) = (next(CHAINS), next(BLOCKS));
                let blocks = vec![(chain, from)];
                ops.push(Op::Remove { blocks, medium });
                let blocks = 1 + next(BLOCKS - from);
                ops.push(Op::Store {
                    chain,
                    from,
                    blocks,
                    medium,
                });
            }
        }
    }
    ops
}

/// Events 9/40 at a6570e8: `self.pending_tier.is_some_and(|t| t != tier)` → `==` in
/// `Ctx::remove` passed every events test — no test removed blocks of two tiers in one batch
/// (the mutant applies a GPU removal to the CPU tier that follows it). For the class, every
/// place the gathered removals are flushed — a change of tier, a store, a clear, the batch's
/// end — and none flushed too late or into another tier: a workload switching tiers between
/// consecutive removals, applied in batches of 1 to 40 events (and whole), in each mode and
/// with a digest-chained profile (whose removals also drop a chain digest), must leave every
/// tier as the same events applied one batch each.
#[test]
fn a_batch_applies_as_its_events_one_batch_each() {
    let configs = [
        Config::default(),
        Config {
            profile: Profile::Sglang,
            ..Config::default()
        },
        Config {
            mode: Mode::Direct,
            ..Config::default()
        },
    ];
    for config in &configs {
        for seed in 0..4 {
            let ops = workload(seed, 300);
            // The workload is what the test needs: removals of one tier right after those of
            // another, of the same tier, and stores and clears after removals.
            let pairs = ops.windows(2).filter(|p| match p {
                [Op::Remove { medium: a, .. }, Op::Remove { medium: b, .. }] => {
                    a.unwrap_or("GPU") != b.unwrap_or("GPU")
                }
                _ => false,
            });
            assert!(pairs.count() > 20, "seed {seed}");
            let mut stored = 0;
            for sizes in [&[1][..], &[2, 3], &[7], &[40], &[300], &[5, 1, 11]] {
                stored = check(config, &ops, sizes);
            }
            assert!(
                stored > 100,
                "{config:?}: the stores apply ({stored} blocks)"
            );
        }
    }
}

/// The same by hand, in one batch: GPU blocks removed, then CPU blocks, then GPU again; each
/// tier loses exactly its own.
#[test]
fn removals_of_consecutive_events_go_to_their_own_tiers() {
    let mode = Mode::Rehash;
    let mut a = Applier::new(shared(), Config::default()).expect("applier");
    let mut ops = Vec::new();
    for medium in [None, Some("CPU")] {
        ops.push(Op::Store {
            chain: 0,
            from: 0,
            blocks: BLOCKS,
            medium,
        });
    }
    a.apply("w", &payload(mode, &ops)).expect("apply");
    let remove = |b: usize, medium| Op::Remove {
        blocks: vec![(0, b)],
        medium,
    };
    let ops = [
        remove(4, Some("GPU")),
        remove(2, Some("CPU")),
        remove(5, None),
        remove(1, Some("CPU")),
    ];
    a.apply("w", &payload(mode, &ops)).expect("apply");
    let view = |medium| tier_view(&a, Profile::Native, medium).expect("tier");
    // A removed block takes the blocks after it: GPU keeps blocks 0 to 3, CPU block 0.
    let (gpu, cpu) = (view("GPU"), view("CPU"));
    assert_eq!((gpu.0[0], gpu.2), (4, 4));
    assert_eq!((cpu.0[0], cpu.2), (1, 1));
}
