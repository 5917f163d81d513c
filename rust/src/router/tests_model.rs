//! The router's worker table and load counters against a plain reference model: random calls
//! of every public membership, health, freshness and load method (written for the class of
//! cargo-mutants survivors most often found in the router, see the test's doc).

use super::tests::{router, tokens};
use super::*;

/// A worker as the reference model of [`the_worker_table_and_its_loads_follow_a_reference_model`]
/// sees it: what was set through the public calls, and the decisions begun on it.
#[derive(Clone, Debug)]
struct ModelWorker {
    name: String,
    /// Which addition of the name this is (a removed and re-added worker is another one).
    added: u32,
    weight: f64,
    healthy: bool,
    role: Role,
    /// Freshness as set: `Fresh`, stale since a time, or a fixed value.
    freshness: Freshness,
    /// The engine-reported figures (active, queued, prefill, decode) last given, if any.
    reported: [Option<u64>; 4],
    /// The others' load at the last report (wire order; `written` is never reported).
    others: [u64; 4],
}

/// A decision of the model: its worker, `[active, queued, prefill, decode, written]` it holds on
/// that worker while begun, and whether it was begun / prefilled.
struct ModelDecision {
    d: Decision,
    /// The `added` of its worker.
    added: u32,
    begun: bool,
    prefilled: bool,
}

/// The own load of `name` in the model: the sum over its begun, unfinished decisions.
fn model_own(decisions: &[ModelDecision], name: &str) -> [u64; 5] {
    let mut own = [0u64; 5];
    for m in decisions.iter().filter(|m| m.begun && &*m.d.worker == name) {
        let prefill = m.d.prefill_blocks() as u64;
        let queued = u64::from(!m.prefilled);
        let add = [
            1,
            queued,
            prefill * queued,
            m.d.prompt_blocks as u64,
            prefill,
        ];
        for (o, a) in own.iter_mut().zip(add) {
            *o += a;
        }
    }
    own
}

