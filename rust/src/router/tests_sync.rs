//! Sharing the approx model between replicas (`sync.rs`): updates published, applied, batched
//! and refused (moved out of `tests.rs`, unchanged).

use super::tests::{router, tokens};
use super::*;

fn replica(capacity: usize) -> Router {
    replica_of(&["a", "b", "c"], capacity, true, Config::default().policy)
}

/// An approx-mode router over `names` (weight 1, blocks of 4 tokens).
fn replica_of(names: &[&str], capacity: usize, updates: bool, policy: Policy) -> Router {
    let config = Config {
        block_size: 4,
        capacity_blocks: capacity,
        updates,
        policy,
        ..Config::default()
    };
    Router::new(names.iter().map(|&n| (n, 1.0)), config).unwrap()
}

/// A prompt: a shared system part (`family`), then a per-request tail.
fn prompt(family: u32, tail: u32) -> Vec<u32> {
    let mut t = tokens(family, 24);
    t.extend(tokens(1000 + tail, 4 * (1 + tail % 3)));
    t
}

#[test]
fn replicas_applying_each_others_updates_hold_identical_models() {
    // Small caches so that evictions happen: the models must agree on them too.
    let mut reps = [replica(24), replica(24)];
    let mut rng = SplitMix64(7);
    for step in 0..300u32 {
        let (i, now) = ((rng.next_u64() % 2) as usize, f64::from(step));
        let t = prompt((rng.next_u64() % 5) as u32, step);
        let d = reps[i].route_tokens(&t, None, None, now).unwrap();
        reps[i].begin(&d).unwrap();
        if step % 7 == 0 {
            reps[i].observe(&d, d.cached_tokens() / 2, now).unwrap();
        }
        reps[i].finish(&d, now).unwrap();
        let batch = reps[i].take_updates(None);
        assert!(!batch.is_empty());
        let other = &mut reps[1 - i];
        let stats = other.apply_updates(&batch, now, true).unwrap();
        assert_eq!(
            (stats.unanchored, stats.unknown_workers),
            (0, 0),
            "{stats:?}"
        );
        assert!(
            other.take_updates(None).is_empty(),
            "applied updates are not echoed"
        );
        assert_eq!(reps[0].dump_model().unwrap(), reps[1].dump_model().unwrap());
    }
    reps[0].check_model().unwrap();
    reps[1].check_model().unwrap();
}

#[test]
fn a_route_publishes_only_the_blocks_newly_predicted() {
    let mut r = replica(64);
    let t = prompt(1, 1);
    let _ = r.route_tokens(&t, None, None, 0.0).unwrap();
    let first = r.take_updates(None);
    let d = r.route_tokens(&t, None, None, 1.0).unwrap();
    assert_eq!(d.cached_blocks, t.len() / 4);
    let second = r.take_updates(None);
    // header 5 + tag 1 + worker 3 + partition 2 + anchor 9 + count 4 + 8 per block
    assert_eq!(first.len(), 24 + 8 * (t.len() / 4));
    assert_eq!(
        second.len(),
        24,
        "a known prompt is a touch of its last block"
    );
}

#[test]
fn batches_split_on_update_boundaries() {
    let mut a = replica(4096);
    let mut whole = replica(4096);
    let mut parts = replica(4096);
    for k in 0..20 {
        let d = a.route_tokens(&prompt(k, k), None, None, 0.0).unwrap();
        a.begin(&d).unwrap();
    }
    let mut probe = replica(4096);
    for k in 0..20 {
        let d = probe.route_tokens(&prompt(k, k), None, None, 0.0).unwrap();
        probe.begin(&d).unwrap();
    }
    let all = probe.take_updates(None);
    let mut n = 0;
    loop {
        let part = a.take_updates(Some(100));
        if part.is_empty() {
            break;
        }
        let stats = parts.apply_updates(&part, 0.0, true).unwrap();
        // Within the limit, or one update alone longer than it.
        assert!(part.len() <= 100 || stats.records + stats.loads == 1);
        n += 1;
    }
    assert!(n > 20, "{n} batches");
    whole.apply_updates(&all, 0.0, true).unwrap();
    assert_eq!(whole.dump_model().unwrap(), parts.dump_model().unwrap());
    for name in ["a", "b", "c"] {
        let (w, p) = (whole.workers().named(name), parts.workers().named(name));
        assert_eq!(w.unwrap().others, p.unwrap().others);
    }
    // Own updates re-applied without their loads.
    let mut own = replica(4096);
    let d = own.route_tokens(&prompt(1, 1), None, None, 0.0).unwrap();
    own.begin(&d).unwrap();
    let batch = own.take_updates(None);
    let stats = own.apply_updates(&batch, 0.0, false).unwrap();
    assert_eq!((stats.records, stats.loads), (1, 0));
    assert_eq!(
        own.workers().named(&d.worker).unwrap().others,
        Load::default()
    );
}

