//! Router core tests (the Python suite checks the policies against reference models).

use super::route::tiered_credit;
use super::*;

/// A router of `names` (weight 1) with 4-token blocks and 64 blocks of cache each.
pub(super) fn router(policy: Policy, names: &[&str]) -> Router {
    let config = Config {
        policy,
        block_size: 4,
        capacity_blocks: 64,
        ..Config::default()
    };
    Router::new(names.iter().map(|&n| (n, 1.0)), config).unwrap()
}

/// `n` tokens, distinct per `seed`.
pub(super) fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| seed * 100_000 + i).collect()
}

#[test]
fn a_repeated_prefix_follows_its_first_request() {
    let mut r = router(Policy::KvAware, &["a", "b", "c", "d"]);
    let first = r.route_tokens(&tokens(1, 64), None, None, 0.0).unwrap();
    assert_eq!(first.cached_blocks, 0);
    assert_eq!(first.reason, Reason::Load); // nothing cached anywhere: chosen by load
    for t in 1..10 {
        let d = r
            .route_tokens(&tokens(1, 64), None, None, t as f64)
            .unwrap();
        assert_eq!(d.worker, first.worker);
        assert_eq!(d.cached_blocks, 16);
        assert_eq!(d.reason, Reason::Prefix);
    }
    r.check_model().unwrap();
}

#[test]
fn load_accounting_is_exact_and_lifecycle_errors_change_nothing() {
    let mut r = router(Policy::LeastLoaded, &["a", "b"]);
    let d = r.route_tokens(&tokens(2, 40), None, None, 0.0).unwrap();
    assert!(r.finish(&d, 0.0).is_err());
    r.begin(&d).unwrap();
    assert!(r.begin(&d).is_err());
    let w = r
        .workers()
        .get(r.workers().slot(&d.worker).unwrap())
        .unwrap();
    assert_eq!((w.active, w.prefill_blocks, w.decode_blocks), (1, 10, 10));
    r.prefilled(&d).unwrap();
    assert!(r.prefilled(&d).is_err());
    r.finish(&d, 1.0).unwrap();
    assert!(r.finish(&d, 1.0).is_err());
    let w = r
        .workers()
        .get(r.workers().slot(&d.worker).unwrap())
        .unwrap();
    assert_eq!((w.active, w.prefill_blocks, w.decode_blocks), (0, 0, 0));
    let mut other = router(Policy::LeastLoaded, &["a", "b"]);
    assert!(other.begin(&d).is_err());
}

#[test]
fn ttl_and_capacity_make_the_model_forget() {
    let config = Config {
        block_size: 4,
        capacity_blocks: 16,
        ttl: Some(10.0),
        ..Config::default()
    };
    let mut r = Router::new([("a", 1.0), ("b", 1.0)], config).unwrap();
    let d = r.route_tokens(&tokens(3, 32), None, None, 0.0).unwrap();
    let again = r.route_tokens(&tokens(3, 32), None, None, 5.0).unwrap();
    assert_eq!(again.cached_blocks, 8);
    let late = r.route_tokens(&tokens(3, 32), None, None, 16.0).unwrap();
    assert_eq!(late.cached_blocks, 0, "idle past the TTL");
    r.check_model().unwrap();
    // Capacity: 16 blocks per worker; two other prompts of 8 evict the first on that worker.
    let w = late.worker.clone();
    let _ = d;
    for s in 10..14 {
        let _ = r.route_tokens(&tokens(s, 32), None, None, 17.0).unwrap();
    }
    r.check_model().unwrap();
    let slot = r.workers().slot(&w).unwrap();
    assert!(r.workers().get(slot).unwrap().cache.as_ref().unwrap().len() <= 16);
}

/// `expiry_due(now)` is true exactly when a route at `now` would first drop idle blocks: with a
/// TTL, once a worker's oldest block has been idle that long; never without a TTL.
#[test]
fn expiry_is_due_when_a_route_would_drop_idle_blocks() {
    let config = Config {
        block_size: 4,
        ttl: Some(10.0),
        ..Config::default()
    };
    let mut r = Router::new([("a", 1.0), ("b", 1.0)], config).unwrap();
    assert!(!r.expiry_due(1e9), "no blocks: nothing to expire");
    r.route_tokens(&tokens(3, 32), None, None, 0.0).unwrap();
    assert!(!r.expiry_due(9.5) && r.expiry_due(10.0));
    r.route_tokens(&tokens(4, 32), None, None, 12.0).unwrap();
    assert!(!r.expiry_due(12.0) && !r.expiry_due(21.5) && r.expiry_due(22.0));
    let again = r.route_tokens(&tokens(3, 32), None, None, 12.0).unwrap();
    assert_eq!(again.cached_blocks, 0, "expired at 12.0");
    let mut plain = router(Policy::KvAware, &["a"]);
    plain.route_tokens(&tokens(3, 32), None, None, 0.0).unwrap();
    assert!(!plain.expiry_due(1e9), "no TTL: nothing expires");
}

