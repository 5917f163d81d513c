//! Hashing tests written for cargo-mutants survivors since shard 5/40 (`tests.rs` is near its
//! size limit). A child module of `tests`.

use super::*;

/// cargo-mutants survivor (shard 5/40): Maglev's preference is its documented failover order —
/// attempt `a` (0, 1, …, up to `16 n + 64` attempts) probes the table at `hash ^ (2^64 - a)`,
/// i.e. what `get` answers for that prehashed key, and only the nodes no attempt found come
/// after, from the table sweep. With 40 nodes most keys meet every node within the attempts;
/// `16 * n` → `16 / n` cut the attempts to 64 and filled the rest from the sweep.
#[test]
fn maglev_preference_follows_the_retry_probes() {
    let names: Vec<String> = (0..40).map(|i| format!("10.0.0.{i}:8000")).collect();
    let t = Maglev::new(names.iter().map(|n| (n.as_str(), 1.0)), 65_537).unwrap();
    let n = names.len();
    let mut complete = 0;
    let mut got = Vec::new();
    for key in 0..200u64 {
        let hash = key.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut want: Vec<NodeId> = Vec::new();
        for a in 0..16 * n as u64 + 64 {
            let owner = t.get(Key::Int(hash ^ a.wrapping_neg())).unwrap();
            if !want.contains(&owner) {
                want.push(owner);
            }
        }
        t.preference_into(Key::Int(hash), n, &mut got).unwrap();
        assert_eq!(got.len(), n);
        // The probes' order is the preference's head, however many they found.
        assert_eq!(got[..want.len()], want[..], "key {key}");
        complete += usize::from(want.len() == n);
    }
    assert!(
        complete > 150,
        "the probes found every node for {complete} keys only"
    );
}

/// cargo-mutants survivor (shard 5/40): `HashRing::position`, where `preference` starts its
/// walk, is the first point `>= h` (the owner `get` gives): a key hashing exactly onto a point
/// belongs to that point (`p < h` → `p <= h` moved it to the next one; `owner_of`, which `get`
/// uses, was already checked against the binary search).
#[test]
fn a_ring_walk_starts_at_the_first_point_at_or_after_the_hash() {
    let names: Vec<String> = (0..37).map(|i| format!("n{i}")).collect();
    for hash in [RingHash::Ketama, RingHash::Xxh3] {
        let r = HashRing::new(names.iter().map(|n| (n.as_str(), 1.0)), 8, hash).unwrap();
        let points: Vec<(u64, NodeId)> = r.points().collect();
        let mut probes: Vec<u64> = points
            .iter()
            .flat_map(|&(p, _)| [p, p.wrapping_sub(1), p.wrapping_add(1)])
            .collect();
        probes.extend([0, u64::from(u32::MAX)]);
        for h in probes {
            if hash == RingHash::Ketama && h > u64::from(u32::MAX) {
                continue;
            }
            // The reference: a linear scan for the first point >= h, wrapping to the first.
            let want = points.iter().position(|&(p, _)| p >= h).unwrap_or(0);
            assert_eq!(r.position(h), want, "{hash:?} {h}");
            assert_eq!(points[want].1, r.owner_of(h), "{hash:?} {h}");
        }
    }
}

/// Checks `h`'s shared face — the trait's provided methods — against `names`, the nodes it was
/// built with (all with weight 1), in order: the node count, membership, each id's name, and a
/// batch lookup written over an `out` that held other values, equal to `get` key by key.
fn check_shared_face<H: ConsistentHash>(h: &H, names: &[String], what: &str) {
    assert_eq!(h.len(), names.len(), "{what}");
    assert_eq!(h.is_empty(), names.is_empty(), "{what}");
    for (id, name) in names.iter().enumerate() {
        assert!(h.contains(name), "{what} {name}");
        assert_eq!(
            h.name(id as NodeId).map(|n| &**n),
            Some(name.as_str()),
            "{what}"
        );
    }
    assert!(!h.contains("absent"), "{what}");
    assert_eq!(h.name(names.len() as NodeId), None, "{what}");
    let keys = || {
        (0..500u64)
            .map(Key::Int)
            .chain([Key::Bytes(b"k"), Key::Bytes(b"")])
    };
    let mut out = vec![NodeId::MAX; 7];
    let got = h.get_many_into(keys(), &mut out);
    if names.is_empty() {
        let msg = "cannot route a key: the hasher has no nodes";
        assert!(
            matches!(&got, Err(crate::Error::Value(m)) if m == msg),
            "{what}: {got:?}"
        );
        assert!(matches!(h.get(Key::Int(1)), Err(crate::Error::Value(m)) if m == msg));
        assert!(matches!(h.require_nodes(), Err(crate::Error::Value(m)) if m == msg));
        return;
    }
    got.unwrap();
    h.require_nodes().unwrap();
    let want: Vec<NodeId> = keys().map(|k| h.get(k).unwrap()).collect();
    assert_eq!(out, want, "{what}");
}