#[test]
fn bad_batches_change_nothing_and_unknowns_are_counted() {
    let mut a = replica(64);
    let mut b = replica(64);
    let _ = a.route_tokens(&prompt(1, 1), None, None, 0.0).unwrap();
    let batch = a.take_updates(None);
    let before = b.dump_model().unwrap();
    for cut in [1, 4, 9, batch.len() - 1] {
        assert!(
            b.apply_updates(&batch[..cut], 1.0, true).is_err(),
            "cut at {cut}"
        );
    }
    let mut bad = batch.clone();
    bad[5] = 9; // unknown tag
    assert!(b.apply_updates(&bad, 1.0, true).is_err());
    assert!(b.apply_updates(b"nonsense", 1.0, true).is_err());
    assert!(b.apply_updates(&batch, f64::NAN, true).is_err());
    assert_eq!(b.dump_model().unwrap(), before);
    // A worker b does not know, and a continuation whose anchor b never learnt.
    let mut c = replica_of(&["a", "zz"], 64, true, Policy::RoundRobin);
    let _ = c.route_tokens(&prompt(2, 1), None, None, 0.0).unwrap(); // a
    let _ = c.route_tokens(&prompt(3, 1), None, None, 0.0).unwrap(); // zz
    let _ = c.route_tokens(&prompt(2, 2), None, None, 0.0).unwrap(); // a, anchored
    let _ = c.take_updates(None);
    let _ = c.route_tokens(&prompt(2, 4), None, None, 0.0).unwrap();
    let stats = b.apply_updates(&c.take_updates(None), 1.0, true).unwrap();
    assert_eq!(stats.records + stats.unanchored + stats.unknown_workers, 1);
    assert_eq!(stats.records, 0);
    assert_eq!(b.dump_model().unwrap(), before);
}

#[test]
fn load_updates_make_every_replica_weigh_every_replicas_requests() {
    let mut a = replica(64);
    let mut b = replica(64);
    let d = a.route_tokens(&prompt(1, 1), None, None, 0.0).unwrap();
    a.begin(&d).unwrap();
    b.apply_updates(&a.take_updates(None), 0.0, true).unwrap();
    let o = b.workers().named(&d.worker).unwrap().others;
    assert_eq!((o.active, o.prefill_blocks), (1, d.prefill_blocks() as u64));
    a.prefilled(&d).unwrap();
    b.apply_updates(&a.take_updates(None), 0.0, true).unwrap();
    assert_eq!(
        b.workers().named(&d.worker).unwrap().others.prefill_blocks,
        0
    );
    a.finish(&d, 1.0).unwrap();
    b.apply_updates(&a.take_updates(None), 1.0, true).unwrap();
    assert_eq!(
        b.workers().named(&d.worker).unwrap().others,
        Load::default()
    );
    // Events mode shares load only.
    let events = Config {
        mode: IndexMode::Events,
        updates: true,
        ..Config::default()
    };
    let mut e = Router::new([("a", 1.0)], events.clone()).unwrap();
    let mut f = Router::new([("a", 1.0)], events).unwrap();
    let d = e.route_tokens(&tokens(1, 64), None, None, 0.0).unwrap();
    e.begin(&d).unwrap();
    let stats = f.apply_updates(&e.take_updates(None), 0.0, true).unwrap();
    assert_eq!((stats.loads, stats.records), (1, 0));
    assert_eq!(f.workers().named("a").unwrap().others.active, 1);
}

