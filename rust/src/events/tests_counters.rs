//! Every per-worker counter of the applier (`WorkerCounters`), read back whole. A child module
//! of `tests`, so it shares its payload writer and helpers.

use super::*;

/// A `BlockStored` map event with the fields the counters depend on; `extra` writes more
/// (key, value) pairs and returns how many.
fn store(w: &mut W, e: &Ev<'_>, group: u64, extra: impl FnOnce(&mut W) -> usize) {
    stored_with(w, e, |more| {
        more.s("group_idx").u(group);
        1 + extra(more)
    });
}

fn ev<'a>(hashes: &'a [u64], parent: Option<u64>, tokens: &'a [u64], block_size: u64) -> Ev<'a> {
    Ev {
        hashes,
        parent,
        tokens,
        block_size,
        medium: None,
    }
}

fn none(_: &mut W) -> usize {
    0
}

fn unknown_type(w: &mut W) {
    w.map(2).s("type").s("BlockMoved");
    w.s("block_hashes").ints(&[1]);
}

fn removed_in(w: &mut W, hashes: &[u64], group: u64) {
    w.map(3).s("type").s("BlockRemoved");
    w.s("block_hashes").ints(hashes);
    w.s("group_idx").u(group);
}

fn cleared(w: &mut W) {
    w.map(1).s("type").s("AllBlocksCleared");
}

/// Stores to `MAX_TIERS + 1` media: the last is one tier too many (unsupported).
fn tiers(w: &mut W, tokens: &[u64]) -> usize {
    for t in 0..=MAX_TIERS {
        let medium = format!("TIER{t}");
        let e = Ev {
            medium: Some(&medium),
            ..ev(&[], None, &tokens[..16], 16)
        };
        let hash = [100 + t as u64];
        store(w, &Ev { hashes: &hash, ..e }, 0, none);
    }
    MAX_TIERS + 1
}

