//! Router tests written for cargo-mutants survivors since shard 16/40 (`tests_mutants.rs` is
//! near its size limit): what every decision reports, and the policies' documented choices.

use super::tests::{router, tokens};
use super::*;

/// cargo-mutants survivor (shard 16/40): `Policy::Random`'s draw `u * total` → `u + total`
/// always chose the last candidate. Random picks a worker with probability its weight over the
/// candidates' total: 6,000 routes over weights 1, 2 and 3 (a deterministic generator) give each
/// its share within 5% of the total; and each decision's scores are those shares.
#[test]
fn random_picks_each_worker_in_proportion_to_its_weight() {
    let config = Config {
        policy: Policy::Random,
        block_size: 4,
        capacity_blocks: 64,
        ..Config::default()
    };
    let mut r = Router::new([("a", 1.0), ("b", 2.0), ("c", 3.0)], config).unwrap();
    let n = 6000u32;
    let mut count = [0u32; 3];
    for t in 0..n {
        let d = r.route_tokens(&tokens(t, 8), None, None, 0.0).unwrap();
        let i = ["a", "b", "c"]
            .iter()
            .position(|w| **w == *d.worker)
            .unwrap();
        count[i] += 1;
        let mut scores: Vec<(String, f64)> = d.scores().map(|(w, v)| (w.to_string(), v)).collect();
        scores.sort_by(|x, y| x.0.cmp(&y.0));
        let want = [("a", 1.0 / 6.0), ("b", 2.0 / 6.0), ("c", 3.0 / 6.0)];
        assert_eq!(scores.len(), 3, "{scores:?}");
        for ((w, v), (ww, wv)) in scores.iter().zip(want) {
            assert!(w == ww && (v - wv).abs() < 1e-12, "{scores:?}");
        }
    }
    for (i, weight) in [1.0, 2.0, 3.0].into_iter().enumerate() {
        let share = f64::from(count[i]) / f64::from(n);
        assert!((share - weight / 6.0).abs() < 0.05, "{count:?}");
    }
}

/// cargo-mutants survivor (shard 16/40): `self.decisions += 1` → `*= 1` gave every decision id
/// 0. A decision's id is unique per router, 1, 2, … in the order decisions are made (the
/// `Decision::id` docs): whole routes and both halves of a disaggregated pair each take the
/// next, a failed route none, and an error about a decision names its id.
#[test]
fn decision_ids_count_every_decision_made_from_one() {
    let mut r = router(Policy::KvAware, &["a", "b"]);
    r.set_role("a", Role::Prefill).unwrap();
    r.set_role("b", Role::Decode).unwrap();
    let mut ids = Vec::new();
    for t in 0..4 {
        let d = r.route_tokens(&tokens(t, 8), None, None, 0.0).unwrap();
        ids.push(d.id);
        assert!(r.route_tokens(&tokens(t, 8), None, None, f64::NAN).is_err());
        let pair = r
            .route_pd_tokens(&tokens(100 + t, 4096), None, 0.0)
            .unwrap();
        let prefill = pair.prefill.as_ref().expect("a long prompt is split");
        ids.extend([prefill.id, pair.decode.id]);
        if t == 3 {
            r.begin(&pair.decode).unwrap();
            let err = r.begin(&pair.decode).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("decision {} was already begun", ids[11])
            );
        }
    }
    assert_eq!(ids, (1..=12).collect::<Vec<u64>>());
}

