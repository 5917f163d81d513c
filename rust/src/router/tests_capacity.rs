//! Where a decision's blocks land in the approx model: in its endpoint's reserved partition and
//! never beyond what the worker's cache holds — at each site that records them (`route`,
//! `finish`, `observe`, a replica applying the updates). Written for the router's never-run
//! mutants (docs/mutants.md: `partition_of` → `None`, `Model::commit`'s first missing block).

use super::tests::tokens;
use super::*;

/// An approx-mode router over `names` (weight 1, blocks of 4 tokens, `capacity` blocks each)
/// that publishes its updates, with the endpoint `ep` reserving `reserved` blocks when given.
fn router_with(names: &[&str], capacity: usize, reserved: Option<usize>) -> Router {
    let config = Config {
        block_size: 4,
        capacity_blocks: capacity,
        updates: true,
        ..Config::default()
    };
    let mut r = Router::new(names.iter().map(|&n| (n, 1.0)), config).unwrap();
    let spec = EndpointSpec {
        pool_size: 1,
        reserved_blocks: reserved,
        ..EndpointSpec::default()
    };
    r.add_endpoint("ep", spec).unwrap();
    r
}

/// How many of `hashes` worker `name`'s modelled cache holds, and how many blocks its `ep`
/// partition holds.
fn held(r: &Router, name: &str, hashes: &[u64]) -> (usize, usize) {
    let cache = r.workers().named(name).unwrap().cache.as_ref().unwrap();
    let part = cache.partition("ep").unwrap();
    let n = hashes.iter().filter(|&&h| cache.contains(h)).count();
    (n, cache.usage(part))
}

/// Public traffic (no endpoint) filling worker `a`'s 64-block cache twice over.
fn public_traffic(r: &mut Router, now: f64) {
    for t in 0..32 {
        let p = r
            .route_tokens(&tokens(500 + t, 16), None, None, now)
            .unwrap();
        r.begin(&p).unwrap();
        r.finish(&p, now).unwrap();
    }
}

/// Each site that records a decision's prompt again (`finish`, `observe`, and a replica applying
/// their updates) puts it in the decision's endpoint's reserved partition, as `route` does: `A`
/// (8 blocks) is routed, then `B` (8 blocks), and public traffic leaves the 8-block partition
/// only `B`; the site then records `A` again, in the partition, so that the next public traffic
/// leaves it only `A`. The reference is the partition's rule: public traffic leaves it the
/// 8 blocks last recorded in it.
#[test]
fn each_site_that_records_a_prompt_again_uses_its_endpoints_partition() {
    for site in ["finish", "observe"] {
        let mut r = router_with(&["a"], 64, Some(8));
        let mut replica = router_with(&["a"], 64, Some(8));
        let a = r
            .route_tokens(&tokens(1, 32), None, Some("ep"), 0.0)
            .unwrap();
        r.begin(&a).unwrap();
        let b = r
            .route_tokens(&tokens(2, 32), None, Some("ep"), 1.0)
            .unwrap();
        r.begin(&b).unwrap();
        // The partition may grow past its reservation while the cache has room; public
        // traffic then takes back what is past it, the partition's least recent blocks.
        public_traffic(&mut r, 1.5);
        assert_eq!(held(&r, "a", &a.hashes), (0, 8), "{site}: B took A's place");
        match site {
            "finish" => r.finish(&a, 2.0).unwrap(),
            _ => r.observe(&a, 0, 2.0).unwrap(),
        }
        let batch = r.take_updates(None);
        replica.apply_updates(&batch, 2.0, true).unwrap();
        for (who, router) in [("router", &mut r), ("replica", &mut replica)] {
            assert_eq!(held(router, "a", &a.hashes), (8, 8), "{site}, {who}");
            assert_eq!(held(router, "a", &b.hashes).0, 0, "{site}, {who}");
            public_traffic(router, 3.0);
            assert_eq!(held(router, "a", &a.hashes), (8, 8), "{site}, {who}");
            let again = router
                .route_tokens(&tokens(1, 32), None, Some("ep"), 4.0)
                .unwrap();
            assert_eq!(again.cached_blocks, 8, "{site}, {who}");
            router.check_model().unwrap();
        }
    }
}

/// A prompt longer than the worker's cache: the cache keeps its first `capacity` blocks (the
/// blocks of the chain being stored are not evicted for its later ones) and the index credits
/// the worker exactly those — after the route, after `finish` and `observe` record it again, and
/// on a replica applying the updates. The reference is the capacity: 64 of the 70 blocks.
#[test]
fn a_prompt_longer_than_the_cache_is_credited_only_as_far_as_the_cache_holds_it() {
    for site in ["route", "finish", "observe"] {
        let mut r = router_with(&["a"], 64, None);
        let mut replica = router_with(&["a"], 64, None);
        let long = tokens(7, 4 * 70);
        let d = r.route_tokens(&long, None, None, 0.0).unwrap();
        assert_eq!(d.hashes.len(), 70);
        r.begin(&d).unwrap();
        match site {
            "finish" => r.finish(&d, 1.0).unwrap(),
            "observe" => r.observe(&d, 0, 1.0).unwrap(),
            _ => {}
        }
        let batch = r.take_updates(None);
        replica.apply_updates(&batch, 1.0, true).unwrap();
        for (who, router) in [("router", &mut r), ("replica", &mut replica)] {
            router
                .check_model()
                .unwrap_or_else(|e| panic!("{site}, {who}: {e}"));
            let cache = router.workers().named("a").unwrap().cache.as_ref().unwrap();
            let kept: Vec<bool> = d.hashes.iter().map(|&h| cache.contains(h)).collect();
            assert!(kept[..64].iter().all(|&k| k), "{site}, {who}");
            assert!(kept[64..].iter().all(|&k| !k), "{site}, {who}");
            let again = router.route_tokens(&long, None, None, 2.0).unwrap();
            assert_eq!(again.cached_blocks, 64, "{site}, {who}");
        }
    }
}