/// The class of survivor most often found in the router (shards 0/40 to 6/40: the healthy count
/// after a removal, `uniform()` after removals, `set_freshness`, `config()`, `endpoints()`, the
/// reasons' names, load counters): a reporting call or a counter of the worker table that no
/// test read back after the calls that change it. Random calls of every public membership,
/// health, freshness and load method — valid and invalid — against a plain reference model:
/// after each, every count and every worker's reported state must be the model's, and a call
/// that fails must change nothing.
#[test]
fn the_worker_table_and_its_loads_follow_a_reference_model() {
    let mut r = router(Policy::KvAware, &["s0", "s1", "s2"]);
    // An endpoint whose pools every step checks too (members of each phase, and of either).
    let spec = EndpointSpec {
        pool_size: 3,
        ..EndpointSpec::default()
    };
    r.add_endpoint("e", spec).unwrap();
    let half_life = r.config().stale_half_life;
    let mut rng = SplitMix64(21);
    let mut below = |n: u64| rng.next_u64() % n;
    let mut model: Vec<ModelWorker> = ["s0", "s1", "s2"]
        .map(|name| ModelWorker {
            name: name.to_owned(),
            added: 0,
            weight: 1.0,
            healthy: true,
            role: Role::Both,
            freshness: Freshness::Fresh,
            reported: [None; 4],
            others: [0; 4],
        })
        .to_vec();
    let mut decisions: Vec<ModelDecision> = Vec::new();
    let roles = [Role::Both, Role::Prefill, Role::Decode];
    let (mut slots, mut compactions) = (0, 0);
    for step in 0..2000u32 {
        let now = f64::from(step) * 0.25;
        // A new name, a worker of the model, or one of a few names (calls meet existing workers
        // and missing ones); the table is kept small, so its weights are all equal at times.
        let name = match below(8) {
            0 => format!("n{step}"),
            1..4 if !model.is_empty() => model[below(model.len() as u64) as usize].name.clone(),
            _ => format!("w{}", below(6)),
        };
        let at = model.iter().position(|w| w.name == name);
        let op = if model.len() > 6 && below(3) == 0 {
            2
        } else {
            below(13)
        };
        let ok = match op {
            0 | 1 => {
                let weight = [1.0, 1.0, 1.0, 2.0, 0.5, 0.0, -1.0, f64::NAN][below(8) as usize];
                let role = roles[below(3) as usize];
                let res = r.add_worker_as(&name, weight, role);
                let valid = at.is_none() && weight.is_finite() && weight > 0.0;
                if valid {
                    model.push(ModelWorker {
                        name: name.clone(),
                        added: step,
                        weight,
                        healthy: true,
                        role,
                        freshness: Freshness::Fresh,
                        reported: [None; 4],
                        others: [0; 4],
                    });
                }
                (res.is_ok(), valid)
            }
            2 => {
                let res = r.remove_worker(&name);
                if let Some(i) = at {
                    model.remove(i);
                }
                (res.is_ok(), at.is_some())
            }
            3 => {
                let healthy = below(2) == 0;
                let res = r.set_healthy(&name, healthy);
                if let Some(i) = at {
                    model[i].healthy = healthy;
                }
                (res.is_ok(), at.is_some())
            }
            4 => {
                let role = roles[below(3) as usize];
                let res = r.set_role(&name, role);
                if let Some(i) = at {
                    model[i].role = role;
                }
                (res.is_ok(), at.is_some())
            }
            5 => {
                let res = r.mark_stale(&name, now);
                if let Some(i) = at {
                    if !matches!(model[i].freshness, Freshness::StaleSince(_)) {
                        model[i].freshness = Freshness::StaleSince(now);
                    }
                }
                (res.is_ok(), at.is_some())
            }
            6 => {
                let res = r.mark_fresh(&name);
                if let Some(i) = at {
                    model[i].freshness = Freshness::Fresh;
                }
                (res.is_ok(), at.is_some())
            }
            7 => {
                let value = [0.0, 0.3, 1.0, -0.5, 1.5][below(5) as usize];
                let res = r.set_freshness(&name, value);
                let valid = at.is_some() && (0.0..=1.0).contains(&value);
                if let (Some(i), true) = (at, valid) {
                    model[i].freshness = Freshness::Fixed(value);
                }
                (res.is_ok(), valid)
            }
            8 => {
                let figures = [0, 1, 2, 3].map(|_| (below(3) > 0).then(|| below(40)));
                let res = r.set_load(&name, figures[0], figures[1], figures[2], figures[3]);
                if let Some(i) = at {
                    let own = model_own(&decisions, &name);
                    let own = [own[0], own[1], own[2], own[3]];
                    for k in 0..4 {
                        if let Some(v) = figures[k] {
                            model[i].reported[k] = Some(v);
                            model[i].others[k] = v.saturating_sub(own[k]);
                        }
                    }
                }
                (res.is_ok(), at.is_some())
            }
            9 | 10 => {
                // A whole request goes to a healthy worker that decodes, if there is one.
                let able = |w: &ModelWorker| w.healthy && w.role.does(Phase::Decode);
                let any = model.iter().any(able);
                let t = tokens(below(5) as u32, 4 * (1 + below(12) as u32));
                let res = r.route_tokens(&t, None, None, now);
                if let Ok(d) = res {
                    let w = model.iter().find(|w| *w.name == *d.worker);
                    assert!(w.is_some_and(able), "step {step}: {}", d.worker);
                    let added = w.map_or(0, |w| w.added);
                    decisions.push(ModelDecision {
                        d,
                        added,
                        begun: false,
                        prefilled: false,
                    });
                    (true, any)
                } else {
                    (false, any)
                }
            }
            _ if decisions.is_empty() => (true, true),
            _ => {
                let k = below(decisions.len() as u64) as usize;
                let alive = model
                    .iter()
                    .any(|w| *w.name == *decisions[k].d.worker && w.added == decisions[k].added);
                let m = &mut decisions[k];
                if !m.begun {
                    let ahead = r.begin(&m.d);
                    if alive {
                        m.begun = true;
                    } else {
                        decisions.swap_remove(k);
                    }
                    (ahead.is_ok(), alive)
                } else if !m.prefilled && below(2) == 0 {
                    m.prefilled = true;
                    (r.prefilled(&m.d).is_ok(), true)
                } else {
                    let res = r.finish(&m.d, now);
                    decisions.swap_remove(k);
                    (res.is_ok(), true)
                }
            }
        };
        assert_eq!(ok.0, ok.1, "step {step}: op {op} on {name}");
        // A removed worker's decisions stay begun in the model but count for no one: drop them.
        decisions.retain(|m| {
            !m.begun
                || model
                    .iter()
                    .any(|w| *w.name == *m.d.worker && w.added == m.added)
        });
        // Every count and every worker's state, as the model has them.
        let t = r.workers();
        compactions += usize::from(t.slot_count() < slots);
        slots = t.slot_count();
        let names: Vec<&str> = t.iter().map(|w| &*w.name).collect();
        let want: Vec<&str> = model.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, want, "step {step}: workers in the order added");
        assert_eq!((t.len(), t.is_empty()), (model.len(), model.is_empty()));
        let healthy = model.iter().filter(|w| w.healthy).count();
        assert_eq!(t.healthy(), healthy, "step {step}");
        for phase in [Phase::Prefill, Phase::Decode] {
            let capable = model.iter().filter(|w| w.role.does(phase)).count();
            assert_eq!(t.capable(phase), capable, "step {step}: {phase:?}");
        }
        let uniform = model.windows(2).all(|p| p[0].weight == p[1].weight);
        assert_eq!(t.uniform(), uniform, "step {step}");
        for m in &model {
            let w = t.named(&m.name).unwrap();
            assert_eq!((w.weight, w.healthy, w.role), (m.weight, m.healthy, m.role));
            assert_eq!(r.role(&m.name).unwrap(), m.role);
            assert_eq!(t.get(t.slot(&m.name).unwrap()).unwrap().name, w.name);
            let fresh = match m.freshness {
                Freshness::Fresh => 1.0,
                Freshness::Fixed(v) => v,
                Freshness::StaleSince(s) => 0.5f64.powf((now + 1.0 - s) / half_life),
            };
            let got = r.freshness(&m.name, now + 1.0).unwrap();
            assert!((got - fresh).abs() < 1e-12, "step {step}: {got} vs {fresh}");
            let own = model_own(&decisions, &m.name);
            assert_eq!(
                [
                    w.active,
                    w.queued,
                    w.prefill_blocks,
                    w.decode_blocks,
                    w.written_blocks
                ],
                own,
                "step {step}: {}",
                m.name
            );
            let o = m.others;
            assert_eq!(
                [
                    w.total_active(),
                    w.total_queued(),
                    w.total_prefill_blocks(),
                    w.total_decode_blocks(),
                    w.total_written_blocks(),
                ],
                [
                    own[0] + o[0],
                    own[1] + o[1],
                    own[2] + o[2],
                    own[3] + o[3],
                    own[4]
                ],
                "step {step}: {}",
                m.name
            );
            let load = (own[0] + o[0]) as f64 / m.weight;
            assert_eq!(w.request_load(), load);
        }
        // The endpoint's pools: per phase, the healthy workers doing it, at most 3 of them (all
        // when fewer), listed in slot order; `None`: the members of either phase, each once.
        let order = |name: &str| model.iter().position(|w| *w.name == *name);
        let mut members: Vec<usize> = Vec::new();
        for phase in [Phase::Prefill, Phase::Decode] {
            let pool = r.endpoint_pool("e", Some(phase)).unwrap();
            let able = model
                .iter()
                .filter(|w| w.healthy && w.role.does(phase))
                .count();
            assert_eq!(pool.len(), able.min(3), "step {step}: {phase:?} {pool:?}");
            let at: Vec<usize> = pool.iter().filter_map(|n| order(n)).collect();
            assert_eq!(at.len(), pool.len(), "step {step}: {pool:?}");
            assert!(at.windows(2).all(|p| p[0] < p[1]), "step {step}: {pool:?}");
            for &i in &at {
                assert!(model[i].healthy && model[i].role.does(phase), "step {step}");
            }
            members.extend(at);
        }
        members.sort_unstable();
        members.dedup();
        let all: Vec<String> = r
            .endpoint_pool("e", None)
            .unwrap()
            .iter()
            .map(|n| n.to_string())
            .collect();
        let want: Vec<String> = members.iter().map(|&i| model[i].name.clone()).collect();
        assert_eq!(all, want, "step {step}: members of either phase");
        let gone = format!("n{}", step + 10_000);
        assert!(t.named(&gone).is_err() && r.freshness(&gone, now).is_err());
    }
    assert!(compactions > 0, "the table was never compacted");
}