/// cargo-mutants survivor (shard 16/40): `Model::validate`'s guard `!hashes.is_empty()` →
/// `true` stored an empty chain for a prompt shorter than a block, which advanced the index's
/// clock, so every block stored after it got a later tick. A route records nothing when the
/// prompt has no whole block: a router that also routed such prompts (whole and as a pair) ends
/// with the index image (its ticks included) and the model of one that did not, byte for byte.
#[test]
fn a_prompt_without_a_whole_block_changes_neither_index_nor_model() {
    let mut with = router(Policy::KvAware, &["a", "b"]);
    let mut without = router(Policy::KvAware, &["a", "b"]);
    for (step, r) in [&mut with, &mut without].into_iter().enumerate() {
        for t in 0..3u32 {
            let now = f64::from(t);
            let d = r.route_tokens(&tokens(t, 16), None, None, now).unwrap();
            r.begin(&d).unwrap();
            if step == 0 {
                let short = r.route_tokens(&tokens(10 + t, 3), None, None, now).unwrap();
                assert_eq!(short.prompt_blocks, 0);
                let pair = r.route_pd_tokens(&tokens(20 + t, 3), None, now).unwrap();
                assert_eq!(pair.decode.prompt_blocks, 0);
            }
        }
    }
    assert!(with.index().read().dump() == without.index().read().dump());
    assert!(with.dump_model().unwrap() == without.dump_model().unwrap());
}

/// cargo-mutants survivor (shard 17/40): `begin`'s `Stage::Withdrawn` arm deleted, so a
/// withdrawn decision was reported "already begun". The class: every lifecycle call's refusal
/// at every stage names the decision and why, exactly — `begin`, `prefilled`, `finish`,
/// `observe` and `withdraw` on decisions routed, begun, prefilled, observed, finished,
/// withdrawn, of another router and of a removed worker.
#[test]
fn every_lifecycle_refusal_names_the_decision_and_why() {
    let mut r = router(Policy::RoundRobin, &["a", "b"]);
    let mut other = router(Policy::RoundRobin, &["a", "b"]);
    let route = |r: &mut Router, t: u32| r.route_tokens(&tokens(t, 8), None, None, 0.0).unwrap();
    let msg = |e: Result<()>| e.unwrap_err().to_string();
    let routed = route(&mut r, 1);
    let n = routed.id;
    assert_eq!(
        msg(r.prefilled(&routed)),
        format!("decision {n} is not active (begin it first)")
    );
    assert_eq!(
        msg(r.finish(&routed, 0.0)),
        format!("decision {n} was not begun")
    );
    let foreign = route(&mut other, 2);
    let f = foreign.id;
    let made = format!("decision {f} was made by another router");
    assert_eq!(msg(r.begin(&foreign).map(drop)), made);
    assert_eq!(msg(r.prefilled(&foreign)), made);
    assert_eq!(msg(r.finish(&foreign, 0.0)), made);
    assert_eq!(msg(r.observe(&foreign, 0, 0.0)), made);
    assert_eq!(msg(r.withdraw(&foreign).map(drop)), made);

    let withdrawn = route(&mut r, 3);
    let w = withdrawn.id;
    assert!(r.withdraw(&withdrawn).unwrap());
    assert!(
        !r.withdraw(&withdrawn).unwrap(),
        "a second withdrawal is a no-op"
    );
    let gone = format!("decision {w} was withdrawn");
    assert_eq!(msg(r.begin(&withdrawn).map(drop)), gone);
    assert_eq!(
        msg(r.prefilled(&withdrawn)),
        format!("decision {w} is not active (begin it first)")
    );
    assert_eq!(msg(r.finish(&withdrawn, 0.0)), gone);
    assert_eq!(msg(r.observe(&withdrawn, 0, 0.0)), gone);

    let ran = route(&mut r, 4);
    let k = ran.id;
    r.begin(&ran).unwrap();
    assert_eq!(
        msg(r.begin(&ran).map(drop)),
        format!("decision {k} was already begun")
    );
    r.prefilled(&ran).unwrap();
    assert_eq!(
        msg(r.prefilled(&ran)),
        format!("decision {k} was already marked prefilled")
    );
    let on = format!("decision {k} was prefilled on {:?}: it ran", ran.worker);
    assert_eq!(msg(r.withdraw(&ran).map(drop)), on);
    r.observe(&ran, 0, 0.0).unwrap();
    assert_eq!(
        msg(r.observe(&ran, 0, 0.0)),
        format!("decision {k} was already observed")
    );
    r.finish(&ran, 1.0).unwrap();
    assert_eq!(
        msg(r.finish(&ran, 1.0)),
        format!("decision {k} was already finished")
    );
    assert_eq!(
        msg(r.begin(&ran).map(drop)),
        format!("decision {k} was already begun")
    );
    assert_eq!(
        msg(r.withdraw(&ran).map(drop)),
        format!("decision {k} was finished: it ran")
    );

    let observed = route(&mut r, 5);
    let o = observed.id;
    r.begin(&observed).unwrap();
    r.observe(&observed, 0, 0.0).unwrap();
    assert_eq!(
        msg(r.withdraw(&observed).map(drop)),
        format!("decision {o} was observed: it ran")
    );

    let orphan = route(&mut r, 6);
    r.remove_worker(&orphan.worker).unwrap();
    let err = r.begin(&orphan).unwrap_err();
    assert!(matches!(err, crate::Error::Key(_)), "{err:?}");
    let removed = format!(
        "worker {:?} of decision {} was removed",
        orphan.worker, orphan.id
    );
    assert_eq!(err.to_string(), removed);
}