/// cargo-mutants survivors (shard 6/40): `ConsistentHash::get_many_into` → `Ok(())` (the default
/// batch lookup Maglev, jump hash and rendezvous use; only the ring's own override was tested)
/// and `Maglev::table_size` → 0. For their classes — the trait's provided methods on every
/// hasher, and each hasher's configuration read back — every hasher, empty and with nodes, is
/// checked against the names and settings it was built with.
#[test]
fn every_hasher_answers_its_shared_face_and_reads_back_its_configuration() {
    for n in [0usize, 1, 5, 40] {
        let names: Vec<String> = (0..n).map(|i| format!("10.0.0.{i}:8000")).collect();
        let pairs = || names.iter().map(|s| (s.as_str(), 1.0));
        for hash in [RingHash::Ketama, RingHash::Xxh3] {
            let r = HashRing::new(pairs(), 8, hash).unwrap();
            check_shared_face(&r, &names, &format!("ring {hash:?} {n}"));
            assert_eq!((r.hash_kind(), r.vnodes()), (hash, 8));
            assert_eq!(r.num_points(), 8 * n);
        }
        for size in [2, 101, 65_537] {
            let t = Maglev::new(pairs(), size).unwrap();
            check_shared_face(&t, &names, &format!("maglev {size} {n}"));
            assert_eq!(t.table_size(), size);
            assert_eq!(t.table().len() as u64, if n == 0 { 0 } else { size });
        }
        let j = JumpHash::new(&names).unwrap();
        check_shared_face(&j, &names, &format!("jump {n}"));
        assert_eq!(j.buckets(), n as u32);
        check_shared_face(
            &Rendezvous::new(pairs()).unwrap(),
            &names,
            &format!("hrw {n}"),
        );
    }
}

/// cargo-mutants survivor (shard 6/40): `total > MAX_POINTS` → `>=` in `HashRing::point_counts`
/// refused an xxh3 ring of exactly `MAX_POINTS` points. For its class, every limit the point
/// counts check is taken at its bound — accepted there, refused one step past with its whole
/// message — for both hashes (`point_counts` directly: a ring of 2^24 points is ~0.5 GB).
#[test]
fn ring_point_counts_take_every_limit_at_its_bound() {
    let set = |pairs: &[(&str, f64)]| NodeSet::from_pairs(pairs.iter().copied()).unwrap();
    let one = set(&[("a", 1.0)]);
    let two = set(&[("a", 1.0), ("b", 1.0)]);
    let halves = set(&[("a", 0.5), ("b", 0.5)]);
    let max = MAX_POINTS as u32;
    let refused =
        |nodes: &NodeSet, vnodes: u32, hash: RingHash, want: &str| match HashRing::point_counts(
            nodes, vnodes, hash,
        ) {
            Err(crate::Error::Value(m)) => assert_eq!(m, want, "{hash:?} {vnodes}"),
            other => panic!("{hash:?} {vnodes}: {other:?}"),
        };
    let counts = |nodes: &NodeSet, vnodes: u32, hash: RingHash| {
        HashRing::point_counts(nodes, vnodes, hash).unwrap()
    };
    for hash in [RingHash::Ketama, RingHash::Xxh3] {
        refused(&one, 0, hash, "vnodes must be >= 1, got 0");
        assert_eq!(counts(&one, 4, hash), [4]);
        assert_eq!(counts(&one, max, hash), [MAX_POINTS]);
        assert_eq!(counts(&two, max / 2, hash), [MAX_POINTS / 2; 2]);
    }
    assert_eq!(counts(&one, 1, RingHash::Xxh3), [1]);
    assert_eq!(counts(&halves, max, RingHash::Xxh3), [MAX_POINTS / 2; 2]);
    let over = format!(
        "ring too large: weights x {} vnodes exceed {MAX_POINTS} points",
        max + 1
    );
    refused(&one, max + 1, RingHash::Xxh3, &over);
    let over = format!(
        "ring too large: weights x {} vnodes exceed {MAX_POINTS} points",
        max / 2 + 1
    );
    refused(&two, max / 2 + 1, RingHash::Xxh3, &over);
    let fours = "ketama places points in fours: vnodes must be a multiple of 4, got 6";
    refused(&one, 6, RingHash::Ketama, fours);
    let over = format!(
        "ring too large: 1 nodes x {} vnodes exceeds {MAX_POINTS} points",
        max + 4
    );
    refused(&one, max + 4, RingHash::Ketama, &over);
    let over = format!(
        "ring too large: 2 nodes x {} vnodes exceeds {MAX_POINTS} points",
        max / 2 + 4
    );
    refused(&two, max / 2 + 4, RingHash::Ketama, &over);
    // Ketama weights: whole numbers up to 2^53 (the next f64 above it is 2^53 + 2).
    let exact = (1u64 << 53) as f64;
    assert_eq!(counts(&set(&[("a", exact)]), 4, RingHash::Ketama), [4]);
    let whole = "ketama weights must be whole numbers <= 2**53, got";
    refused(
        &set(&[("a", exact + 2.0)]),
        4,
        RingHash::Ketama,
        &format!("{whole} {} for node \"a\"", exact + 2.0),
    );
    refused(
        &set(&[("a", 1.5)]),
        4,
        RingHash::Ketama,
        &format!("{whole} 1.5 for node \"a\""),
    );
}