/// Drives every counter of one worker, in each mode, through each place that counts it (each
/// skip reason of each mode; every counting site of `apply.rs`), and reads them back whole
/// against the counts by hand. Events 18/40: direct mode's `skipped_unknown_parent += 1` →
/// `-=` passed every test — no test had a direct-mode store with an unknown parent.
#[test]
fn every_counter_counts_each_of_its_events_in_each_mode() {
    let tokens: Vec<u64> = (0..64).collect();
    let mut wide = tokens.clone();
    wide[3] = 1 << 33;
    let truncated = |p: &[u8]| p[..p.len() - 2].to_vec();

    // Rehash mode (blocks of 16).
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let p1 = batch(|w| {
        store(w, &ev(&[1, 2], None, &tokens[..32], 16), 0, none); // 2 stored
        store(w, &ev(&[3], Some(2), &tokens[32..48], 16), 0, none); // 1 stored
        store(w, &ev(&[9], Some(98), &tokens[..16], 16), 0, none); // unknown parent
        store(w, &ev(&[10], Some(97), &tokens[..16], 16), 0, none); // unknown parent
        store(w, &ev(&[11], None, &tokens[..20], 16), 0, none); // partial: 20 ≠ 16
        store(w, &ev(&[12], None, &tokens[..8], 8), 0, none); // partial: 8 < 16
        store(w, &ev(&[13], None, &tokens[..24], 24), 0, none); // block size
        store(w, &ev(&[14], None, &tokens[..40], 40), 0, none); // block size
        store(w, &ev(&[15], None, &wide[..16], 16), 0, none); // unsupported: > 32 bits
        store(w, &ev(&[16], Some(3), &tokens[48..], 16), 0, |m| {
            m.s("extra_keys").arr(1).arr(1).arr(2).s("img-1").u(0); // unsupported: an image
            1
        });
        store(w, &ev(&[17], None, &tokens[..16], 16), 1, none); // other group
        removed_in(w, &[3], 1); // other group
        removed_in(w, &[3, 2], 0); // 2 removed
        unknown_type(w);
        unknown_type(w);
        15 + tiers(w, &tokens) // 8 stored, 1 unsupported
    });
    a.apply("w", &p1).expect("apply");
    for _ in 0..2 {
        assert!(a.apply("w", &truncated(&p1)).is_err());
    }
    // The index refuses a child of a block it no longer holds for the worker (and the worker
    // starts again empty: its next child is of a new root).
    for (root, child) in [(20, 21), (22, 23)] {
        a.apply("w", &stored_batch(&[root], None, &tokens[..16]))
            .expect("apply");
        index.write().remove_worker("w").expect("known");
        a.apply("w", &stored_batch(&[child], Some(root), &tokens[16..32]))
            .expect("apply");
    }
    a.apply(
        "w",
        &batch(|w| {
            cleared(w);
            cleared(w);
            store(w, &ev(&[30], None, &tokens[..32], 32), 0, none); // 1 stored, size 32
            3
        }),
    )
    .expect("apply");
    // The largest GPU store of the followed group (40), not the last one (32).
    assert_eq!(a.counters("w").expect("counters").engine_block_size, 40);
    a.clear_worker("w");
    a.clear_worker("w");
    let rehash = WorkerCounters {
        batches: 6,
        malformed: 2,
        events: 15 + (MAX_TIERS as u64 + 1) + 4 + 3,
        stored_events: 11 + (MAX_TIERS as u64 + 1) + 4 + 1,
        removed_events: 2,
        cleared_events: 2,
        blocks_stored: 3 + MAX_TIERS as u64 + 2 + 1,
        blocks_removed: 2,
        skipped_unknown_parent: 2,
        skipped_partial: 2,
        skipped_block_size: 2,
        skipped_unsupported: 3,
        skipped_other_group: 2,
        skipped_unknown_type: 2,
        index_rejected: 2,
        resets: 2,
        foreign_hashes: 0,    // rehash mode compares nothing
        engine_block_size: 0, // cleared: unknown until the next GPU store names it
    };
    assert_eq!(a.counters("w").expect("counters"), rehash);

    // A store the SGLang profile cannot hash (an adapter): unsupported, once per store.
    let config = Config {
        profile: Profile::Sglang,
        ..Config::default()
    };
    let mut s = Applier::new(shared(), config).expect("applier");
    let lora = batch(|w| {
        for h in [1, 2] {
            store(w, &ev(&[h], None, &tokens[..16], 16), 0, |m| {
                m.s("lora_name").s("sql-lora");
                1
            });
        }
        2
    });
    s.apply("w", &lora).expect("apply");
    let sglang = WorkerCounters {
        batches: 1,
        events: 2,
        stored_events: 2,
        skipped_unsupported: 2,
        engine_block_size: 16,
        ..WorkerCounters::default()
    };
    assert_eq!(s.counters("w").expect("counters"), sglang);

    // Direct mode (the engine's hashes, blocks of 16).
    let config = Config {
        mode: Mode::Direct,
        ..Config::default()
    };
    let mut d = Applier::new(shared(), config).expect("applier");
    let p = batch(|w| {
        store(w, &ev(&[1, 2], None, &tokens[..32], 16), 0, none); // 2 stored
        store(w, &ev(&[3], Some(2), &tokens[32..48], 16), 0, none); // 1 stored
        store(w, &ev(&[5], Some(98), &tokens[..16], 16), 0, none); // unknown parent
        store(w, &ev(&[6], Some(97), &tokens[..16], 16), 0, none); // unknown parent
        store(w, &ev(&[2], None, &tokens[..16], 16), 0, none); // rejected: 2 follows 1
        store(w, &ev(&[3], Some(1), &tokens[..16], 16), 0, none); // rejected: 3 follows 2
        store(w, &ev(&[7], None, &tokens[..32], 32), 0, none); // block size: 32 ≠ 16
        store(w, &ev(&[8], None, &tokens[..48], 48), 0, none); // block size
        store(w, &ev(&[11], None, &tokens[..20], 16), 0, none); // partial
        store(w, &ev(&[12], None, &tokens[..8], 8), 0, none); // partial
        store(w, &ev(&[13], None, &wide[..16], 16), 0, none); // 1 stored: hashes are the engine's
        store(w, &ev(&[17], None, &tokens[..16], 1), 1, none); // other group
        removed_in(w, &[3], 1); // other group
        removed_in(w, &[3, 13, 99], 0); // 3 removed
        unknown_type(w);
        15 + tiers(w, &tokens)
    });
    d.apply("w", &p).expect("apply");
    assert!(d.apply("w", &truncated(&p)).is_err());
    d.apply(
        "w",
        &batch(|w| {
            cleared(w);
            1
        }),
    )
    .expect("apply");
    d.clear_worker("w");
    let direct = WorkerCounters {
        batches: 2,
        malformed: 1,
        events: 15 + (MAX_TIERS as u64 + 1) + 1,
        stored_events: 12 + (MAX_TIERS as u64 + 1),
        removed_events: 2,
        cleared_events: 1,
        blocks_stored: 4 + MAX_TIERS as u64,
        blocks_removed: 3,
        skipped_unknown_parent: 2,
        skipped_partial: 2,
        skipped_block_size: 2,
        skipped_unsupported: 1,
        skipped_other_group: 2,
        skipped_unknown_type: 1,
        index_rejected: 2,
        resets: 1,
        // Roots whose first hash is not the profile's own: [1, 2], [2] and one per tier store
        // ([13]'s wide tokens cannot be compared; the last tier store is refused first).
        foreign_hashes: 2 + MAX_TIERS as u64,
        engine_block_size: 0, // cleared: unknown until the next GPU store names it
    };
    assert_eq!(d.counters("w").expect("counters"), direct);
}