/// Router 19/40: `no_worker`'s `able < workers.len()` → `>` never named the phase. The class:
/// every shape of the "no worker" error, whole, as `no_worker`'s doc and format give it — the
/// fleet's size and health, the workers able to do the phase (only when some are not), the
/// endpoint's pool of that phase, the workers excluded — from `route` and from `route_pd`.
#[test]
fn every_no_worker_error_says_why_whole() {
    let pd = |roles: &[(&str, Role)]| {
        let mut r = router(
            Policy::KvAware,
            &roles.iter().map(|x| x.0).collect::<Vec<_>>(),
        );
        for &(n, role) in roles {
            r.set_role(n, role).unwrap();
        }
        r
    };
    let ep = EndpointSpec {
        pool_size: 1,
        ..EndpointSpec::default()
    };
    let fail = |r: &mut Router, endpoint: Option<&str>, exclude: &[&str]| {
        let mut req = r
            .tokens_request(&tokens(1, 8), None, endpoint, 0.0)
            .unwrap();
        req.exclude = exclude;
        r.route(req).unwrap_err().to_string()
    };
    let head = "no worker to route to: ";

    let mut r = router(Policy::KvAware, &["a", "b", "c"]);
    r.add_endpoint("ep", ep).unwrap();
    for w in ["a", "b", "c"] {
        r.set_healthy(w, false).unwrap();
    }
    assert_eq!(
        fail(&mut r, None, &[]),
        format!("{head}3 workers, 0 healthy")
    );
    assert_eq!(
        fail(&mut r, Some("ep"), &[]),
        format!("{head}3 workers, 0 healthy, endpoint \"ep\" with 0 in its pool")
    );

    let mut r = router(Policy::KvAware, &["a", "b"]);
    assert_eq!(
        fail(&mut r, None, &["b", "a"]),
        format!("{head}2 workers, 2 healthy, 2 excluded")
    );

    // Roles: a prefills only, b and c do both and are unhealthy.
    let mut r = pd(&[("a", Role::Prefill), ("b", Role::Both), ("c", Role::Both)]);
    r.add_endpoint("ep", ep).unwrap();
    r.set_healthy("b", false).unwrap();
    r.set_healthy("c", false).unwrap();
    let why = "3 workers, 1 healthy, 2 able to decode";
    assert_eq!(fail(&mut r, None, &[]), format!("{head}{why}"));
    assert_eq!(
        fail(&mut r, Some("ep"), &[]),
        format!("{head}{why}, endpoint \"ep\" with 0 in its decode pool")
    );
    assert_eq!(
        fail(&mut r, Some("ep"), &["a"]),
        format!("{head}{why}, endpoint \"ep\" with 0 in its decode pool, 1 excluded")
    );
    let err = r.route_pd_tokens(&tokens(1, 8), None, 0.0).unwrap_err();
    assert_eq!(err.to_string(), format!("{head}{why}"));
    let err = r
        .route_pd_tokens(&tokens(1, 8), Some("ep"), 0.0)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("{head}{why}, endpoint \"ep\" with 0 in its decode pool")
    );
}

