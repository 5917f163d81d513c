//! Where a decision's blocks land in the approx model: in its endpoint's reserved partition and
//! never beyond what the worker's cache holds — at each site that records them (`route`,
//! `finish`, `observe`, a replica applying the updates); what `observe` drops; and how much of
//! each reservation a member's cache holds. Written for the router's never-run mutants
//! (docs/mutants.md: `partition_of` → `None`, `Model::commit`'s first missing block; quarters 1
//! and 3: `observe`'s bound and rule, `Model::reserve`'s clamp, `Decision::cached_tokens`).

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

/// Router quarter 1/3 of the never-run set: `observe`'s bound `cached_tokens > prompt_tokens` →
/// `>=` and `==`, its whole blocks `cached_tokens / block_size` → `%`, and its drop condition
/// `observed < cached_blocks` → `<=` passed every test (each observe tested reported 0 tokens,
/// or a multiple of the block size below the prediction). The class: `observe` with every
/// `cached_tokens` from 0 to two past the prompt, against its documented rule — above the
/// prompt refused whole, changing nothing; otherwise the worker lacked the blocks from the first
/// one not wholly served (⌊tokens / 4⌋, counted here by whole blocks) when that is below the 8
/// predicted: they and what hangs below them (the first prompt's tail) are dropped and one
/// forget naming that block is published; at or past the prediction nothing is dropped and
/// nothing forgotten. A replica applying the updates holds the publisher's model after each.
#[test]
fn observe_drops_and_publishes_exactly_the_blocks_the_engine_lacked() {
    let first = tokens(3, 64); // 16 blocks of 4
    let mut branch = first[..32].to_vec(); // its first 8 blocks, then 8 of its own
    branch.extend(tokens(4, 32));
    for cached in 0..=66usize {
        let mut r = router_with(&["w"], 64, None);
        let mut replica = router_with(&["w"], 64, None);
        let a = r.route_tokens(&first, None, None, 0.0).unwrap();
        r.begin(&a).unwrap();
        r.finish(&a, 0.0).unwrap();
        let d = r.route_tokens(&branch, None, None, 1.0).unwrap();
        assert_eq!((d.cached_blocks, d.prompt_tokens), (8, 64));
        r.begin(&d).unwrap();
        replica
            .apply_updates(&r.take_updates(None), 1.0, true)
            .unwrap();
        let before = r.dump_model().unwrap();
        let result = r.observe(&d, cached, 2.0);
        if cached > 64 {
            assert_eq!(
                result.unwrap_err().to_string(),
                format!("cached_tokens = {cached} exceeds the prompt's 64 tokens")
            );
            assert!(r.take_updates(None).is_empty() && !d.is_observed());
            assert!(r.dump_model().unwrap() == before, "{cached}");
            continue;
        }
        result.unwrap_or_else(|e| panic!("{cached}: {e}"));
        let served = (1..=16).filter(|k| 4 * k <= cached).count();
        let batch = r.take_updates(None);
        let stats = replica.apply_updates(&batch, 2.0, true).unwrap();
        let mut forget = vec![2u8, 1, 0, b'w'];
        if served < 8 {
            forget.extend_from_slice(&d.hashes[served].to_le_bytes());
            assert!(batch.windows(forget.len()).any(|x| x == forget), "{cached}");
        }
        assert_eq!(stats.forgets, u64::from(served < 8), "{cached}: {stats:?}");
        assert!(
            replica.dump_model().unwrap() == r.dump_model().unwrap(),
            "{cached}"
        );
        r.check_model().unwrap();
        // The branch is held whole again; the first prompt's tail only if nothing was dropped.
        let again = r.route_tokens(&branch, None, None, 3.0).unwrap();
        assert_eq!(again.cached_blocks, 16, "{cached}");
        let again = r.route_tokens(&first, None, None, 3.0).unwrap();
        assert_eq!(
            again.cached_blocks,
            if served < 8 { 8 } else { 16 },
            "{cached}"
        );
    }
}