#[test]
fn a_withdrawal_reaches_the_other_replicas() {
    let mut a = replica(64);
    let mut b = replica(64);
    let d = a.route_tokens(&prompt(1, 1), None, None, 0.0).unwrap();
    a.begin(&d).unwrap();
    b.apply_updates(&a.take_updates(None), 0.0, true).unwrap();
    assert_eq!(b.workers().named(&d.worker).unwrap().others.active, 1);
    assert!(a.withdraw(&d).unwrap());
    let stats = b.apply_updates(&a.take_updates(None), 0.0, true).unwrap();
    assert_eq!((stats.forgets, stats.loads), (1, 1));
    assert_eq!(
        b.workers().named(&d.worker).unwrap().others,
        Load::default()
    );
    assert_eq!(a.dump_model().unwrap(), b.dump_model().unwrap());
    let again = b.route_tokens(&prompt(1, 1), None, None, 1.0).unwrap();
    assert_eq!(again.matched_blocks, 0, "b forgot the withdrawn prompt");
}

fn reserved_endpoint() -> EndpointSpec<'static> {
    EndpointSpec {
        pool_size: 2,
        reserved_blocks: Some(8),
        ..EndpointSpec::default()
    }
}

#[test]
fn a_snapshot_reproduces_the_model_and_its_eviction_order() {
    let mut a = replica(20);
    a.add_endpoint("ep", reserved_endpoint()).unwrap();
    let mut rng = SplitMix64(3);
    for step in 0..200u32 {
        let t = prompt((rng.next_u64() % 6) as u32, step);
        let ep = (step % 4 == 0).then_some("ep");
        let d = a.route_tokens(&t, None, ep, f64::from(step)).unwrap();
        if step % 5 == 0 {
            a.begin(&d).unwrap();
            a.observe(&d, 0, f64::from(step)).unwrap();
            a.finish(&d, f64::from(step)).unwrap();
        }
    }
    let image = a.dump_model().unwrap();
    let mut b = replica(20);
    b.add_endpoint("ep", reserved_endpoint()).unwrap();
    b.load_model(&image, 500.0).unwrap();
    b.check_model().unwrap();
    assert_eq!(b.dump_model().unwrap(), image);
    // The same traffic from here on evicts the same blocks on both.
    for step in 0..100u32 {
        let t = prompt((rng.next_u64() % 9) as u32, 1000 + step);
        let now = 600.0 + f64::from(step);
        let da = a.route_tokens(&t, None, None, now).unwrap();
        let db = b.route_tokens(&t, None, None, now).unwrap();
        assert_eq!(
            (&da.worker, da.cached_blocks),
            (&db.worker, db.cached_blocks)
        );
    }
    assert_eq!(a.dump_model().unwrap(), b.dump_model().unwrap());
}

#[test]
fn bad_snapshots_change_nothing() {
    let mut a = replica(64);
    let _ = a.route_tokens(&prompt(1, 1), None, None, 0.0).unwrap();
    let image = a.dump_model().unwrap();
    let mut b = replica(64);
    let _ = b.route_tokens(&prompt(2, 2), None, None, 0.0).unwrap();
    let before = b.dump_model().unwrap();
    for cut in [0, 7, 20, image.len() - 1] {
        assert!(b.load_model(&image[..cut], 1.0).is_err());
    }
    let mut flipped = image.clone();
    flipped[30] ^= 1;
    assert!(b.load_model(&flipped, 1.0).is_err());
    assert!(b.load_model(&image, f64::INFINITY).is_err());
    assert_eq!(b.dump_model().unwrap(), before);
    // Another fleet's snapshot: only the shared names load.
    let mut c = replica_of(&["a", "x"], 64, false, Config::default().policy);
    c.load_model(&image, 1.0).unwrap();
    c.check_model().unwrap();
}