#[test]
fn observe_drops_what_the_engine_lacked() {
    let mut r = router(Policy::KvAware, &["a", "b"]);
    let t = tokens(4, 64);
    let _ = r.route_tokens(&t, None, None, 0.0).unwrap();
    let mut branch = t[..32].to_vec();
    branch.extend(tokens(5, 32));
    let b = r.route_tokens(&branch, None, None, 1.0).unwrap();
    assert_eq!(b.cached_blocks, 8);
    // The engine had only 4 blocks: blocks 4.. of both chains are gone, then b's chain is back.
    r.observe(&b, 16, 2.0).unwrap();
    assert!(r.observe(&b, 16, 2.0).is_err());
    let again = r.route_tokens(&t, None, None, 3.0).unwrap();
    assert_eq!(again.cached_blocks, 8);
    r.check_model().unwrap();
}

#[test]
fn tiered_credit_counts_each_block_at_its_best_tier() {
    assert_eq!(tiered_credit(&mut [(4, 1.0)]), 4.0);
    // GPU 2, CPU 6 (0.5), disk 10 (0.25): 2 + 4 × 0.5 + 4 × 0.25.
    let got = tiered_credit(&mut [(6, 0.5), (10, 0.25), (2, 1.0)]);
    assert!((got - 5.0).abs() < 1e-12);
    // A slower tier that holds less adds nothing.
    assert_eq!(tiered_credit(&mut [(1, 0.5), (3, 1.0)]), 3.0);
}

#[test]
fn a_pick_changes_nothing_until_its_effect_is_committed() {
    use super::policy::{self, Buffers, Effect, View};
    let mut r = router(Policy::RoundRobin, &["a", "b", "c"]);
    let candidates = [0u32, 1, 2];
    let credit = [0.0; 3];
    let request = policy::Request {
        candidates: &candidates,
        prompt_blocks: 0,
        credit: &credit,
        hash_key: Key::Int(1),
        tie_key: Key::Int(1),
    };
    for policy in [Policy::RoundRobin, Policy::Random, Policy::PowerOfTwo] {
        let view = View {
            workers: &r.workers,
            rng: r.rng,
            bound: r.bound,
            weights: r.config.weights,
        };
        let mut buf = Buffers::default();
        let first = policy::pick(policy, &view, &request, &mut buf).unwrap();
        let again = policy::pick(policy, &view, &request, &mut buf).unwrap();
        assert_eq!((first.slot, &first.scores), (again.slot, &again.scores));
        assert_eq!(first.effect, again.effect);
        assert_ne!(first.effect, Effect::None);
        policy::commit(
            first.effect,
            first.slot,
            &candidates,
            &mut r.workers,
            &mut r.rng,
        );
    }
    // Round robin moved once (a chose: it lost the total), the generator twice.
    let rr: Vec<f64> = r.workers.iter().map(|w| w.rr_current).collect();
    assert_eq!(rr, vec![-2.0, 1.0, 1.0]);
    assert_ne!(r.rng, SplitMix64(0));
}

#[test]
fn removed_workers_leave_vacancies_until_the_table_compacts() {
    let names: Vec<String> = (0..200).map(|i| format!("w{i}")).collect();
    let mut r = router(Policy::LeastLoaded, &[]);
    for n in &names {
        r.add_worker(n, 1.0).unwrap();
    }
    let d = r.route_tokens(&tokens(1, 8), None, None, 0.0).unwrap();
    r.begin(&d).unwrap();
    let keep = &d.worker;
    // 120 leave: vacancies outnumber the 80 left (and 64) once 101 are gone, so the table
    // compacts; slots stay in the order added.
    for n in names.iter().filter(|n| n.as_str() != &**keep).take(120) {
        r.remove_worker(n).unwrap();
    }
    assert_eq!(r.workers().len(), 80);
    assert!(r.workers().slot_count() < 200, "compacted");
    let order: Vec<&str> = r.workers().iter().map(|w| &*w.name).collect();
    let mut sorted = order.clone();
    sorted.sort_by_key(|n| n[1..].parse::<u32>().unwrap());
    assert_eq!(order, sorted);
    for (slot, w) in r.workers().iter_slots() {
        assert_eq!(r.workers().slot(&w.name), Some(slot));
    }
    // The decision still finds its worker (by name and uid, its slot hint is stale).
    r.finish(&d, 1.0).unwrap();
    assert_eq!(r.workers().named(keep).unwrap().active, 0);
}

