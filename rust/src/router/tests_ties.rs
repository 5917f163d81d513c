//! Rendezvous ties between the two forms of a score (router 19/40): the table compares raw
//! draws while every weight is equal and `weight / -ln u` otherwise, and the two orders differ
//! only where the logarithmic form rounds two draws to one score.

use super::tests::router;
use super::*;
use crate::hashing::{hash_key, Rendezvous, RendezvousScore};

/// The inverse of `x * a` modulo 2^64 (`a` odd), by Newton's iteration.
pub(super) fn inverse(a: u64) -> u64 {
    let mut x = a; // correct to 3 bits
    for _ in 0..6 {
        x = x.wrapping_mul(2u64.wrapping_sub(a.wrapping_mul(x)));
    }
    assert_eq!(a.wrapping_mul(x), 1);
    x
}

/// The inverse of MurmurHash3's `fmix64` (the rendezvous draw's mixer): each step undone.
fn unmix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(inverse(0xc4ce_b9fe_1a85_ec53));
    h ^= h >> 33;
    h = h.wrapping_mul(inverse(0xff51_afd7_ed55_8ccd));
    h ^ (h >> 33)
}

/// The seed whose draw for `key` is `draw` (53 bits).
fn seed_for(key: u64, draw: u64) -> u64 {
    key ^ unmix(draw << 11)
}

/// Router 19/40: `add_worker_as`'s `resort = uniform != …` → `==` re-sorted the heads whenever
/// the weights' uniformity did *not* change, and left them as they were when it did. Workers of
/// one weight keep their relative order in both forms but where two distinct draws round to one
/// logarithmic score: then the name breaks the tie. The class: each change of form — a join and
/// a leave — with two workers at such a tie heading an endpoint's order; after each, the pool is
/// the one an endpoint added afresh gets.
#[test]
fn the_pools_follow_a_change_of_score_form_at_a_tie() {
    let key = hash_key(b"ep");
    let weighted = |seed: u64, weight: f64| match Rendezvous::node_score(key, seed, weight, false) {
        RendezvousScore::Weighted(s) => s,
        RendezvousScore::Draw(_) => unreachable!(),
    };
    // Two adjacent draws from u = 1/2 up whose logarithmic scores are equal.
    let mut d = 4u64 << 50;
    while weighted(seed_for(key, d), 1.0) != weighted(seed_for(key, d + 1), 1.0) {
        d += 1;
    }
    let (low, high) = (seed_for(key, d), seed_for(key, d + 1));
    assert_eq!(
        Rendezvous::node_score(key, high, 1.0, true),
        RendezvousScore::Draw(d + 1)
    );
    let tie = weighted(low, 1.0);
    // A worker of weight 2 scoring below the tie: it joins without heading the order.
    let heavy = (0..)
        .map(|i| format!("c{i}"))
        .find(|n| weighted(Rendezvous::node_seed(n), 2.0) < tie)
        .unwrap();

    let mut r = router(Policy::KvAware, &["a", "b"]);
    r.workers.named_mut("a").unwrap().seed = low;
    r.workers.named_mut("b").unwrap().seed = high;
    let spec = EndpointSpec {
        pool_size: 1,
        ..EndpointSpec::default()
    };
    let pool = |r: &mut Router| {
        let pool = r.endpoint_pool("ep", None).unwrap();
        r.remove_endpoint("ep").unwrap();
        r.add_endpoint("ep", spec).unwrap();
        assert_eq!(
            r.endpoint_pool("ep", None).unwrap(),
            pool,
            "as if added afresh"
        );
        pool.iter().map(|n| n.to_string()).collect::<Vec<_>>()
    };
    r.add_endpoint("ep", spec).unwrap();
    // Equal weights: the larger draw heads the order.
    assert_eq!(pool(&mut r), ["b"]);
    // Unequal weights: `a` and `b` tie, and the name decides.
    r.add_worker(&heavy, 2.0).unwrap();
    assert_eq!(pool(&mut r), ["a"]);
    r.remove_worker(&heavy).unwrap();
    assert_eq!(pool(&mut r), ["b"]);
}