/// Direct mode's `foreign_hashes`, against the rule its docs state: a root store is counted when
/// its first block's hash is not the router's own hash of its first `block_size` tokens (the
/// profile's, from the blocks module); a child store never; nor a root the router cannot hash
/// alike — a salt (`cache_salt`, or a string on the first block's extra keys), a LoRA name, extra
/// keys it cannot reproduce, lookahead tokens or token ids past 32 bits. An empty `cache_salt` or
/// `lora_name` names none: compared. Each profile; each case with the first hash the router's
/// own and one bit off it.
#[test]
fn foreign_hashes_counts_exactly_the_comparable_roots_the_router_hashes_otherwise() {
    let tokens: Vec<u64> = (1..=32).collect();
    let mut wide = tokens.clone();
    wide[3] = 1 << 40;
    type Extra = fn(&mut W) -> usize;
    // (what, tokens, extra fields, compared)
    let cases: [(&str, &[u64], Extra, bool); 10] = [
        ("plain", &tokens, |_| 0, true),
        (
            "empty cache_salt",
            &tokens,
            |m| {
                m.s("cache_salt").s("");
                1
            },
            true,
        ),
        (
            "cache_salt",
            &tokens,
            |m| {
                m.s("cache_salt").s("s");
                1
            },
            false,
        ),
        (
            "empty lora_name",
            &tokens,
            |m| {
                m.s("lora_name").s("");
                1
            },
            true,
        ),
        (
            "lora_name",
            &tokens,
            |m| {
                m.s("lora_name").s("x");
                1
            },
            false,
        ),
        (
            "salt in extra_keys",
            &tokens,
            |m| {
                m.s("extra_keys").arr(2).arr(1).s("s").nil();
                1
            },
            false,
        ),
        (
            "multimodal extra_keys",
            &tokens,
            |m| {
                m.s("extra_keys").arr(2).arr(1).arr(2).s("img").u(0).nil();
                1
            },
            false,
        ),
        (
            "nil extra_keys",
            &tokens,
            |m| {
                m.s("extra_keys").nil();
                1
            },
            true,
        ),
        (
            "lookahead",
            &tokens,
            |m| {
                m.s("lookahead_token_ids").arr(1).ints(&[5]);
                1
            },
            false,
        ),
        ("wide tokens", &wide, |_| 0, false),
    ];
    for profile in [
        Profile::Native,
        Profile::Sglang,
        Profile::Vllm(Default::default()),
    ] {
        let hasher = BlockHasher::new(16, profile, Options::default()).expect("hasher");
        for (what, toks, extra, compared) in cases {
            let mut first = Vec::new();
            if toks.iter().all(|&t| t <= u64::from(u32::MAX)) {
                hasher
                    .hash_into(&toks[..16], &ChainState::Root, &[], &mut first)
                    .expect("hash");
            }
            let own = first.first().copied().unwrap_or(0);
            for engine in [own, own ^ 1] {
                let config = Config {
                    mode: Mode::Direct,
                    profile,
                    ..Config::default()
                };
                let mut a = Applier::new(shared(), config).expect("applier");
                let p = batch(|w| {
                    store(w, &ev(&[engine, 7], None, toks, 16), 0, extra);
                    // A child is never compared, whatever its hash.
                    store(w, &ev(&[8], Some(7), &toks[..16], 16), 0, extra);
                    2
                });
                a.apply("w", &p).expect("apply");
                let c = a.counters("w").expect("counters");
                let want = u64::from(compared && engine != own);
                let case = format!("{profile}, {what}, first hash {engine:#x} (own {own:#x})");
                assert_eq!(c.foreign_hashes, want, "{case}");
                assert_eq!(c.blocks_stored, 3, "{case}: stored all the same");
            }
        }
    }
}