#[test]
fn endpoint_decisions_carry_the_endpoint_priority() {
    let mut r = router(Policy::KvAware, &["a", "b", "c", "d"]);
    let spec = EndpointSpec {
        pool_size: 2,
        priority: 7,
        ..EndpointSpec::default()
    };
    r.add_endpoint("gold", spec).unwrap();
    r.add_endpoint("plain", EndpointSpec::default()).unwrap();
    let d = r
        .route_tokens(&tokens(6, 32), None, Some("gold"), 0.0)
        .unwrap();
    assert_eq!(d.priority, 7);
    assert_eq!(r.endpoint("gold").unwrap().priority, 7);
    let plain = r
        .route_tokens(&tokens(6, 32), None, Some("plain"), 0.0)
        .unwrap();
    assert_eq!(plain.priority, 0);
    let public = r.route_tokens(&tokens(6, 32), None, None, 0.0).unwrap();
    assert_eq!(public.priority, 0);
    // A refused endpoint is not added, whatever its priority.
    let too_big = EndpointSpec {
        pool_size: 5,
        priority: -3,
        ..EndpointSpec::default()
    };
    assert!(r.add_endpoint("big", too_big).is_err());
    assert!(r.endpoint("big").is_err());
}

/// An endpoint salt is never empty (the hasher takes "" as no salt: the endpoint's tokens would
/// hash as untenanted requests' while its given block hashes were salted), nor given to an
/// endpoint that shares the router's namespace (it was dropped); each refusal names the endpoint
/// and adds nothing.
#[test]
fn endpoint_salts_are_never_empty_nor_dropped() {
    let mut r = router(Policy::KvAware, &["a", "b"]);
    let spec = |salt, isolate| EndpointSpec {
        salt,
        isolate,
        ..EndpointSpec::default()
    };
    for (id, s, why) in [
        (
            "t",
            spec(Some(""), true),
            "endpoint \"t\": salt \"\" is no salt",
        ),
        (
            "",
            spec(None, true),
            "endpoint \"\": an isolated endpoint is salted with its id",
        ),
        (
            "u",
            spec(Some("s"), false),
            "endpoint \"u\": salt \"s\" given with isolate=False",
        ),
    ] {
        match r.add_endpoint(id, s) {
            Err(Error::Value(m)) => assert!(m.starts_with(why), "{m}"),
            other => panic!("{id:?} {s:?}: {other:?}"),
        }
        assert!(r.endpoint(id).is_err());
    }
    r.add_endpoint("", spec(Some("s"), true)).unwrap();
    r.add_endpoint("t", spec(None, false)).unwrap();
    assert_eq!(r.endpoint("").unwrap().salt.as_deref(), Some("s"));
    assert_eq!(r.endpoint("t").unwrap().salt, None);
}

/// `freshness(now)` refuses a `now` that is not finite, as `mark_stale` and `route` do (NaN
/// answered 1.0: a stale worker looked fresh).
#[test]
fn freshness_needs_a_finite_now() {
    let mut r = router(Policy::KvAware, &["a"]);
    r.mark_stale("a", 100.0).unwrap();
    for now in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        match r.freshness("a", now) {
            Err(Error::Value(m)) => {
                assert_eq!(m, format!("now must be a finite number, got {now}"))
            }
            other => panic!("{now}: {other:?}"),
        }
    }
    let f = r
        .freshness("a", 100.0 + r.config().stale_half_life)
        .unwrap();
    assert!((f - 0.5).abs() < 1e-12, "{f}");
}

mod withdraw {
    use super::*;

    /// Each worker's overlap with `prompts` (the model as routes see it).
    fn overlaps(r: &Router, prompts: &[Vec<u64>]) -> Vec<Vec<(String, u32)>> {
        let index = r.index().read();
        prompts
            .iter()
            .map(|p| {
                let mut m = Vec::new();
                index.match_into(p, &mut m);
                let mut named: Vec<(String, u32)> = m
                    .iter()
                    .map(|&(id, n)| (index.worker_name(id).unwrap().to_string(), n))
                    .collect();
                named.sort();
                named
            })
            .collect()
    }