/// Router quarter 1/3: `Model::reserve`'s `others` — the other partitions' reservations, `n !=
/// name` → `==` (the partition's own) — passed every test: no test had two reserving endpoints
/// share a worker whose cache could not hold both. The class: how much of each reservation each
/// worker holds, after every membership change (health, role, a worker removed and added back,
/// an endpoint added or removed), against the documented rule: a prefill-pool member holds its
/// endpoint's reservation, or as much of it as its cache has unreserved (so the cache is then
/// wholly reserved); a worker outside the pool holds none; a cache never reserves more than its
/// capacity; an endpoint is added only when every member has room (then each holds it whole),
/// else refused naming a worker without room. 4 workers of 64 blocks, endpoints reserving 16 to
/// 48 blocks each, 400 random steps.
#[test]
fn every_member_holds_its_reservation_or_all_its_cache_has_unreserved() {
    let names = ["w0", "w1", "w2", "w3"];
    let config = Config {
        block_size: 4,
        capacity_blocks: 64,
        ..Config::default()
    };
    let mut r = Router::new(names.iter().map(|&n| (n, 1.0)), config).unwrap();
    let mut rng = SplitMix64(11);
    let mut draw = |n: usize| (rng.next_u64() % n as u64) as usize;
    // endpoint id -> its reservation, for those added.
    let mut endpoints: Vec<(String, usize)> = Vec::new();
    let reservations = |r: &Router, w: &str| -> Vec<(String, usize)> {
        let cache = r.workers().named(w).unwrap().cache.as_ref().unwrap();
        cache
            .reservations()
            .map(|(n, b)| (n.to_owned(), b))
            .collect()
    };
    let mut added = 0;
    for step in 0..400 {
        let w = names[draw(4)];
        match draw(6) {
            0 => {
                let healthy = r.workers().named(w).unwrap().healthy;
                r.set_healthy(w, !healthy).unwrap();
            }
            1 => {
                let role = [Role::Both, Role::Prefill, Role::Decode][draw(3)];
                r.set_role(w, role).unwrap();
            }
            2 => {
                r.remove_worker(w).unwrap();
                r.add_worker(w, 1.0).unwrap();
            }
            3 if !endpoints.is_empty() => {
                let (id, _) = endpoints.swap_remove(draw(endpoints.len()));
                r.remove_endpoint(&id).unwrap();
            }
            _ => {
                let id = format!("e{added}");
                added += 1;
                let blocks = 16 * (1 + draw(3));
                let spec = EndpointSpec {
                    pool_size: 1 + draw(2),
                    reserved_blocks: Some(blocks),
                    ..EndpointSpec::default()
                };
                match r.add_endpoint(&id, spec) {
                    Ok(()) => {
                        for m in r.endpoint_pool(&id, Some(Phase::Prefill)).unwrap() {
                            let held = reservations(&r, &m);
                            assert!(held.contains(&(id.clone(), blocks)), "{step}: {held:?}");
                        }
                        endpoints.push((id, blocks));
                    }
                    Err(e) => {
                        let e = e.to_string();
                        if e.starts_with("pool_size") {
                            continue;
                        }
                        let named = names.iter().find(|&&n| e.contains(&format!("{n:?}")));
                        let named = named.unwrap_or_else(|| panic!("{step}: {e}"));
                        assert_eq!(
                            e,
                            format!(
                                "reserved_blocks = {blocks} does not fit in worker {named:?}'s \
                                 modelled cache next to its other reservations"
                            )
                        );
                        let total: usize = reservations(&r, named).iter().map(|p| p.1).sum();
                        assert!(total + blocks > 64, "{step}: {e}");
                    }
                }
            }
        }
        for &w in &names {
            let held = reservations(&r, w);
            let total: usize = held.iter().map(|p| p.1).sum();
            assert!(total <= 64, "{step}, {w}: {held:?}");
            for (name, blocks) in &held {
                let Some(&(_, wanted)) = endpoints.iter().find(|(id, _)| id == name) else {
                    assert_eq!(*blocks, 0, "{step}, {w}: a removed endpoint's {name}");
                    continue;
                };
                let pool = r.endpoint_pool(name, Some(Phase::Prefill)).unwrap();
                if !pool.iter().any(|m| &**m == w) {
                    assert_eq!(*blocks, 0, "{step}, {w} is outside {name}'s pool: {held:?}");
                } else if *blocks != wanted {
                    assert!(
                        *blocks < wanted && total == 64,
                        "{step}, {w} holds {blocks} of {name}'s {wanted}: {held:?}"
                    );
                }
            }
            for (id, _) in &endpoints {
                let pool = r.endpoint_pool(id, Some(Phase::Prefill)).unwrap();
                if pool.iter().any(|m| &**m == w) {
                    assert!(held.iter().any(|(n, _)| n == id), "{step}, {w}: {id}");
                }
            }
        }
    }
    assert!(added > 40 && !endpoints.is_empty());
}

