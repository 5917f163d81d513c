//! Router core tests (the Python suite checks the policies against reference models).

use super::route::tiered_credit;
use super::*;

fn router(policy: Policy, names: &[&str]) -> Router {
    let config = Config {
        policy,
        block_size: 4,
        capacity_blocks: 64,
        ..Config::default()
    };
    Router::new(names.iter().map(|&n| (n, 1.0)), config).unwrap()
}

fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| seed * 100_000 + i).collect()
}

#[test]
fn a_repeated_prefix_follows_its_first_request() {
    let mut r = router(Policy::KvAware, &["a", "b", "c", "d"]);
    let first = r.route_tokens(&tokens(1, 64), None, None, 0.0).unwrap();
    assert_eq!(first.cached_blocks, 0);
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