/// Router 19/40: power-of-two's second draw guarded by `n > 1` → `n >= 1` drew from an empty
/// range (`n - 2` overflows) when one candidate was left. The class: every policy with a lone
/// candidate — a fleet of one, the others unhealthy, the others excluded — picks it, and scores
/// no other worker.
#[test]
fn every_policy_picks_a_lone_candidate() {
    for policy in Policy::ALL {
        let mut one = router(policy, &["a"]);
        let mut sick = router(policy, &["a", "b", "c"]);
        sick.set_healthy("a", false).unwrap();
        sick.set_healthy("c", false).unwrap();
        let mut rest = router(policy, &["a", "b", "c"]);
        for (r, only, exclude) in [
            (&mut one, "a", &[][..]),
            (&mut sick, "b", &[][..]),
            (&mut rest, "c", &["a", "b"][..]),
        ] {
            for t in 0..4 {
                let key = Key::Bytes(b"k");
                let mut req = r
                    .tokens_request(&tokens(t, 8), Some(key), None, 0.0)
                    .unwrap();
                req.exclude = exclude;
                let d = r.route(req).unwrap();
                assert_eq!(&*d.worker, only, "{policy:?}");
                assert!(d.scores().all(|(w, _)| &**w == only), "{policy:?}");
            }
        }
    }
}

/// Router 19/40: the saturation test `remote > saturation × local` → `saturation + local` passed
/// the one saturated case tested (a cost ratio of 1.35 against a factor of 1). The class: the
/// rule on each side of its bound, for factors from 0 to infinity. The prefill worker p0 reports
/// one queued request with 100 blocks to prefill; a 100-block prompt then costs, by `kv_cost`'s
/// formula, 100 (queue) + (1 + 2) × 100 (each block delays one request plus the one queued at
/// the least busy prefill candidate) = 400 there, and (1 + 2) × 100 = 300 on an idle decode
/// worker: saturated exactly when the factor is below 400 / 300.
#[test]
fn the_prefill_side_is_saturated_past_its_factor_times_the_decode_cost() {
    for (saturation, saturated) in [
        (0.0, true),
        (0.5, true),
        (1.0, true),
        (1.33, true),
        (1.34, false),
        (2.0, false),
        (300.0, false),
        (f64::INFINITY, false),
    ] {
        let config = Config {
            block_size: 4,
            capacity_blocks: 64,
            pd: PdConfig {
                threshold: 0,
                saturation: Some(saturation),
                ..PdConfig::default()
            },
            ..Config::default()
        };
        let mut r = Router::new([("p0", 1.0), ("d0", 1.0), ("d1", 1.0)], config).unwrap();
        r.set_role("p0", Role::Prefill).unwrap();
        r.set_role("d0", Role::Decode).unwrap();
        r.set_role("d1", Role::Decode).unwrap();
        r.set_load("p0", Some(1), Some(1), Some(100), None).unwrap();
        let d = r.route_pd_tokens(&tokens(11, 400), None, 1.0).unwrap();
        let want = if saturated {
            PdReason::Saturated
        } else {
            PdReason::Remote
        };
        assert_eq!(d.reason, want, "saturation {saturation}");
    }
}