/// Router quarter 1: `Decision::cached_tokens` → 0 passed every Rust test (only the Python
/// suite read it). The class: the decision's derived readers against what the test itself put
/// in the cache — a prompt whose first `k` blocks (of 4 and of 16 tokens) were stored by an
/// earlier request is expected to serve `k × block size` tokens from the cache and to prefill
/// the rest of its 6 whole blocks (the partial last one is not a block).
#[test]
fn a_decisions_cached_tokens_and_prefill_blocks_are_what_the_cache_holds() {
    for block_size in [4usize, 16] {
        for k in 0..=6u32 {
            let config = Config {
                block_size,
                capacity_blocks: 64,
                ..Config::default()
            };
            let mut r = Router::new([("w", 1.0)], config).unwrap();
            let bs = block_size as u32;
            let prompt = tokens(9, 6 * bs + 1);
            if k > 0 {
                let p = r.route_tokens(&prompt[..(k * bs) as usize], None, None, 0.0);
                let p = p.unwrap();
                r.begin(&p).unwrap();
                r.finish(&p, 0.0).unwrap();
            }
            let d = r.route_tokens(&prompt, None, None, 1.0).unwrap();
            assert_eq!(d.cached_tokens(), (k * bs) as usize, "{block_size}, {k}");
            assert_eq!(d.prefill_blocks(), (6 - k) as usize, "{block_size}, {k}");
            // The route predicted the whole blocks stored: the next request finds all six.
            let again = r.route_tokens(&prompt, None, None, 2.0).unwrap();
            assert_eq!(again.cached_tokens(), 6 * block_size, "{block_size}, {k}");
            assert_eq!(again.prefill_blocks(), 0, "{block_size}, {k}");
        }
    }
}

/// Blocks reserved on worker `name`'s modelled cache, over every partition.
fn reserved_on(r: &Router, name: &str) -> usize {
    let cache = r.workers().named(name).unwrap().cache.as_ref().unwrap();
    cache.reservations().map(|(_, b)| b).sum()
}