#[test]
fn engine_load_is_a_baseline_for_the_routers_own_changes() {
    let mut r = router(Policy::LeastLoaded, &["a", "b"]);
    let d = r.route_tokens(&tokens(1, 8), None, None, 0.0).unwrap();
    r.begin(&d).unwrap();
    let mine = d.worker.clone();
    // The engine of `mine` reports 5 requests (ours included): 4 are others'.
    r.set_load(&mine, Some(5), Some(3), Some(40), None).unwrap();
    let w = r.workers().named(&mine).unwrap();
    assert_eq!((w.others.active, w.others.prefill_blocks), (4, 38));
    assert_eq!((w.others.queued, w.total_queued()), (2, 3));
    assert_eq!(w.total_active(), 5);
    r.finish(&d, 1.0).unwrap();
    assert_eq!(r.workers().named(&mine).unwrap().total_active(), 4);
    let next = r.route_tokens(&tokens(2, 8), None, None, 2.0).unwrap();
    assert_ne!(next.worker, mine, "the busier engine is avoided");
    assert!(r.set_load("nope", Some(1), None, None, None).is_err());
}

/// Router 13/40 left `put_str`'s bound `NO_PARTITION - 1` → `+ 1`. A name in the update format
/// is a `u16` length and its UTF-8 bytes, and a partition length of `0xFFFF` means none, so a
/// name is cut to at most 65,534 bytes, at a char boundary (the module docs of `sync`). The
/// class: each length-prefixed name a record carries — its worker's and its partition's (a
/// reserving endpoint's id) — at lengths around that bound, against the bytes the wire format
/// specifies; and a replica reads the batch (a worker known only by its whole name is unknown
/// there once the name was cut).
#[test]
fn names_in_updates_are_cut_to_65534_bytes_at_a_char_boundary() {
    // (name, the length it is written with); in the last, `é`'s 2 bytes span the bound.
    let cases = [
        ("a".repeat(65_533), 65_533),
        ("b".repeat(65_534), 65_534),
        ("c".repeat(65_535), 65_534),
        ("d".repeat(70_000), 65_534),
        (format!("{}é", "e".repeat(65_533)), 65_533),
    ];
    for i in 0..cases.len() {
        let (worker, wlen) = &cases[i];
        let (endpoint, plen) = &cases[(i + 2) % cases.len()];
        let mut r = replica_of(&[worker], 64, true, Policy::KvAware);
        let spec = EndpointSpec {
            reserved_blocks: Some(4),
            ..EndpointSpec::default()
        };
        r.add_endpoint(endpoint, spec).unwrap();
        let d = r
            .route_tokens(&tokens(1, 8), None, Some(endpoint), 0.0)
            .unwrap();
        assert_eq!(d.hashes.len(), 2);
        let mut want = b"KVRU\x01\x01".to_vec(); // header, version 1, a record
        for (name, len) in [(worker, *wlen), (endpoint, *plen)] {
            want.extend_from_slice(&(len as u16).to_le_bytes());
            want.extend_from_slice(&name.as_bytes()[..len]);
        }
        want.push(0); // no anchor
        want.extend_from_slice(&[0; 8]);
        want.extend_from_slice(&2u32.to_le_bytes());
        for h in &d.hashes {
            want.extend_from_slice(&h.to_le_bytes());
        }
        let batch = r.take_updates(None);
        assert!(batch == want, "worker of {wlen}, partition of {plen} bytes");
        let mut other = replica_of(&[worker], 64, false, Policy::KvAware);
        let stats = other.apply_updates(&batch, 0.0, true).unwrap();
        let cut = *wlen < worker.len();
        assert_eq!(
            (stats.records, stats.unknown_workers),
            (u64::from(!cut), u64::from(cut)),
            "worker of {wlen} bytes"
        );
    }
}

/// An update batch written by hand from the wire format in `sync`'s module docs.
#[derive(Default)]
struct Batch(Vec<u8>);

impl Batch {
    fn new() -> Self {
        Batch(b"KVRU\x01".to_vec())
    }