/// Never-run router mutants (docs/mutants.md): `pick_hash`'s `if !picked.within_bound` → `if
/// picked.within_bound` never walked past a full first choice — no Rust test loaded a `hash`
/// worker to its bound. The class: the bounded walk whole, against the rule of
/// `hashing/bounded.rs` (Mirrokni, Thorup & Zadimoghaddam) in integer arithmetic: with `T`
/// requests in flight, worker `i` takes one while its load is below `ceil(c · (T + 1) · w_i / Σw)`
/// (at least 1), `c` = 5/4; the key's rendezvous order is read from an idle fleet, each first
/// choice excluded in turn. Each route's worker, its reason (`hash` when the first choice takes
/// it, else `hash_bounded`) and its scores (each worker walked, with its load) are checked, for
/// equal and unequal weights, as the requests pile up.
#[test]
fn hash_walks_the_keys_order_past_each_worker_at_its_load_bound() {
    let names = ["a", "b", "c", "d"];
    for weights in [[1u64, 1, 1, 1], [1, 3, 1, 2]] {
        let fleet = || {
            let config = Config {
                policy: Policy::Hash,
                block_size: 4,
                ..Config::default()
            };
            let workers = names.iter().zip(weights).map(|(&n, w)| (n, w as f64));
            Router::new(workers, config).unwrap()
        };
        let key = || Some(Key::Bytes(b"the key"));
        let mut idle = fleet();
        let mut order: Vec<usize> = Vec::new();
        while order.len() < names.len() {
            let excluded: Vec<&str> = order.iter().map(|&i| names[i]).collect();
            let mut req = idle
                .tokens_request(&tokens(1, 8), key(), None, 0.0)
                .unwrap();
            req.exclude = &excluded;
            let d = idle.route(req).unwrap();
            order.push(names.iter().position(|&n| n == &*d.worker).unwrap());
        }
        let mut r = fleet();
        let mut load = [0u64; 4];
        let mut deepest = 0;
        let total_weight: u64 = weights.iter().sum();
        for step in 0..60 {
            let in_flight: u64 = load.iter().sum();
            // ceil(5 (T + 1) w / (4 Σw)), at least 1.
            let cap = |i: usize| {
                let (num, den) = (5 * (in_flight + 1) * weights[i], 4 * total_weight);
                num.div_ceil(den).max(1)
            };
            let walked = order.iter().position(|&i| load[i] < cap(i)).unwrap() + 1;
            let want = order[walked - 1];
            let d = r
                .route_tokens(&tokens(2 + step, 8), key(), None, f64::from(step))
                .unwrap();
            let ctx = format!("weights {weights:?}, step {step}");
            assert_eq!(&*d.worker, names[want], "{ctx}");
            let reason = if walked == 1 {
                Reason::Hash
            } else {
                Reason::HashBounded
            };
            assert_eq!(d.reason, reason, "{ctx}");
            let scores: Vec<(String, f64)> = d.scores().map(|(w, v)| (w.to_string(), v)).collect();
            let expected: Vec<(String, f64)> = order[..walked]
                .iter()
                .map(|&i| (names[i].to_string(), load[i] as f64))
                .collect();
            assert_eq!(scores, expected, "{ctx}");
            r.begin(&d).unwrap();
            load[want] += 1;
            deepest = deepest.max(walked);
        }
        assert!(
            deepest >= 3,
            "the walk went past two full workers: {deepest}"
        );
    }
}

/// Never-run router mutants: `check_request`'s guard `t / bs != hashes.len()` → `false` let a
/// request whose token count disagrees with its block hashes through. The class: the length
/// check on each side of its bounds, for `route` and `route_pd` (both check the request): a
/// prompt of `t` tokens in blocks of 4 has `⌊t / 4⌋` whole blocks, so 4 hashes go with 16 to 19
/// tokens and with no other count; the refusal's message whole, and nothing changed by it.
#[test]
fn a_token_count_disagreeing_with_the_block_hashes_is_refused_by_route_and_route_pd() {
    let mut r = router(Policy::KvAware, &["a", "b"]);
    for t in 0..=30usize {
        for pd in [false, true] {
            let mut req = r.tokens_request(&tokens(1, 16), None, None, 0.0).unwrap();
            assert_eq!(req.hashes.len(), 4);
            req.prompt_tokens = Some(t);
            let got = if pd {
                r.route_pd(req).map(|p| p.decode.prompt_tokens)
            } else {
                r.route(req).map(|d| d.prompt_tokens)
            };
            if (16..20).contains(&t) {
                assert_eq!(got.unwrap(), t, "{t} tokens, pd {pd}");
            } else {
                let msg = format!("4 block hashes given for a prompt of {t} tokens (blocks of 4)");
                assert_eq!(got.unwrap_err().to_string(), msg, "pd {pd}");
            }
        }
    }
    // Nothing was begun: the accepted routes left no load either.
    assert!(r.workers().iter().all(|w| w.total_active() == 0));
}