    fn hashes(r: &Router, seed: u32, n: u32) -> Vec<u64> {
        let mut out = Vec::new();
        let toks = tokens(seed, n);
        r.hasher_for(None)
            .unwrap()
            .hash_into(&toks, &crate::blocks::ChainState::Root, &[], &mut out)
            .unwrap();
        out
    }

    #[test]
    fn a_withdrawn_route_leaves_the_model_as_if_it_never_happened() {
        let mut r = router(Policy::KvAware, &["a", "b"]);
        let shared = r.route_tokens(&tokens(1, 8), None, None, 0.0).unwrap();
        r.begin(&shared).unwrap();
        // Same first two blocks, then three new ones: only those three leave.
        let mut longer = tokens(1, 8);
        longer.extend(tokens(2, 12));
        let prompts = [hashes(&r, 1, 8), {
            let mut h = Vec::new();
            r.hasher_for(None)
                .unwrap()
                .hash_into(&longer, &crate::blocks::ChainState::Root, &[], &mut h)
                .unwrap();
            h
        }];
        let before = overlaps(&r, &prompts);
        let d = r.route_tokens(&longer, None, None, 1.0).unwrap();
        assert_eq!(
            (d.worker.clone(), d.cached_blocks),
            (shared.worker.clone(), 2)
        );
        assert_ne!(overlaps(&r, &prompts), before);
        assert!(r.withdraw(&d).unwrap());
        assert_eq!(overlaps(&r, &prompts), before);
        assert_eq!(d.stage(), Stage::Withdrawn);
        assert!(!r.withdraw(&d).unwrap(), "idempotent");
        assert_eq!(overlaps(&r, &prompts), before);
        assert!(r.begin(&d).is_err());
        assert!(r.finish(&d, 2.0).is_err());
        assert!(r.observe(&d, 0, 2.0).is_err());
        r.check_model().unwrap();
    }

    #[test]
    fn blocks_another_decision_recorded_since_stay() {
        let mut r = router(Policy::KvAware, &["a"]);
        let a = r.route_tokens(&tokens(3, 16), None, None, 0.0).unwrap();
        // b shares a's first two (new) blocks and was routed after a: they stay, a's last two go.
        let b = r.route_tokens(&tokens(3, 8), None, None, 0.5).unwrap();
        assert_eq!(b.cached_blocks, 2);
        assert!(r.withdraw(&a).unwrap());
        let full = hashes(&r, 3, 16);
        assert_eq!(
            overlaps(&r, std::slice::from_ref(&full)),
            vec![vec![("a".into(), 2)]]
        );
        // b added nothing itself: withdrawing it too keeps the two blocks (the documented limit:
        // a block two withdrawn decisions shared stays, as after an eviction the model missed).
        assert!(r.withdraw(&b).unwrap());
        assert_eq!(overlaps(&r, &[full]), vec![vec![("a".into(), 2)]]);
        r.check_model().unwrap();
    }

    #[test]
    fn a_begun_decision_gives_back_its_load_and_one_that_ran_cannot_be_withdrawn() {
        let mut r = router(Policy::LeastLoaded, &["a"]);
        let d = r.route_tokens(&tokens(4, 12), None, None, 0.0).unwrap();
        r.begin(&d).unwrap();
        assert!(r.withdraw(&d).unwrap());
        let w = r.workers().named("a").unwrap();
        assert_eq!((w.active, w.prefill_blocks, w.decode_blocks), (0, 0, 0));
        let ran = r.route_tokens(&tokens(5, 12), None, None, 0.0).unwrap();
        r.begin(&ran).unwrap();
        r.prefilled(&ran).unwrap();
        assert!(r.withdraw(&ran).is_err());
        assert_eq!(ran.stage(), Stage::Active, "the error changed nothing");
        let mut other = router(Policy::LeastLoaded, &["a"]);
        let foreign = other.route_tokens(&tokens(6, 4), None, None, 0.0).unwrap();
        assert!(r.withdraw(&foreign).is_err());
    }
}

mod engine_hit {
    use super::super::decision::engine_hit_blocks;
    use super::*;
    use crate::blocks::Profile;

    #[test]
    fn engines_compute_at_least_the_last_token() {
        let vllm = Profile::Vllm(Default::default());
        // 32 tokens of 16, both blocks held: vLLM and SGLang serve 31 tokens, so one block.
        assert_eq!(engine_hit_blocks(vllm, 32, 16, None, 2), 1);
        assert_eq!(engine_hit_blocks(Profile::Sglang, 32, 16, None, 2), 1);
        assert_eq!(engine_hit_blocks(Profile::Native, 32, 16, None, 2), 2);
        // 33 tokens: the partial last block is computed anyway; both full blocks are hits.
        assert_eq!(engine_hit_blocks(vllm, 33, 16, None, 2), 2);
        assert_eq!(engine_hit_blocks(vllm, 32, 16, None, 1), 1);
        assert_eq!(engine_hit_blocks(vllm, 0, 16, None, 0), 0);
    }