    fn name(&mut self, worker: &str) {
        self.0
            .extend_from_slice(&(worker.len() as u16).to_le_bytes());
        self.0.extend_from_slice(worker.as_bytes());
    }

    fn record(mut self, worker: &str, anchor: Option<u64>, blocks: &[u64]) -> Self {
        self.0.push(1);
        self.name(worker);
        self.0.extend_from_slice(&u16::MAX.to_le_bytes()); // no partition
        self.0.push(u8::from(anchor.is_some()));
        self.0.extend_from_slice(&anchor.unwrap_or(0).to_le_bytes());
        self.0
            .extend_from_slice(&(blocks.len() as u32).to_le_bytes());
        for b in blocks {
            self.0.extend_from_slice(&b.to_le_bytes());
        }
        self
    }

    fn forget(mut self, worker: &str, block: u64) -> Self {
        self.0.push(2);
        self.name(worker);
        self.0.extend_from_slice(&block.to_le_bytes());
        self
    }

    fn load(mut self, worker: &str, delta: [i64; 5]) -> Self {
        self.0.push(3);
        self.name(worker);
        for d in delta {
            self.0.extend_from_slice(&d.to_le_bytes());
        }
        self
    }
}

/// Router 18/40: `unanchored += 1` → `-=` passed every test — no test had a record skipped for
/// its anchor and read the count. The class: every counter of `ApplyStats`, each reached at
/// least twice by a batch written by hand, read back whole — in approx mode with and without
/// loads, and in events mode (records and forgets of known workers are not counted there).
#[test]
fn apply_stats_count_every_outcome_of_every_update() {
    let batch = Batch::new()
        .record("a", None, &[1, 2]) // records 1
        .record("a", Some(2), &[3]) // records 2: anchored at a block a holds
        .record("b", Some(99), &[4]) // unanchored 1: held by no one
        .record("b", Some(2), &[5]) // unanchored 2: held by a, not by b
        .record("b", Some(1), &[]) // unanchored 3
        .record("zz", None, &[8]) // unknown 1
        .forget("zz", 1) // unknown 2
        .load("zz", [1, 0, 0, 0, 0]) // unknown 3
        .load("yy", [1, 0, 0, 0, 0]) // unknown 4
        .record("c", None, &[7, 2]) // inconsistent 1: 2 follows 1 in the index
        .record("c", None, &[6, 3]) // inconsistent 2: 3 follows 2
        .forget("a", 3) // forgets 1
        .forget("b", 77) // forgets 2: not held, still applied
        .load("a", [1, 2, 3, 4, 5]) // loads 1
        .load("b", [2, 0, 1, 0, 0]) // loads 2
        .record("c", None, &[1]); // records 3
    let mut r = replica(64);
    let stats = r.apply_updates(&batch.0, 0.0, true).unwrap();
    let want = ApplyStats {
        records: 3,
        forgets: 2,
        loads: 2,
        unanchored: 3,
        unknown_workers: 4,
        inconsistent: 2,
    };
    assert_eq!(stats, want);
    r.check_model().unwrap();
    let held = |r: &Router, w: &str| r.index.read().num_blocks(w).unwrap_or(0);
    assert_eq!((held(&r, "a"), held(&r, "b"), held(&r, "c")), (2, 0, 1));
    let others = |r: &Router, w: &str| r.workers().named(w).unwrap().others;
    let load = |v: [u64; 5]| Load {
        active: v[0],
        queued: v[1],
        prefill_blocks: v[2],
        decode_blocks: v[3],
        written_blocks: v[4],
    };
    assert_eq!(others(&r, "a"), load([1, 2, 3, 4, 5]));
    assert_eq!(others(&r, "b"), load([2, 0, 1, 0, 0]));
    // Without loads: skipped uncounted, but a load for an unknown worker is still unknown.
    let mut r = replica(64);
    let stats = r.apply_updates(&batch.0, 0.0, false).unwrap();
    assert_eq!(stats, ApplyStats { loads: 0, ..want });
    assert_eq!(others(&r, "a"), Load::default());
    // Events mode: only loads and unknown workers.
    let events = Config {
        mode: IndexMode::Events,
        ..Config::default()
    };
    let mut e = Router::new([("a", 1.0), ("b", 1.0), ("c", 1.0)], events).unwrap();
    let stats = e.apply_updates(&batch.0, 0.0, true).unwrap();
    let only = ApplyStats {
        loads: 2,
        unknown_workers: 4,
        ..ApplyStats::default()
    };
    assert_eq!(stats, only);
}