/// Never-run router mutants: `Worker::freshness_at`'s `half_life > 0.0` → `>= 0.0` gave a
/// worker stale since `now` the freshness `0.5^(0 / 0)`, NaN, for a half-life of 0 (the router's
/// own calls pass its configured half-life, > 0, but the method is public and documented in
/// `[0, 1]`). The class: every form of freshness at ages before, at and after the mark, for
/// half-lives 0 and > 0, against `0.5^(age / half_life)` (age clamped at 0; a half-life of 0
/// trusts nothing stale), through the method and through `Router::freshness`.
#[test]
fn freshness_is_half_life_decay_from_the_stale_mark_in_every_form() {
    let mut r = router(Policy::KvAware, &["a"]);
    let at = |r: &Router, now: f64, h: f64| r.workers().named("a").unwrap().freshness_at(now, h);
    for h in [0.0, 2.0, 5.0] {
        assert_eq!(at(&r, 10.0, h), 1.0, "fresh, half-life {h}");
    }
    r.mark_stale("a", 10.0).unwrap();
    for now in [7.0, 10.0, 11.0, 12.0, 20.0] {
        let age: f64 = (now - 10.0f64).max(0.0);
        assert_eq!(at(&r, now, 0.0), 0.0, "stale, half-life 0, now {now}");
        for h in [2.0, 5.0] {
            assert_eq!(
                at(&r, now, h),
                0.5f64.powf(age / h),
                "half-life {h}, now {now}"
            );
        }
        // The router's own half-life (Config::default: 5 s).
        assert_eq!(r.freshness("a", now).unwrap(), 0.5f64.powf(age / 5.0));
    }
    assert_eq!(at(&r, 12.0, 2.0), 0.5);
    r.set_freshness("a", 0.25).unwrap();
    for h in [0.0, 5.0] {
        assert_eq!(at(&r, 30.0, h), 0.25, "fixed, half-life {h}");
    }
    r.mark_fresh("a").unwrap();
    assert_eq!(at(&r, 30.0, 0.0), 1.0);
}