    #[test]
    fn a_fully_cached_vllm_prompt_is_predicted_one_block_short_and_observe_agrees() {
        let config = Config {
            policy: Policy::KvAware,
            block_size: 4,
            profile: Profile::Vllm(Default::default()),
            capacity_blocks: 64,
            ..Config::default()
        };
        let mut r = Router::new([("a", 1.0)], config).unwrap();
        let first = r.route_tokens(&tokens(1, 16), None, None, 0.0).unwrap();
        r.begin(&first).unwrap();
        r.finish(&first, 0.0).unwrap();
        let again = r.route_tokens(&tokens(1, 16), None, None, 1.0).unwrap();
        assert_eq!((again.cached_blocks, again.prefill_blocks()), (3, 1));
        // vLLM reports 12 tokens: nothing is forgotten, the next route still matches all four.
        r.begin(&again).unwrap();
        r.observe(&again, 12, 1.0).unwrap();
        r.finish(&again, 1.0).unwrap();
        let third = r.route_tokens(&tokens(1, 20), None, None, 2.0).unwrap();
        assert_eq!(third.cached_blocks, 4);
        r.check_model().unwrap();
    }
}

#[test]
fn a_follow_up_is_credited_with_the_prefix_still_in_flight() {
    // Events mode: the engine has announced nothing yet, but the first turn is begun on its
    // worker, so the second turn (same prefix + more) goes there and counts the prefix as hit.
    let config = Config {
        block_size: 4,
        mode: IndexMode::Events,
        ..Config::default()
    };
    let mut r = Router::new(["a", "b", "c"].map(|n| (n, 1.0)), config).unwrap();
    let turn1 = tokens(7, 40);
    let mut turn2 = turn1.clone();
    turn2.extend(tokens(8, 8));
    let first = r.route_tokens(&turn1, None, None, 0.0).unwrap();
    assert_eq!(first.cached_blocks, 0);
    r.begin(&first).unwrap();
    let w = r.workers().named(&first.worker).unwrap();
    assert_eq!((w.queued, w.prefill_blocks), (1, 10));
    let second = r.route_tokens(&turn2, None, None, 0.1).unwrap();
    assert_eq!(second.worker, first.worker);
    assert_eq!(second.cached_blocks, 0); // no event yet: the index holds nothing
    assert_eq!((second.inflight_blocks, second.prefill_blocks()), (10, 2));
    assert_eq!(second.reason, Reason::Prefix);
    r.begin(&second).unwrap();
    let w = r.workers().named(&first.worker).unwrap();
    assert_eq!((w.queued, w.prefill_blocks, w.decode_blocks), (2, 12, 22));
    // The follow-up adds 2 blocks to the cache; its prefix is shared.
    assert_eq!(w.written_blocks, 10 + 2);
    // Once both finish, nothing is in flight and every counter is back to zero.
    r.prefilled(&first).unwrap();
    r.finish(&first, 1.0).unwrap();
    r.finish(&second, 1.0).unwrap();
    let w = r.workers().named(&first.worker).unwrap();
    assert_eq!(
        (w.active, w.queued, w.prefill_blocks, w.decode_blocks),
        (0, 0, 0, 0)
    );
    assert!(r.inflight.as_ref().unwrap().index().is_empty());
    let again = r.route_tokens(&turn2, None, None, 2.0).unwrap();
    assert_eq!((again.cached_blocks, again.inflight_blocks), (0, 0)); // no event, none in flight
}

mod inflight {
    use super::super::inflight::*;

    fn overlap(f: &InFlight, query: &[u64], worker: &str) -> u32 {
        let mut out = Vec::new();
        f.index().match_into(query, &mut out);
        let id = f.index().worker_id(worker);
        out.iter()
            .find(|(w, _)| Some(*w) == id)
            .map_or(0, |&(_, n)| n)
    }