/// Every admission check of `add_endpoint` (its documented errors: the id exists, `pool_size` 0
/// or above the healthy workers of every phase, a reservation that does not fit in a member's
/// cache next to its other reservations) against its rule, at and around each bound: 400 random
/// endpoints — ids old and new, pool sizes 0 to 7 on a fleet of 6 (some unhealthy at times),
/// reservations 0 to 30 blocks of a 40-block cache — and random removals. An accepted endpoint
/// reserves exactly its blocks on each prefill member and nothing elsewhere; a refusal is the
/// whole message (naming the first member, in slot order, whose reservations would pass the
/// capacity) and changes nothing. The members of a refused endpoint are read beforehand by
/// adding it without a reservation and removing it (its pool is the rendezvous order of its id).
/// Written for the never-run mutant `Model::can_reserve` → `true` (docs/mutants.md).
#[test]
fn every_add_endpoint_refusal_follows_its_rule_at_each_bound() {
    const CAPACITY: usize = 40;
    let names: Vec<String> = (0..6).map(|i| format!("w{i}")).collect();
    let config = Config {
        block_size: 4,
        capacity_blocks: CAPACITY,
        ..Config::default()
    };
    let mut r = Router::new(names.iter().map(|n| (n.as_str(), 1.0)), config).unwrap();
    let mut rng = SplitMix64(71);
    let mut below = |n: u64| (rng.next_u64() % n) as usize;
    let mut live: Vec<String> = Vec::new();
    let (mut refused_fit, mut accepted_full) = (0, 0);
    for step in 0..400 {
        if below(10) == 0 {
            let w = &names[below(6)];
            r.set_healthy(w, below(3) > 0).unwrap();
        }
        if below(6) == 0 && !live.is_empty() {
            let id = live.swap_remove(below(live.len() as u64));
            r.remove_endpoint(&id).unwrap();
            assert_eq!(
                r.remove_endpoint(&id),
                Err(Error::Key(format!("unknown endpoint {id:?}")))
            );
        }
        let id = if !live.is_empty() && below(8) == 0 {
            live[below(live.len() as u64)].clone()
        } else {
            format!("e{step}")
        };
        let pool_size = below(8);
        let blocks = [None, Some(below(31)), Some(below(11))][below(3)];
        let healthy = names
            .iter()
            .filter(|n| r.workers().named(n).unwrap().healthy)
            .count();
        let before: Vec<usize> = names.iter().map(|n| reserved_on(&r, n)).collect();
        let expected = if live.contains(&id) {
            Err(Error::Value(format!("endpoint {id:?} already exists")))
        } else if pool_size == 0 || pool_size > healthy {
            Err(Error::Value(format!(
                "pool_size must be between 1 and the {healthy} healthy workers of a phase, got \
                 {pool_size}"
            )))
        } else {
            let probe = EndpointSpec {
                pool_size,
                ..EndpointSpec::default()
            };
            r.add_endpoint(&id, probe).unwrap();
            let members = r.endpoint_pool(&id, Some(Phase::Prefill)).unwrap();
            r.remove_endpoint(&id).unwrap();
            let over = blocks.and_then(|b| {
                members.iter().find(|m| {
                    let slot = names.iter().position(|n| n.as_str() == &***m).unwrap();
                    before[slot] + b > CAPACITY
                })
            });
            match (blocks, over) {
                (Some(b), Some(m)) => Err(Error::Value(format!(
                    "reserved_blocks = {b} does not fit in worker {m:?}'s modelled cache next to \
                     its other reservations"
                ))),
                _ => Ok(members),
            }
        };
        let spec = EndpointSpec {
            pool_size,
            reserved_blocks: blocks,
            ..EndpointSpec::default()
        };
        let got = r.add_endpoint(&id, spec);
        let after: Vec<usize> = names.iter().map(|n| reserved_on(&r, n)).collect();
        match expected {
            Err(e) => {
                assert_eq!(got, Err(e.clone()), "step {step}");
                assert_eq!(after, before, "step {step}: a refusal changes nothing");
                if !live.contains(&id) {
                    assert!(r.endpoint(&id).is_err(), "step {step}");
                }
                refused_fit += e.to_string().contains("does not fit") as usize;
            }
            Ok(members) => {
                assert_eq!(got, Ok(()), "step {step}");
                for (i, n) in names.iter().enumerate() {
                    let member = members.iter().any(|m| &**m == n.as_str());
                    let add = if member { blocks.unwrap_or(0) } else { 0 };
                    assert_eq!(after[i], before[i] + add, "step {step}: {n}");
                    accepted_full += (member && after[i] == CAPACITY && add > 0) as usize;
                }
                live.push(id);
            }
        }
        r.check_model().unwrap();
    }
    // Both sides of the capacity bound were reached: refusals, and reservations filling a
    // cache exactly.
    assert!(
        refused_fit >= 10 && accepted_full >= 3,
        "{refused_fit} {accepted_full}"
    );
}