/// An endpoint's pools as the module docs of `endpoints` define them, from the rendezvous hasher
/// itself: per phase, the first `pool_size` healthy workers able to do it in the weighted
/// rendezvous order of the endpoint id over every worker (`model`: name, weight, healthy, role),
/// sorted by name; `[prefill, decode]`.
fn reference_pools(
    model: &[(String, f64, bool, Role)],
    h: Option<&crate::hashing::Rendezvous>,
    id: &str,
    pool_size: usize,
) -> [Vec<String>; 2] {
    use crate::hashing::ConsistentHash;
    let mut order = Vec::new();
    if let Some(h) = h {
        h.preference_into(Key::Bytes(id.as_bytes()), model.len(), &mut order)
            .unwrap();
    }
    [Phase::Prefill, Phase::Decode].map(|phase| {
        let mut pool: Vec<String> = order
            .iter()
            .filter_map(|&n| {
                // Node ids index the pairs in the order given (`NodeSet::from_pairs`).
                let w = model.get(n as usize)?;
                (w.2 && w.3.does(phase)).then(|| w.0.clone())
            })
            .take(pool_size)
            .collect();
        pool.sort_unstable();
        pool
    })
}

/// The class of router 13/40's survivor `refresh_pool`'s `pool.len() < pool_size` → `==`: an
/// endpoint keeps only the head of its rendezvous order (to its `head_len`-th healthy worker,
/// `head_len` = `max(2·pool_size, pool_size + 8)`), cuts a complete order back to a head when it
/// grows past `2·head_len`, and draws the order again when a head runs short. No test had a fleet
/// larger than a head with many workers unhealthy: a complete order cut back to a head whose
/// workers are mostly unhealthy gave a short pool that was never drawn again. Random joins,
/// leaves, health and role changes in a fleet of up to ~60 workers, in stretches where most
/// workers are unhealthy and where most are healthy; after each, every endpoint's pool of each
/// phase must be the pool the rendezvous hasher gives (`reference_pool`).
#[test]
fn endpoint_pools_are_their_rendezvous_orders_first_healthy_workers() {
    use crate::hashing::Rendezvous;
    let mut r = router(Policy::KvAware, &["w0", "w1", "w2", "w3"]);
    let mut model: Vec<(String, f64, bool, Role)> = (0..4)
        .map(|i| (format!("w{i}"), 1.0, true, Role::Both))
        .collect();
    let endpoints = [("e1", 1), ("e2", 2), ("e3", 3), ("e4", 1), ("e5", 1)];
    for (id, pool_size) in endpoints {
        let spec = EndpointSpec {
            pool_size,
            ..EndpointSpec::default()
        };
        r.add_endpoint(id, spec).unwrap();
    }
    let roles = [Role::Both, Role::Both, Role::Prefill, Role::Decode];
    let mut rng = SplitMix64(13);
    let mut below = |n: u64| rng.next_u64() % n;
    let mut short = 0; // checks where some phase had fewer healthy workers than a head
    for step in 0..2500u32 {
        // Stretches of 250 steps: the fleet grows mostly unhealthy, then recovers.
        let sick = (step / 250) % 2 == 0;
        let at = (!model.is_empty()).then(|| below(model.len() as u64) as usize);
        match (below(10), at) {
            (0..=3, _) if model.len() < 60 => {
                let name = format!("n{step}");
                let weight = if below(4) == 0 { 2.0 } else { 1.0 };
                let role = roles[below(4) as usize];
                r.add_worker_as(&name, weight, role).unwrap();
                model.push((name.clone(), weight, true, role));
                if sick && below(5) > 0 {
                    r.set_healthy(&name, false).unwrap();
                    model.last_mut().unwrap().2 = false;
                }
            }
            (4, Some(i)) => {
                r.remove_worker(&model[i].0).unwrap();
                model.remove(i);
            }
            (5..=7, Some(i)) => {
                let healthy = if sick { below(5) == 0 } else { below(5) > 0 };
                r.set_healthy(&model[i].0, healthy).unwrap();
                model[i].2 = healthy;
            }
            (8, Some(i)) => {
                let role = roles[below(4) as usize];
                r.set_role(&model[i].0, role).unwrap();
                model[i].3 = role;
            }
            _ => {}
        }
        let h = (!model.is_empty())
            .then(|| Rendezvous::new(model.iter().map(|w| (w.0.as_str(), w.1))).unwrap());
        for (id, pool_size) in endpoints {
            let want = reference_pools(&model, h.as_ref(), id, pool_size);
            for (phase, want) in [Phase::Prefill, Phase::Decode].into_iter().zip(want) {
                let mut pool: Vec<String> = r
                    .endpoint_pool(id, Some(phase))
                    .unwrap()
                    .iter()
                    .map(|n| n.to_string())
                    .collect();
                pool.sort_unstable();
                assert_eq!(pool, want, "step {step}: {id} {phase:?}");
            }
        }
        let healthy = |phase: Phase| model.iter().filter(|w| w.2 && w.3.does(phase)).count();
        short += usize::from(healthy(Phase::Prefill).min(healthy(Phase::Decode)) < 9);
    }
    assert!(short > 0, "no check with fewer healthy workers than a head");
}