    #[test]
    fn shared_prefixes_stay_until_their_last_request_finishes() {
        let mut f = InFlight::new().unwrap();
        f.add("a", 1, &[1, 2, 3]).unwrap();
        f.add("a", 2, &[1, 2, 3, 4, 5]).unwrap();
        f.add("a", 3, &[1, 2, 9]).unwrap();
        assert_eq!(f.blocks("a"), 6);
        assert_eq!(overlap(&f, &[1, 2, 3, 4, 5, 6], "a"), 5);
        f.release("a", 2);
        assert_eq!(f.blocks("a"), 4);
        assert_eq!(overlap(&f, &[1, 2, 3, 4, 5, 6], "a"), 3);
        f.release("a", 1);
        assert_eq!(overlap(&f, &[1, 2, 3], "a"), 2);
        f.release("a", 1); // released already: nothing happens
        assert_eq!(f.blocks("a"), 3);
        f.release("a", 3);
        assert_eq!(f.blocks("a"), 0);
        assert!(f.index().is_empty());
        f.index().check_invariants().unwrap();
    }

    #[test]
    fn the_same_prompt_twice_is_held_until_both_finish() {
        let mut f = InFlight::new().unwrap();
        f.add("a", 1, &[1, 2]).unwrap();
        f.add("a", 2, &[1, 2]).unwrap();
        assert!(f.add("a", 2, &[1, 2]).is_err()); // a key in flight already
        f.release("a", 1);
        assert_eq!(overlap(&f, &[1, 2], "a"), 2);
        f.release("a", 2);
        assert_eq!(f.blocks("a"), 0);
    }

    #[test]
    fn workers_are_separate_and_removable() {
        let mut f = InFlight::new().unwrap();
        f.add("a", 1, &[1, 2]).unwrap();
        f.add("b", 2, &[1, 2, 3]).unwrap();
        assert_eq!(overlap(&f, &[1, 2, 3], "a"), 2);
        assert_eq!(overlap(&f, &[1, 2, 3], "b"), 3);
        f.remove_worker("b");
        assert_eq!(overlap(&f, &[1, 2, 3], "b"), 0);
        f.release("b", 2); // a removed worker's release is a no-op
        f.add("b", 3, &[7]).unwrap();
        assert_eq!(f.blocks("b"), 1);
        assert_eq!(f.blocks("a"), 2);
    }

    #[test]
    fn a_contradicting_chain_changes_nothing() {
        let mut f = InFlight::new().unwrap();
        f.add("a", 1, &[1, 2, 3]).unwrap();
        // Block 3 again, but after 5 instead of 2: not a chain of the same prefix tree.
        assert!(f.add("a", 2, &[1, 5, 3]).is_err());
        assert_eq!(f.blocks("a"), 3);
        f.release("a", 2); // never added: nothing to release
        assert_eq!(overlap(&f, &[1, 2, 3], "a"), 3);
        f.release("a", 1);
        assert_eq!(f.blocks("a"), 0);
    }
}

mod pd {
    use super::super::pd::*;
    use super::*;

    fn fleet(roles: &[(&str, Role)], pd: PdConfig) -> Router {
        let config = Config {
            block_size: 4,
            capacity_blocks: 64,
            pd,
            ..Config::default()
        };
        let mut r = Router::new(roles.iter().map(|&(n, _)| (n, 1.0)), config).unwrap();
        for &(n, role) in roles {
            r.set_role(n, role).unwrap();
        }
        r
    }

    const P: Role = Role::Prefill;
    const D: Role = Role::Decode;

    #[test]
    fn a_long_prompt_is_split_and_its_prefix_followed_on_the_prefill_side() {
        let pd = PdConfig {
            threshold: 8,
            ..PdConfig::default()
        };
        let mut r = fleet(&[("p0", P), ("p1", P), ("d0", D), ("d1", D)], pd);
        let first = r.route_pd_tokens(&tokens(1, 64), None, 0.0).unwrap();
        assert_eq!(first.reason, PdReason::Remote);
        let prefill = first.prefill.as_ref().unwrap();
        assert!(prefill.worker.starts_with('p') && first.decode.worker.starts_with('d'));
        assert_eq!(
            (prefill.half, first.decode.half),
            (Half::Prefill, Half::Decode)
        );
        assert_eq!(first.decode.prefill_blocks(), 0);
        r.begin(prefill).unwrap();
        r.begin(&first.decode).unwrap();
        let pw = r.workers().named(&prefill.worker).unwrap();
        assert_eq!(
            (pw.active, pw.prefill_blocks, pw.decode_blocks),
            (1, 16, 16)
        );
        let dw = r.workers().named(&first.decode.worker).unwrap();
        assert_eq!((dw.active, dw.prefill_blocks, dw.decode_blocks), (1, 0, 16));
        r.finish(prefill, 1.0).unwrap();
        // The same prompt plus a long new part: prefill where the prefix is, the decode worker
        // (which received the prompt's KV) holds it too, but lacks the new part.
        let mut longer = tokens(1, 64);
        longer.extend(tokens(2, 64));
        let next = r.route_pd_tokens(&longer, None, 2.0).unwrap();
        assert_eq!(next.reason, PdReason::Remote);
        assert_eq!(next.prefill.as_ref().unwrap().worker, prefill.worker);
        assert_eq!(next.prefill.as_ref().unwrap().cached_blocks, 16);
        // A short continuation of what the decode worker holds runs there whole.
        let mut turn = longer.clone();
        turn.extend(tokens(3, 8));
        let local = r.route_pd_tokens(&turn, None, 3.0).unwrap();
        assert_eq!(local.reason, PdReason::Short);
        assert!(!local.disaggregate());
        assert_eq!(local.decode.half, Half::Whole);
        assert_eq!(local.decode.worker, next.decode.worker);
        assert_eq!(local.decode.prefill_blocks(), 2);
        r.check_model().unwrap();
    }