/// Each worker's blocks of a snapshot (`snapshot`'s module docs), rewritten by `edit`, with a
/// new checksum.
fn reorder_snapshot(image: &[u8], mut edit: impl FnMut(&mut Vec<[u8; 19]>)) -> Vec<u8> {
    let body = &image[..image.len() - 8];
    let u16_at = |at: usize| usize::from(u16::from_le_bytes([body[at], body[at + 1]]));
    let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().unwrap()) as usize;
    let mut out = body[..16].to_vec();
    let mut at = 16;
    for _ in 0..u32_at(12) {
        let start = at;
        at += 4 + u32_at(at); // name
        let parts = u16_at(at);
        at += 2;
        for _ in 0..parts {
            at += 2 + u16_at(at);
        }
        let n = u32_at(at);
        at += 4;
        out.extend_from_slice(&body[start..at]);
        let mut blocks: Vec<[u8; 19]> = body[at..at + 19 * n]
            .chunks_exact(19)
            .map(|b| b.try_into().unwrap())
            .collect();
        at += 19 * n;
        edit(&mut blocks);
        out.extend(blocks.iter().flatten());
    }
    assert_eq!(at, body.len());
    let sum = xxhash_rust::xxh3::xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Router 18/40: `parents_first`'s depth below a known one, `d + 1` → `d * 1`, passed every