/// Envoy's weighted Maglev fill, written from its description (`MaglevTable`'s
/// `constructImplementationInternals`, with `normalizeHostWeights`): hosts in name order with
/// normalised weights `w / sum(w)` and a target from 0; on pass `i = 1, 2, …` each host in turn,
/// while a slot is free, is skipped if `i * weight < target`, else its target grows by the largest
/// normalised weight and it takes the first free slot of its permutation
/// `(offset + skip * next) % M`, `next` counting every slot it has tried. Returns the table (the
/// index in `hosts` of each slot's owner) and how many slots were taken at an exact tie,
/// `i * weight == target`.
fn envoy_weighted_fill(hosts: &[(&str, f64)], m: u64) -> (Vec<NodeId>, usize) {
    let sum: f64 = hosts.iter().map(|h| h.1).sum();
    let max = hosts.iter().map(|h| h.1 / sum).fold(0.0, f64::max);
    let mut order: Vec<usize> = (0..hosts.len()).collect();
    order.sort_by(|&a, &b| hosts[a].0.as_bytes().cmp(hosts[b].0.as_bytes()));
    // (host, offset, skip, weight, target, next)
    let mut entries: Vec<(usize, u64, u64, f64, f64, u64)> = order
        .into_iter()
        .map(|h| {
            let key = hosts[h].0.as_bytes();
            let offset = xxhash_rust::xxh64::xxh64(key, 0) % m;
            let skip = xxhash_rust::xxh64::xxh64(key, 1) % (m - 1) + 1;
            (h, offset, skip, hosts[h].1 / sum, 0.0, 0)
        })
        .collect();
    let mut table: Vec<Option<usize>> = vec![None; m as usize];
    let (mut taken, mut ties) = (0u64, 0usize);
    let mut pass = 1u32;
    while taken < m {
        for e in entries.iter_mut() {
            if taken == m {
                break;
            }
            let scaled = f64::from(pass) * e.3;
            if scaled < e.4 {
                continue;
            }
            ties += usize::from(scaled == e.4);
            e.4 += max;
            let mut c = (e.1 + e.2 * e.5) % m;
            while table[c as usize].is_some() {
                e.5 += 1;
                c = (e.1 + e.2 * e.5) % m;
            }
            table[c as usize] = Some(e.0);
            e.5 += 1;
            taken += 1;
        }
        pass += 1;
    }
    let table = table.into_iter().map(|s| s.unwrap() as NodeId).collect();
    (table, ties)
}