/// Router quarters 1 and 3 of the never-run set: round robin's grown weight `rr_current +
/// weight` → `-` and its tie guard `v <= b` → `true` (always the first candidate) passed every
/// Rust test — none routed with `round_robin` and read its choices. The class: the choice and
/// the scores of every step, against nginx's smooth weighted round robin written here
/// (`ngx_http_upstream_get_peer`: each peer's current weight grows by its weight, the largest —
/// the first on ties — is picked and loses the total), and nginx's published sequence for
/// weights 5, 1, 1: `a a b a c a a`; for fleets of equal and unequal weights.
#[test]
fn round_robin_is_nginxs_smooth_weighted_round_robin() {
    let nginx = |weights: &[i64], n: usize| {
        let total: i64 = weights.iter().sum();
        let mut current = vec![0i64; weights.len()];
        let mut steps = Vec::new();
        for _ in 0..n {
            let mut best: Option<usize> = None;
            for (i, w) in weights.iter().enumerate() {
                current[i] += w;
                if best.is_none_or(|b| current[i] > current[b]) {
                    best = Some(i);
                }
            }
            let scores = current.clone();
            let b = best.unwrap();
            current[b] -= total;
            steps.push((b, scores));
        }
        steps
    };
    let names = ["a", "b", "c", "d"];
    let chosen = |weights: &[i64], n: usize| {
        let config = Config {
            policy: Policy::RoundRobin,
            block_size: 4,
            capacity_blocks: 64,
            ..Config::default()
        };
        let fleet = names.iter().zip(weights).map(|(&n, &w)| (n, w as f64));
        let mut r = Router::new(fleet, config).unwrap();
        (0..n)
            .map(|t| {
                let d = r.route_tokens(&tokens(t as u32, 8), None, None, 0.0);
                let d = d.unwrap();
                assert_eq!(d.reason, Reason::RoundRobin);
                let scores: Vec<(String, f64)> =
                    d.scores().map(|(n, v)| (n.to_string(), v)).collect();
                (d.worker.to_string(), scores)
            })
            .collect::<Vec<_>>()
    };
    let seq: Vec<String> = chosen(&[5, 1, 1], 7).into_iter().map(|c| c.0).collect();
    assert_eq!(seq, ["a", "a", "b", "a", "c", "a", "a"]);
    for weights in [
        &[5, 1, 1][..],
        &[1, 1, 1],
        &[3, 2],
        &[4, 3, 2, 1],
        &[1, 7],
        &[2, 2, 3],
    ] {
        let total: i64 = weights.iter().sum();
        let n = 3 * total as usize;
        for (step, ((worker, scores), (b, want))) in chosen(weights, n)
            .into_iter()
            .zip(nginx(weights, n))
            .enumerate()
        {
            assert_eq!(worker, names[b], "{weights:?}, step {step}");
            let want: Vec<(String, f64)> = (0..weights.len())
                .map(|i| (names[i].to_string(), want[i] as f64))
                .collect();
            assert_eq!(scores, want, "{weights:?}, step {step}");
        }
    }
}

/// A decision's `cached_tokens` (and `cached_blocks`, `prefill_blocks`) against the engines'
/// rule: a prompt sharing its first `k` tokens with one routed before to the same worker finds
/// `k / block` whole blocks cached; vLLM and SGLang compute at least the prompt's last token, so
/// they serve `min(k / block, (tokens - 1) / block)` blocks, native profiles all `k / block`;
/// `cached_tokens` is those blocks in tokens and `prefill_blocks` the prompt's other whole
/// blocks — each profile, block sizes 1, 4 and 16, prompts of 3 blocks and of 3 blocks and a
/// token, every shared length. Written for the never-run mutant `Decision::cached_tokens` → 1
/// (docs/mutants.md): no Rust test read it.
#[test]
fn a_decisions_cached_tokens_are_the_prefix_its_engine_serves_from_cache() {
    for profile in ["native", "vllm", "sglang"] {
        for block in [1u32, 4, 16] {
            for len in [3 * block, 3 * block + 1] {
                for k in 0..=len {
                    let config = Config {
                        block_size: block as usize,
                        profile: profile.parse().unwrap(),
                        ..Config::default()
                    };
                    let mut r = Router::new([("a", 1.0)], config).unwrap();
                    let first = tokens(1, len);
                    r.route_tokens(&first, None, None, 0.0).unwrap();
                    let mut prompt = first[..k as usize].to_vec();
                    prompt.extend(tokens(2, len - k));
                    let d = r.route_tokens(&prompt, None, None, 1.0).unwrap();
                    let shared = k / block;
                    let served = match profile {
                        "native" => shared,
                        _ => shared.min((len - 1) / block),
                    } as usize;
                    let case = format!("{profile}, block {block}, {len} tokens, {k} shared");
                    assert_eq!(d.cached_blocks, served, "{case}");
                    assert_eq!(d.cached_tokens(), served * block as usize, "{case}");
                    assert_eq!(d.prompt_blocks, (len / block) as usize, "{case}");
                    assert_eq!(
                        d.prefill_blocks(),
                        (len / block) as usize - served,
                        "{case}"
                    );
                }
            }
        }
    }
}