/// test — every snapshot loaded in the tests was a dump, where a block's parent is never less
/// recently touched. The class: a snapshot's blocks in any order (the load places parents
/// first): reversed, and shuffled, every block of each worker is loaded, in the recorded order.
#[test]
fn a_snapshot_loads_whole_whatever_the_order_of_its_blocks() {
    let mut a = replica(4096);
    a.add_endpoint("ep", reserved_endpoint()).unwrap();
    let mut rng = SplitMix64(11);
    for step in 0..120u32 {
        let t = prompt((rng.next_u64() % 5) as u32, step % 40);
        let ep = (step % 3 == 0).then_some("ep");
        let _ = a.route_tokens(&t, None, ep, f64::from(step)).unwrap();
    }
    let image = a.dump_model().unwrap();
    let mut orders = vec![reorder_snapshot(&image, |b| b.reverse())];
    for _ in 0..20 {
        orders.push(reorder_snapshot(&image, |b| {
            for i in (1..b.len()).rev() {
                b.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
        }));
    }
    for (k, edited) in orders.iter().enumerate() {
        assert_ne!(edited, &image);
        let mut b = replica(4096);
        b.add_endpoint("ep", reserved_endpoint()).unwrap();
        b.load_model(edited, 500.0).unwrap();
        b.check_model().unwrap();
        assert!(b.dump_model().unwrap() == *edited, "order {k}");
    }
}

/// Router 20/40: the forget a withdrawal publishes named `hashes[matched + k]` → `[matched × k]`
/// unnoticed — the one withdrawal tested had neither a known prefix nor a block touched since.
/// The class: a withdrawal's published forget names the first block it drops, for each shape —
/// blocks known before the route (`matched`), blocks another request touched since (`k`), both,
/// neither: a replica applying every update holds the publisher's model after each.
#[test]
fn a_withdrawal_publishes_the_first_block_it_drops() {
    let t = tokens(7, 32); // 8 blocks of 4
    for (matched, touched) in [(0, 0), (0, 2), (2, 0), (2, 1), (3, 3)] {
        let mut a = replica_of(&["w"], 64, true, Policy::KvAware);
        let mut b = replica_of(&["w"], 64, false, Policy::KvAware);
        let sync = |a: &mut Router, b: &mut Router| {
            b.apply_updates(&a.take_updates(None), 0.0, false).unwrap();
            assert!(a.dump_model().unwrap() == b.dump_model().unwrap());
        };
        if matched > 0 {
            let d = a.route_tokens(&t[..4 * matched], None, None, 0.0).unwrap();
            a.begin(&d).unwrap();
            a.finish(&d, 0.0).unwrap();
            sync(&mut a, &mut b);
        }
        let d = a.route_tokens(&t, None, None, 1.0).unwrap();
        assert_eq!(d.matched_blocks, matched);
        sync(&mut a, &mut b);
        if touched > 0 {
            let _ = a.route_tokens(&t[..4 * (matched + touched)], None, None, 2.0);
            sync(&mut a, &mut b);
        }
        let batch_start = a.take_updates(None);
        assert!(batch_start.is_empty());
        assert!(a.withdraw(&d).unwrap());
        let batch = a.take_updates(None);
        // The forget: tag 2, the worker "w", the first block dropped.
        let mut forget = vec![2u8, 1, 0, b'w'];
        forget.extend_from_slice(&d.hashes[matched + touched].to_le_bytes());
        assert!(
            batch.windows(forget.len()).any(|x| x == forget),
            "matched {matched}, touched {touched}"
        );
        b.apply_updates(&batch, 0.0, false).unwrap();
        assert!(
            a.dump_model().unwrap() == b.dump_model().unwrap(),
            "matched {matched}, touched {touched}"
        );
    }
}

/// Never-run router mutants (docs/mutants.md): `Outbox::record`'s guard `!on || hashes.is_empty()`
/// → `&&` published records when updates are off, and an empty record for a prompt without a
/// whole block. The class: what every publishing call (`route`, `begin`, `prefilled`,
/// `observe`, `finish`, `withdraw`) puts in the outbox — nothing at all with updates off, however
/// much it changes; with updates on, for prompts without a whole block, only the load changes,
/// one per call that changes a counter (`begin`, `prefilled`, `finish`; a withdrawal of a begun
/// request), read back by a replica's `ApplyStats`; and for whole prompts the records too.
#[test]
fn updates_are_published_only_when_on_and_only_when_they_say_something() {
    let lifecycle = |r: &mut Router, seed: u32, n: u32| {
        for t in 0..4 {
            let now = f64::from(t);
            let d = r
                .route_tokens(&tokens(seed + t, n), None, None, now)
                .unwrap();
            r.begin(&d).unwrap();
            r.prefilled(&d).unwrap();
            r.observe(&d, 0, now).unwrap();
            r.finish(&d, now).unwrap();
            let w = r
                .route_tokens(&tokens(seed + 10 + t, n), None, None, now)
                .unwrap();
            r.begin(&w).unwrap();
            assert!(r.withdraw(&w).unwrap());
        }
    };
    for n in [3, 40] {
        let mut off = replica_of(&["a", "b"], 64, false, Policy::KvAware);
        lifecycle(&mut off, 1, n);
        assert!(off.take_updates(None).is_empty(), "updates off, {n} tokens");
    }
    // 4 requests × (begin, prefilled, finish) and 4 withdrawn ones × (begin, withdraw).
    let loads = 4 * 3 + 4 * 2;
    let mut short = replica_of(&["a", "b"], 64, true, Policy::KvAware);
    lifecycle(&mut short, 1, 3);
    let mut replica = replica_of(&["a", "b"], 64, true, Policy::KvAware);
    let stats = replica
        .apply_updates(&short.take_updates(None), 0.0, true)
        .unwrap();
    let want = ApplyStats {
        loads,
        ..ApplyStats::default()
    };
    assert_eq!(stats, want, "prompts without a whole block");
    let mut whole = replica_of(&["a", "b"], 64, true, Policy::KvAware);
    lifecycle(&mut whole, 1, 40);
    let mut replica = replica_of(&["a", "b"], 64, true, Policy::KvAware);
    let stats = replica
        .apply_updates(&whole.take_updates(None), 0.0, true)
        .unwrap();
    assert_eq!(stats.loads, loads, "whole prompts: {stats:?}");
    assert!(
        stats.records > 0 && stats.forgets > 0,
        "whole prompts: {stats:?}"
    );
    assert_eq!(replica.dump_model().unwrap(), whole.dump_model().unwrap());
}

/// Never-run router mutant: `decode`'s header check `len < HEADER || magic differs` → `&&`
/// accepted a batch whose magic was wrong and read a 4-byte `KVRU` as a bad version. The class:
/// every malformed batch is refused whole, with the message naming what and where, and changes
/// nothing — against the wire format in `sync`'s module docs, field by field: every cut of a
/// record, a forget and a load (a cut between updates is a valid shorter batch), the header cut
/// at each length, each magic byte changed, versions 0 and 2, an unknown tag at each update.
#[test]
fn every_malformed_batch_is_refused_at_its_byte_and_changes_nothing() {
    let batch = Batch::new()
        .record("ab", Some(7), &[1, 2])
        .forget("ab", 3)
        .load("ab", [1, 2, 3, 4, 5])
        .0;
    // (what, bytes) of each field, in order; `None` ends an update.
    let mut fields: Vec<Option<(&str, usize)>> = Vec::new();
    let head = [("tag", 1), ("worker length", 2), ("worker", 2)];
    fields.extend(head.map(Some));
    fields.extend(
        [
            ("partition length", 2),
            ("anchor flag", 1),
            ("anchor", 8),
            ("block count", 4),
            ("blocks", 16),
        ]
        .map(Some),
    );
    fields.push(None);
    fields.extend(head.map(Some));
    fields.extend([Some(("block", 8)), None]);
    fields.extend(head.map(Some));
    fields.extend([Some(("load delta", 8)); 5]);
    fields.push(None);
    let mut r = replica(64);
    let _ = r.route_tokens(&prompt(1, 1), None, None, 0.0).unwrap();
    let before = r.dump_model().unwrap();
    let mut check = |data: &[u8], want: Option<String>, case: &str| {
        let got = r.apply_updates(data, 1.0, false);
        match want {
            Some(msg) => assert_eq!(got.map(drop), Err(Error::Value(msg)), "{case}"),
            None => assert!(got.is_ok(), "{case}: {got:?}"),
        }
        assert_eq!(r.dump_model().unwrap(), before, "{case}");
    };
    let (mut at, mut starts) = (5, vec![5]);
    for f in &fields {
        match f {
            Some((_, n)) => at += n,
            None => starts.push(at),
        }
    }
    assert_eq!(at, batch.len(), "the layout written out is the batch's");
    for cut in 0..batch.len() {
        let want = if cut == 0 || starts.contains(&cut) {
            None
        } else if cut < 5 {
            Some(format!(
                "not a kvroute update batch ({cut} bytes, no KVRU header)"
            ))
        } else {
            let mut s = 5;
            let mut what = "";
            for &(w, n) in fields.iter().flatten() {
                if s + n > cut {
                    what = w;
                    break;
                }
                s += n;
            }
            Some(format!(
                "update batch truncated at byte {s} (reading {what}, {cut} bytes)"
            ))
        };
        check(&batch[..cut], want, &format!("cut at {cut}"));
    }
    for i in 0..4 {
        let mut bad = batch.clone();
        bad[i] ^= 0x20;
        let msg = format!(
            "not a kvroute update batch ({} bytes, no KVRU header)",
            batch.len()
        );
        check(&bad, Some(msg), &format!("magic byte {i}"));
    }
    for v in [0u8, 2] {
        let mut bad = batch.clone();
        bad[4] = v;
        let msg = format!("update batch version {v} is not supported (expected 1)");
        check(&bad, Some(msg), &format!("version {v}"));
    }
    for &s in &starts[..3] {
        let mut bad = batch.clone();
        bad[s] = 9;
        let msg = format!("update batch: unknown update tag 9 at byte {s}");
        check(&bad, Some(msg), &format!("tag at {s}"));
    }
    check(&batch, None, "whole");
}
