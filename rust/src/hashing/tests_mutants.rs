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