/// `kv_aware`'s credit is the cached overlap scaled by the worker's index freshness (module
/// docs): an idle weight-1 worker holding all 8 blocks of the prompt costs
/// `(1 + delayed) · (8 − 8 · freshness)`, `delayed` = 1, its idle peer holding nothing 16 —
/// for each form of freshness: fresh, fixed at 0 to 1, stale since 10 s at ages 0 to 20 s (the
/// router's half-life, 5 s: `0.5^(age / 5)`), and fresh again. Written for the never-run mutant
/// `credit *= freshness` → `+=` (docs/mutants.md): no Rust test read a stale worker's cost.
#[test]
fn a_workers_credit_is_its_overlap_scaled_by_its_freshness() {
    let forms: Vec<(&str, f64)> = vec![
        ("fresh", 1.0),
        ("fixed 0", 0.0),
        ("fixed 0.25", 0.25),
        ("fixed 0.5", 0.5),
        ("fixed 1", 1.0),
        ("stale 0", 0.0),
        ("stale 2.5", 2.5),
        ("stale 5", 5.0),
        ("stale 20", 20.0),
        ("fresh again", 1.0),
    ];
    for (form, x) in forms {
        let mut r = router(Policy::KvAware, &["a", "b"]);
        let prompt = tokens(1, 32);
        let first = r.route_tokens(&prompt, None, None, 0.0).unwrap();
        let (held, other) = match &*first.worker {
            "a" => ("a", "b"),
            _ => ("b", "a"),
        };
        let mut now = 10.0;
        let freshness = match form {
            "fresh" => 1.0,
            "fresh again" => {
                r.mark_stale(held, 10.0).unwrap();
                r.mark_fresh(held).unwrap();
                1.0
            }
            _ if form.starts_with("fixed") => {
                r.set_freshness(held, x).unwrap();
                x
            }
            _ => {
                r.mark_stale(held, 10.0).unwrap();
                now += x;
                0.5f64.powf(x / 5.0)
            }
        };
        let d = r.route_tokens(&prompt, None, None, now).unwrap();
        let scores: Vec<(String, f64)> = d.scores().map(|(n, v)| (n.to_string(), v)).collect();
        assert_eq!(scores.len(), 2, "{form}");
        let cost = |credit: f64| 2.0 * (8.0 - credit);
        for (name, score) in scores {
            let expected = if name == held {
                cost(8.0 * freshness)
            } else {
                assert_eq!(name, other);
                cost(0.0)
            };
            assert_eq!(score, expected, "{form}: {name}");
        }
    }
}

/// Router quarters 1 and 3 (their later half): `argmin`'s tolerance `1e-9 * |min|` → `1e-9 /
/// |min|` passed every Rust test: no near-tie was scored above 1. The class: the documented tie
/// rule, costs within 1e-9 relative tie, at a cost of ~200 (an idle fleet, a 100-block prompt):
/// `b`'s weight `1 / (1 + ε)` makes its cost `(1 + ε)` times `a`'s. Within the tolerance (ε =
/// 10⁻¹², 5·10⁻¹⁰) the tie goes by each prompt's rendezvous order — the same choices for both
/// ε, `b` among them; past it (2·10⁻⁹) `a`, the cheaper, every time.
#[test]
fn costs_within_1e_9_relative_tie_at_any_magnitude() {
    let choices = |eps: f64| {
        let config = Config {
            policy: Policy::KvAware,
            block_size: 4,
            capacity_blocks: 1024,
            ..Config::default()
        };
        let mut r = Router::new([("a", 1.0), ("b", 1.0 / (1.0 + eps))], config).unwrap();
        (0..40)
            .map(|t| {
                let d = r.route_tokens(&tokens(t, 400), None, None, 0.0).unwrap();
                assert!(d.scores().all(|(_, v)| v > 100.0), "{eps}");
                d.worker.to_string()
            })
            .collect::<Vec<_>>()
    };
    let tied = choices(5e-10);
    assert_eq!(tied, choices(1e-12));
    assert!(
        tied.iter().any(|w| w == "b") && tied.iter().any(|w| w == "a"),
        "{tied:?}"
    );
    assert!(choices(2e-9).iter().all(|w| w == "a"));
}