    #[test]
    fn decode_goes_where_kv_is_free_and_short_prompts_stay_whole() {
        let pd = PdConfig {
            threshold: 512,
            ..PdConfig::default()
        };
        let mut r = fleet(&[("p0", P), ("d0", D), ("d1", D)], pd);
        let big = r.route_pd_tokens(&tokens(4, 4096), None, 0.0).unwrap();
        r.begin(&big.decode).unwrap();
        // d_big holds 1024 blocks of running requests: the next decode goes to the other one.
        let other = r.route_pd_tokens(&tokens(5, 4096), None, 1.0).unwrap();
        assert_ne!(other.decode.worker, big.decode.worker);
        assert_eq!(other.reason, PdReason::Remote);
        // 512 tokens (the threshold) or fewer: prefilled on the decode worker.
        let short = r.route_pd_tokens(&tokens(6, 512), None, 2.0).unwrap();
        assert_eq!(
            (short.reason, short.disaggregate()),
            (PdReason::Short, false)
        );
        let long = r.route_pd_tokens(&tokens(7, 516), None, 3.0).unwrap();
        assert_eq!(long.reason, PdReason::Remote);
    }

    #[test]
    fn without_local_prefill_every_pair_is_split_unless_a_worker_does_both() {
        let pd = PdConfig {
            local_prefill: false,
            ..PdConfig::default()
        };
        let mut r = fleet(&[("p0", P), ("d0", D)], pd);
        let d = r.route_pd_tokens(&tokens(8, 8), None, 0.0).unwrap();
        assert_eq!((d.reason, d.disaggregate()), (PdReason::Remote, true));
        r.set_healthy("p0", false).unwrap();
        assert!(matches!(
            r.route_pd_tokens(&tokens(8, 8), None, 1.0),
            Err(Error::NoWorker(_))
        ));
        // A worker doing both can take the whole request.
        r.add_worker_as("b0", 1.0, Role::Both).unwrap();
        r.set_healthy("d0", false).unwrap();
        let d = r.route_pd_tokens(&tokens(8, 8), None, 2.0).unwrap();
        assert_eq!((d.reason, &*d.decode.worker), (PdReason::Short, "b0"));
        // Decode workers that may prefill take the whole request when nothing else prefills.
        let mut r = fleet(&[("p0", P), ("d0", D)], PdConfig::default());
        r.set_healthy("p0", false).unwrap();
        let d = r.route_pd_tokens(&tokens(8, 4096), None, 0.0).unwrap();
        assert_eq!((d.reason, &*d.decode.worker), (PdReason::NoPrefill, "d0"));
        // Plain route() never picks a prefill-only worker.
        r.add_worker_as("b0", 1.0, Role::Both).unwrap();
        r.set_healthy("p0", true).unwrap();
        r.set_healthy("b0", false).unwrap();
        r.set_healthy("d0", false).unwrap();
        assert!(matches!(
            r.route_tokens(&tokens(9, 8), None, None, 3.0),
            Err(Error::NoWorker(_))
        ));
    }

    #[test]
    fn a_saturated_prefill_side_sends_the_prefill_to_the_decode_worker() {
        let pd = PdConfig {
            threshold: 0,
            saturation: Some(1.0),
            ..PdConfig::default()
        };
        let mut r = fleet(&[("p0", P), ("d0", D), ("d1", D)], pd);
        let first = r.route_pd_tokens(&tokens(10, 400), None, 0.0).unwrap();
        assert_eq!(first.reason, PdReason::Remote);
        r.begin(first.prefill.as_ref().unwrap()).unwrap();
        // p0 has 100 blocks queued (1 request: each block delays 2 others): a 100-block prompt
        // costs 100 + 3 × 100 + 0.05 × 100 there, 3 × 100 on a decode worker.
        let next = r.route_pd_tokens(&tokens(11, 400), None, 1.0).unwrap();
        assert_eq!(next.reason, PdReason::Saturated);
        assert_eq!(next.decode.half, Half::Whole);
    }