/// Left by shard 8/40: `iteration * w < target` → `<=` in `Maglev::build`, which differs from
/// Envoy's fill only where the two are equal in f64. Envoy takes a slot at an exact tie. Its own
/// published tables with such ties: `maglev_lb_test.cc` "LocalityWeightedDifferentLocalityWeights"
/// (localities 8 : 0 : 2 give hosts :90 and :91 normalised weights 0.8 and 0.2, the bits
/// kvroute's weights 4 and 1 give; :91 takes its later slots at `4 * 0.2 == 0.8`, `8 * 0.2 ==
/// 1.6`, …) and, without ties, "LocalityWeightedSameLocalityWeights" (0.5 and 0.5). For the class —
/// every weighted pass at an exact tie — every pair and triple of weights 1 to 6 (1 : 3, 1 : 2,
/// 2 : 3 : 6, … tie) at three table sizes, against the fill as Envoy describes it, which must
/// meet ties.
#[test]
fn maglev_weighted_fill_takes_a_slot_at_an_exact_tie_as_envoy() {
    let t = Maglev::new([("127.0.0.1:90", 4.0), ("127.0.0.1:91", 1.0)], 17).unwrap();
    let want = [1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0];
    assert_eq!(t.table(), &want);
    assert_eq!(
        envoy_weighted_fill(&[("127.0.0.1:90", 4.0), ("127.0.0.1:91", 1.0)], 17),
        (want.to_vec(), 3)
    );
    let t = Maglev::new([("127.0.0.1:90", 1.0), ("127.0.0.1:91", 1.0)], 17).unwrap();
    let want = [1, 0, 0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 1, 0, 1];
    assert_eq!(t.table(), &want);
    let names = ["10.0.0.7:8000", "10.0.0.1:8000", "10.0.0.4:8000"];
    let mut ties = 0;
    let mut sets = Vec::new();
    for a in 1..=6u32 {
        for b in 1..=6u32 {
            sets.push(vec![a, b]);
            for c in 1..=6u32 {
                sets.push(vec![a, b, c]);
            }
        }
    }
    for weights in &sets {
        let hosts: Vec<(&str, f64)> = names
            .iter()
            .zip(weights)
            .map(|(&n, &w)| (n, f64::from(w)))
            .collect();
        for m in [17, 101, 1009] {
            let (want, tied) = envoy_weighted_fill(&hosts, m);
            let t = Maglev::new(hosts.iter().copied(), m).unwrap();
            assert_eq!(t.table(), &want[..], "weights {weights:?}, M = {m}");
            ties += tied;
        }
    }
    assert!(ties > 1000, "only {ties} slots taken at a tie");
}

/// cargo-mutants survivor (shard 9/40): `filled == LANES` → `!=` in `KetamaLanes::push` hashed
/// every key alone, at once (the final hashes are the same: `ketama_hash_many`'s twin is an
/// accepted equivalent). But `RingBatch::push` documents when `out` grows: owners are appended a
/// group of `LOOKUP_GROUP` hashes at a time, and ketama hashes reach that group a whole group of
/// `LANES` keys at a time, once it is full; `finish` appends the rest, after which the batch is
/// empty. For the class of that bookkeeping (when a group is delivered, the partial groups at
/// `finish`, an empty batch after it, reuse), `out`'s length is checked after every push, over
/// several groups of both sizes and a part, twice on one batch, each owner against `get`.
#[test]
fn ring_batch_appends_owners_a_whole_group_at_a_time() {
    use super::super::ketama::LANES;
    use super::super::ring::LOOKUP_GROUP;
    let n = 3 * LOOKUP_GROUP + LANES + 5;
    let keys: Vec<Key<'_>> = (0..n as u64).map(Key::Int).collect();
    for kind in [RingHash::Ketama, RingHash::Xxh3] {
        let ring = HashRing::new([("a", 1.0), ("b", 1.0), ("c", 2.0)], 8, kind).unwrap();
        let want: Vec<NodeId> = keys.iter().map(|&k| ring.get(k).unwrap()).collect();
        let mut batch = RingBatch::new(&ring).unwrap();
        for round in 0..2 {
            let mut out = vec![];
            for (i, &k) in keys.iter().enumerate() {
                batch.push(k, &mut out);
                let hashed = match kind {
                    RingHash::Ketama => (i + 1) / LANES * LANES,
                    RingHash::Xxh3 => i + 1,
                };
                let len = hashed / LOOKUP_GROUP * LOOKUP_GROUP;
                assert_eq!(out.len(), len, "{kind:?} round {round}, key {i}");
            }
            batch.finish(&mut out);
            assert_eq!(out, want, "{kind:?} round {round}");
            batch.finish(&mut out);
            assert_eq!(out.len(), n, "{kind:?} round {round}: a second finish");
        }
    }
}