/// Never-run router mutants (docs/mutants.md): `WorkerTable::compact`'s `vacant < MIN_VACANCIES`
/// → `==` renumbered the workers while vacancies were fewer than 64. A worker's slot is public
/// (`WorkerTable::slot`, the endpoints' pools, decisions' hints): the reference is the table's
/// documented numbering — a new worker takes the next slot after the last, a removal leaves a
/// vacancy, and when the vacancies number at least 64 and more than the workers, the workers are
/// renumbered densely in their order. Joins and leaves of up to 150 workers, checked after each.
#[test]
fn worker_slots_follow_the_documented_numbering_through_joins_and_leaves() {
    let mut r = router(Policy::KvAware, &["w0"]);
    let mut model: Vec<Option<String>> = vec![Some("w0".into())];
    let mut rng = SplitMix64(11);
    let mut next = 1;
    for step in 0..1500 {
        let live: Vec<String> = model.iter().flatten().cloned().collect();
        let join = live.len() < 2 || (rng.next_u64() % 100) < if step < 700 { 60 } else { 35 };
        if join {
            let name = format!("w{next}");
            next += 1;
            r.add_worker(&name, 1.0).unwrap();
            model.push(Some(name));
        } else {
            let name = &live[(rng.next_u64() % live.len() as u64) as usize];
            r.remove_worker(name).unwrap();
            let at = model.iter().position(|n| n.as_ref() == Some(name)).unwrap();
            model[at] = None;
            let len = live.len() - 1;
            let vacant = model.len() - len;
            if vacant >= 64 && vacant > len {
                model.retain(Option::is_some);
            }
        }
        for (slot, name) in model.iter().enumerate() {
            if let Some(name) = name {
                assert_eq!(
                    r.workers().slot(name),
                    Some(slot as u32),
                    "step {step}, {name}"
                );
            }
        }
    }
}