    #[test]
    fn endpoint_pools_have_a_part_per_phase_and_follow_roles() {
        let names: Vec<String> = (0..12).map(|i| format!("w{i}")).collect();
        let roles: Vec<(&str, Role)> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), if i % 3 == 0 { P } else { D }))
            .collect();
        let mut r = fleet(&roles, PdConfig::default());
        let spec = EndpointSpec {
            pool_size: 2,
            reserved_blocks: Some(8),
            ..EndpointSpec::default()
        };
        r.add_endpoint("ep", spec).unwrap();
        let prefill = r.endpoint_pool("ep", Some(Phase::Prefill)).unwrap();
        let decode = r.endpoint_pool("ep", Some(Phase::Decode)).unwrap();
        assert_eq!((prefill.len(), decode.len()), (2, 2));
        assert!(prefill.iter().all(|n| r.role(n).unwrap() == P));
        assert!(decode.iter().all(|n| r.role(n).unwrap() == D));
        // Reservations live on the prefill members only.
        let reserved = |r: &Router, n: &str| {
            let w = r.workers().named(n).unwrap();
            w.cache
                .as_ref()
                .unwrap()
                .reservations()
                .map(|(_, b)| b)
                .sum::<usize>()
        };
        assert!(prefill.iter().all(|n| reserved(&r, n) == 8));
        assert!(decode.iter().all(|n| reserved(&r, n) == 0));
        // A prefill member turned decoder leaves the prefill part (its reservation drops) …
        let moved = prefill[0].clone();
        r.set_role(&moved, D).unwrap();
        let after = r.endpoint_pool("ep", Some(Phase::Prefill)).unwrap();
        assert!(!after.contains(&moved) && after.len() == 2);
        assert_eq!(reserved(&r, &moved), 0);
        // … and takes its place back when it prefills again.
        r.set_role(&moved, P).unwrap();
        assert_eq!(
            r.endpoint_pool("ep", Some(Phase::Prefill)).unwrap(),
            prefill
        );
        assert_eq!(reserved(&r, &moved), 8);
        let pair = r
            .route_pd_tokens(&tokens(12, 4096), Some("ep"), 0.0)
            .unwrap();
        assert!(prefill.contains(&pair.prefill.unwrap().worker));
        assert!(decode.contains(&pair.decode.worker));
        assert!(
            r.add_endpoint(
                "big",
                EndpointSpec {
                    pool_size: 9,
                    ..EndpointSpec::default()
                }
            )
            .is_err(),
            "8 decoders at most"
        );
    }
}

mod prepared_then_locked {
    use super::*;

    /// A prompt is hashed with the router's lock free (callers of the router never wait behind
    /// the hashing), then routed under it; a hashing error takes no lock and routes nothing.
    #[test]
    fn prepares_with_the_lock_free_then_runs_under_it() {
        let lock = parking_lot::Mutex::new(router(Policy::KvAware, &["a", "b"]));
        let (mut free_while_preparing, mut held_while_routing) = (None, None);
        let t = tokens(1, 16);
        let hasher = lock.lock().hasher_for(None).unwrap();
        let d = super::super::prepared_then_locked(
            &lock,
            || {
                free_while_preparing = Some(!lock.is_locked());
                prompt_hashes(&hasher, &t)
            },
            |r, hashes| {
                held_while_routing = Some(lock.is_locked());
                r.route(RouteRequest {
                    hashes,
                    prompt_tokens: Some(t.len()),
                    key: None,
                    endpoint: None,
                    exclude: &[],
                    now: 0.0,
                })
            },
        )
        .unwrap();
        assert_eq!(free_while_preparing, Some(true));
        assert_eq!(held_while_routing, Some(true));
        assert_eq!(d.prompt_blocks, 4);
        let mut routed = false;
        let err = super::super::prepared_then_locked(
            &lock,
            || -> Result<()> { Err(Error::Value("bad prompt".into())) },
            |_, ()| {
                routed = true;
                Ok(())
            },
        );
        assert_eq!(err, Err(Error::Value("bad prompt".into())));
        assert!(!routed && !lock.is_locked());
    }
}
