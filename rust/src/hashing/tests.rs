//! Unit tests of [`crate::hashing`]: the module root's first, then one module per source file.

use super::*;

#[test]
fn hash_key_matches_xxh3_reference_vectors() {
    // XXH3-64 seed 0 reference values (xxHash test suite): empty input.
    assert_eq!(hash_key(b""), 0x2D06_8005_38D3_94C2);
    // Integers hash as their 8 little-endian bytes.
    assert_eq!(Key::Int(7).hash64(), hash_key(&7u64.to_le_bytes()));
    assert_eq!(Key::Bytes(b"abc").hash64(), hash_key(b"abc"));
    assert_eq!(Key::Int(7).prehashed64(), 7);
}

#[test]
fn preference_len_clamps_and_refuses_zero() {
    assert_eq!(preference_len(5, 3).unwrap(), 3);
    assert_eq!(preference_len(2, 3).unwrap(), 2);
    assert!(preference_len(0, 3).is_err());
    assert!(preference_len(1, 0).is_err());
}

#[test]
fn distinct_candidates_stop_at_n() {
    let mut seen = SeenNodes::new(8);
    let mut out = vec![5];
    seen.insert(5);
    extend_distinct(&mut out, 3, &mut seen, cycle_from(&[4, 5, 6, 7], 1));
    assert_eq!(out, vec![5, 6, 7]);
    extend_distinct(&mut out, 4, &mut seen, cycle_from(&[4, 5], 9));
    assert_eq!(out, vec![5, 6, 7, 4]);
}

#[test]
fn seen_nodes_reports_first_insertions() {
    let mut seen = SeenNodes::new(130);
    assert!(seen.insert(129));
    assert!(!seen.insert(129));
    assert!(seen.insert(0));
    assert!(!seen.insert(500));
}

/// `bounded.rs`.
mod bounded {
    use super::super::bounded::*;
    use super::super::*;
    use crate::hashing::{HashRing, JumpHash, RingHash};
    use crate::Error;

    #[test]
    fn capacity_is_the_ceiling_of_c_times_mean_including_the_new_request() {
        let b = BoundedLoad::default();
        // 4 nodes, 7 in flight: mean with the new request is 2, times 1.25 = 2.5 -> 3.
        assert_eq!(b.capacity(7, 0.25), 3);
        // Exact products stay exact despite float rounding: 1.1 * 50 = 55.00000000000001 in f64
        // (1.1 * 10 rounds to 11.0 exactly).
        assert_eq!(BoundedLoad::new(1.1).unwrap().capacity(49, 1.0), 55);
        // An idle fleet still admits the first request.
        assert_eq!(b.capacity(0, 0.001), 1);
    }

    #[test]
    fn walks_the_preference_until_a_node_is_under_capacity() {
        let b = BoundedLoad::default();
        // loads: total 8, n 4 -> capacity ceil(1.25 * 9 / 4) = 3.
        let loads = [3, 0, 3, 2];
        let pick = b.pick(&[0, 2, 3, 1], &loads, None).unwrap();
        assert_eq!(
            pick,
            BoundedPick {
                node: 3,
                probes: 3,
                within_bound: true
            }
        );
        let pick = b.pick(&[0, 2], &loads, None).unwrap();
        assert_eq!(
            pick,
            BoundedPick {
                node: 0,
                probes: 2,
                within_bound: false
            }
        );
    }

    #[test]
    fn weights_scale_capacity() {
        let b = BoundedLoad::new(1.0).unwrap();
        // total 5 (+1 = 6); node 0 has 2/3 of the weight -> capacity 4, node 1 -> 2.
        let loads = [3, 2];
        let pick = b.pick(&[1, 0], &loads, Some(&[2.0, 1.0])).unwrap();
        assert_eq!(pick.node, 0);
        assert!(b.pick(&[1, 0], &loads, Some(&[2.0])).is_err());
        assert!(b.pick(&[1, 0], &loads, Some(&[2.0, f64::NAN])).is_err());
    }

    /// `c()` reads back the factor given (by default the paper's 1.25).
    #[test]
    fn c_is_the_factor_given() {
        assert_eq!(BoundedLoad::default().c(), 1.25);
        assert_eq!(BoundedLoad::new(1.0).unwrap().c(), 1.0);
        assert_eq!(BoundedLoad::new(3.5).unwrap().c(), 3.5);
    }

    #[test]
    fn bad_input_is_refused() {
        let b = BoundedLoad::default();
        assert!(matches!(BoundedLoad::new(0.9), Err(Error::Value(_))));
        assert!(BoundedLoad::new(f64::INFINITY).is_err());
        assert!(b.pick(&[], &[1], None).is_err());
        assert!(b.pick(&[3], &[1, 2], None).is_err());
    }

    /// Simulates sequential arrivals (no departures) with a full preference list: no node ever
    /// exceeds the bound, which is the paper's guarantee.
    #[test]
    fn loads_never_exceed_the_bound_with_full_preferences() {
        let names: Vec<String> = (0..10).map(|i| format!("w{i}")).collect();
        let ring =
            HashRing::new(names.iter().map(|n| (n.as_str(), 1.0)), 160, RingHash::Xxh3).unwrap();
        let jump = JumpHash::new(&names).unwrap();
        for c in [1.0, 1.25, 2.0] {
            let b = BoundedLoad::new(c).unwrap();
            let mut loads = vec![0u64; names.len()];
            let mut scratch = Vec::new();
            // A hot key: every request wants the same first choice.
            for i in 0..2000u64 {
                let key = if i % 2 == 0 {
                    Key::Bytes(b"hot")
                } else {
                    Key::Int(i)
                };
                let pick = if i % 3 == 0 {
                    b.pick_for(&jump, key, &loads, None, &mut scratch).unwrap()
                } else {
                    b.pick_for(&ring, key, &loads, None, &mut scratch).unwrap()
                };
                assert!(pick.within_bound);
                let total: u64 = loads.iter().sum();
                let cap = b.capacity(total, 0.1);
                loads[pick.node as usize] += 1;
                // Capacities only grow with the load in flight, so every node stays within the
                // current one.
                assert!(
                    loads.iter().all(|&l| l <= cap),
                    "c={c} loads={loads:?} cap={cap}"
                );
            }
        }
    }
}

/// `jump.rs`: `jump_hash`.
mod jump {
    use super::super::jump::{jump_float, jump_hash, jump_hash_many_into, jump_int};

    #[test]
    fn the_float_loop_is_the_reference_loop() {
        // The paper's loop (integer index) against the integer-valued-float one `jump_hash`
        // runs where the CPU rounds in one instruction: random keys over bucket counts at the
        // edges (1, 2, 2^31 - 1) and across the range.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..200_000u32 {
            let key = next();
            let n = match i % 4 {
                0 => [1, 2, 3, i32::MAX as u32][(i / 4 % 4) as usize],
                1 => (next() % 1024) as u32 + 1,
                _ => (next() % (i32::MAX as u64)) as u32 + 1,
            };
            let want = jump_int(key, n);
            assert_eq!(jump_float(key, n), want, "key {key:#x}, n {n}");
            assert_eq!(jump_hash(key, n), want, "key {key:#x}, n {n}");
        }
    }

    #[test]
    fn batch_equals_single_calls() {
        let keys: Vec<u64> = (0..1003u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i << 7))
            .collect();
        for n in [1u32, 2, 7, 1024, 100_001, i32::MAX as u32] {
            let mut out: Vec<u32> = Vec::new();
            jump_hash_many_into(&keys, n, &mut out);
            let want: Vec<u32> = keys.iter().map(|&k| jump_hash(k, n)).collect();
            assert_eq!(out, want, "n = {n}");
        }
    }

    #[test]
    fn paper_reference_table() {
        // From the reference C++ code (via dgryski/go-jump, MIT): key 0xdeadbeef, buckets 1..=19.
        let expected = [0, 1, 2, 3, 3, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 16, 16, 16];
        for (i, &e) in expected.iter().enumerate() {
            assert_eq!(jump_hash(0xdead_beef, i as u32 + 1), e);
        }
        // Guava golden value.
        assert_eq!(jump_hash(2, 100_001), 80_343);
    }
}

/// `maglev.rs`.
mod maglev {
    use super::super::maglev::*;
    use super::super::*;

    fn names(t: &Maglev) -> Vec<&str> {
        t.table()
            .iter()
            .map(|&id| &**t.node_set().name(id).unwrap())
            .collect()
    }

    #[test]
    fn envoy_basic_table() {
        // envoy maglev_lb_test.cc "Basic": six hosts, M = 7.
        let hosts: Vec<String> = (90..96).map(|p| format!("127.0.0.1:{p}")).collect();
        let t = Maglev::new(hosts.iter().map(|h| (h.as_str(), 1.0)), 7).unwrap();
        let want = [92, 94, 90, 91, 95, 90, 93].map(|p| format!("127.0.0.1:{p}"));
        assert_eq!(
            names(&t),
            want.iter().map(String::as_str).collect::<Vec<_>>()
        );
    }

    #[test]
    fn envoy_weighted_table() {
        // envoy maglev_lb_test.cc "Weighted": weights 1 and 2, M = 17.
        let t = Maglev::new([("127.0.0.1:90", 1.0), ("127.0.0.1:91", 2.0)], 17).unwrap();
        let want = [1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 0, 1];
        assert_eq!(t.table(), &want);
    }

    #[test]
    fn envoy_retry_attempts() {
        // "BasicWithRetryHostPredicate": hash 10 -> host 1, then 0 on retry, then 5.
        let hosts: Vec<String> = (90..96).map(|p| format!("127.0.0.1:{p}")).collect();
        let t = Maglev::new(hosts.iter().map(|h| (h.as_str(), 1.0)), 7).unwrap();
        let mut out = Vec::new();
        t.preference_into(Key::Int(10), 3, &mut out).unwrap();
        assert_eq!(out, vec![1, 0, 5]);
    }

    #[test]
    fn table_size_must_be_prime() {
        for m in [0, 1, 4, 65_536, MAX_TABLE_SIZE + 1] {
            assert!(Maglev::new([("a", 1.0)], m).is_err(), "{m}");
        }
        assert!(Maglev::new([("a", 1.0)], 2).is_ok());
    }

    #[test]
    fn preference_lists_every_node_even_without_slots() {
        // Fewer slots than nodes: the node sorting last gets none.
        let t = Maglev::new([("c", 1.0), ("a", 1.0), ("b", 1.0)], 2).unwrap();
        assert!(!t.table().contains(&0));
        let mut out = Vec::new();
        t.preference_into(Key::Int(3), 5, &mut out).unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(out[2], 0);
    }
}

/// `jump.rs`: `JumpHash`.
mod jump_nodes {
    use super::super::jump::*;
    use super::super::*;

    fn named(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("n{i}")).collect()
    }

    fn placement(h: &JumpHash, keys: u64) -> Vec<String> {
        (0..keys)
            .map(|k| {
                h.name(
                    h.get(Key::Int(k.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
                        .unwrap(),
                )
                .unwrap()
                .to_string()
            })
            .collect()
    }

    #[test]
    fn without_removals_it_is_jump_hash() {
        let h = JumpHash::new(named(37)).unwrap();
        for k in 0..5000u64 {
            let key = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            assert_eq!(h.get(Key::Int(key)).unwrap(), jump_hash(key, 37));
        }
    }

    /// A deterministic pseudo-random sequence for the property tests below.
    fn lcg(state: &mut u64) -> u64 {
        *state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        *state >> 33
    }

    #[test]
    fn random_removals_and_additions_move_only_the_changed_nodes_keys() {
        let keys = 6000;
        let mut state = 7u64;
        for round in 0..30 {
            let mut h = JumpHash::new(named(12)).unwrap();
            let mut next = 12;
            for _ in 0..20 {
                let before = placement(&h, keys);
                if h.len() > 1 && (!lcg(&mut state).is_multiple_of(3) || h.len() > 14) {
                    let victim = h
                        .name(lcg(&mut state) as u32 % h.len() as u32)
                        .unwrap()
                        .to_string();
                    h.remove(&victim).unwrap();
                    let after = placement(&h, keys);
                    for (a, b) in before.iter().zip(&after) {
                        assert!(a == b || *a == victim, "round {round}: {a} -> {b}");
                        assert_ne!(*b, victim);
                    }
                } else {
                    let name = format!("n{next}");
                    next += 1;
                    h.add(&name, 1.0).unwrap();
                    let after = placement(&h, keys);
                    for (a, b) in before.iter().zip(&after) {
                        assert!(a == b || *b == name, "round {round}: {a} -> {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn stays_balanced_after_many_removals() {
        let mut h = JumpHash::new(named(100)).unwrap();
        let mut state = 3u64;
        for _ in 0..60 {
            let victim = h
                .name(lcg(&mut state) as u32 % h.len() as u32)
                .unwrap()
                .to_string();
            h.remove(&victim).unwrap();
        }
        let keys = 200_000u64;
        let mut counts = vec![0u32; h.len()];
        for k in 0..keys {
            counts[h
                .get(Key::Int(k.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
                .unwrap() as usize] += 1;
        }
        let mean = keys as f64 / h.len() as f64;
        let max = *counts.iter().max().unwrap() as f64;
        let min = *counts.iter().min().unwrap() as f64;
        // 5000 keys per node: binomial noise is ~1.4%; 10% leaves room and catches a hot node.
        assert!(
            max / mean < 1.1 && min / mean > 0.9,
            "max {max} min {min} mean {mean}"
        );
    }

    #[test]
    fn preference_is_the_failover_order() {
        let mut state = 11u64;
        let plain = JumpHash::new(named(9)).unwrap();
        let mut holed = plain.clone();
        holed.remove("n3").unwrap();
        holed.remove("n7").unwrap();
        for (h, k) in [&plain, &holed]
            .into_iter()
            .flat_map(|h| (0..300u64).map(move |k| (h, k)))
        {
            let key = Key::Int(lcg(&mut state) << 20 | k);
            let mut pref = Vec::new();
            h.preference_into(key, 9, &mut pref).unwrap();
            assert_eq!(pref.len(), h.len());
            let names: Vec<String> = pref
                .iter()
                .map(|&id| h.name(id).unwrap().to_string())
                .collect();
            let mut sim = h.clone();
            for name in &names {
                assert_eq!(&**sim.name(sim.get(key).unwrap()).unwrap(), name.as_str());
                sim.remove(name).unwrap();
            }
            assert!(sim.is_empty());
        }
    }

    #[test]
    fn adding_back_undoes_a_removal() {
        let mut h = JumpHash::new(named(10)).unwrap();
        let before = placement(&h, 3000);
        h.remove("n4").unwrap();
        h.add("n4", 1.0).unwrap();
        assert_eq!(placement(&h, 3000), before);
        assert!(h.add("x", 2.0).is_err());
        assert!(h.remove("nope").is_err());
    }

    #[test]
    fn removing_everything_then_adding_works() {
        let mut h = JumpHash::new(named(3)).unwrap();
        for n in ["n0", "n2", "n1"] {
            h.remove(n).unwrap();
        }
        assert!(h.get(Key::Int(1)).is_err());
        h.add("a", 1.0).unwrap();
        for k in 0..100 {
            assert_eq!(h.get(Key::Int(k)).unwrap(), 0);
        }
    }
}

/// `nodes.rs`.
mod nodes {
    use super::super::nodes::*;
    use super::super::NodeId;
    use crate::Error;

    #[test]
    fn removal_shifts_ids_and_swap_removal_moves_the_last() {
        let order = |s: &NodeSet| -> Vec<String> {
            s.in_order()
                .map(|id| s.name(id).unwrap().to_string())
                .collect()
        };
        let mut set = NodeSet::from_pairs([("b", 1.0), ("a", 2.0), ("c", 1.0)]).unwrap();
        assert_eq!(set.id("a"), Some(1));
        assert_eq!(set.ids_by_name(), vec![1, 0, 2]);
        assert_eq!(set.name_ranks(), vec![1, 0, 2]);
        let mut swapped = set.clone();
        assert_eq!(set.remove("b").unwrap(), 0);
        assert_eq!(set.id("a"), Some(0));
        assert_eq!(set.id("c"), Some(1));
        assert_eq!(set.weights(), &[2.0, 1.0]);
        assert_eq!(set.unowned_by_name(&[1, 1]), vec![0]);
        // cargo-mutants survivor (shard 2/40): every node owned, none left; none owned, all of
        // them in name order ("a" is id 0, "c" id 1).
        assert_eq!(set.unowned_by_name(&[0, 1]), Vec::<NodeId>::new());
        assert_eq!(set.unowned_by_name(&[]), vec![0, 1]);
        assert_eq!(order(&set), ["a", "c"]);
        assert_eq!(swapped.swap_remove("b").unwrap(), 0);
        assert_eq!(swapped.id("c"), Some(0)); // the last id moved into the freed one
        assert_eq!(swapped.id("a"), Some(1));
        assert_eq!(swapped.weights(), &[1.0, 2.0]);
        assert_eq!(order(&swapped), ["a", "c"]);
        swapped.push("d", 1.0).unwrap();
        assert_eq!(order(&swapped), ["a", "c", "d"]);
    }

    /// Against a list model: random pushes and both kinds of removal keep ids dense and
    /// consistent with the names, `remove` keeps ids in insertion order, and `in_order` is the
    /// order of insertion.
    #[test]
    fn random_membership_changes_agree_with_a_list() {
        let mut state = 99u64;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            state >> 33
        };
        for swapping in [false, true] {
            let mut set = NodeSet::new();
            let mut model: Vec<String> = Vec::new();
            for step in 0..3000 {
                if model.is_empty() || next() % 3 != 0 {
                    let name = format!("n{step}");
                    set.push(&name, 1.0).unwrap();
                    model.push(name);
                } else {
                    let name = model.remove(next() as usize % model.len());
                    if swapping {
                        set.swap_remove(&name).unwrap();
                    } else {
                        set.remove(&name).unwrap();
                    }
                }
                assert_eq!(set.len(), model.len());
                let ordered: Vec<&str> =
                    set.in_order().map(|id| &**set.name(id).unwrap()).collect();
                assert_eq!(ordered, model);
                if !swapping {
                    assert_eq!(
                        set.names(),
                        model.iter().map(|n| n.as_str().into()).collect::<Vec<_>>()
                    );
                }
                for (id, name) in set.names().iter().enumerate() {
                    assert_eq!(set.id(name), Some(id as NodeId));
                }
            }
        }
    }

    #[test]
    fn bad_input_is_refused_without_change() {
        let mut set = NodeSet::from_pairs([("a", 1.0)]).unwrap();
        assert!(matches!(set.push("a", 1.0), Err(Error::Value(_))));
        for w in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(set.push("b", w), Err(Error::Value(_))));
        }
        assert!(matches!(set.remove("zz"), Err(Error::Key(_))));
        assert!(set.with_node("a", 1.0).is_err() && set.without_node("zz").is_err());
        assert_eq!(set.len(), 1);
    }
}

/// `rendezvous.rs`.
mod rendezvous {
    use super::super::rendezvous::fmix64;
    use super::super::rendezvous::*;
    use super::super::*;

    #[test]
    fn fmix64_reference_values() {
        // MurmurHash3 fmix64: 0 is a fixed point; the value for 1 pins the constants (computed
        // from the MurmurHash3 definition in Python).
        assert_eq!(fmix64(0), 0);
        assert_eq!(fmix64(1), 0xb456_bcfc_34c2_cb2c);
    }

    #[test]
    fn weights_set_the_share_of_keys() {
        let r = Rendezvous::new([("a", 1.0), ("b", 3.0)]).unwrap();
        let n = 40_000u64;
        let b = (0..n).filter(|&k| r.get(Key::Int(k)).unwrap() == 1).count() as f64;
        assert!((b / n as f64 - 0.75).abs() < 0.01, "{}", b / n as f64);
    }

    /// cargo-mutants survivor (shard 1/40): the owner of a key is the node with the highest draw
    /// `fmix64(k ^ XXH3-64(name)) >> 11` (the module docs), `k` the key's XXH3-64, and the weighted
    /// score is `w / -ln(u)` of that draw.
    #[test]
    fn draws_follow_the_documented_formula() {
        let names = ["a", "b", "c", "10.0.0.1:8000"];
        let r = Rendezvous::new(names.iter().map(|&n| (n, 1.0))).unwrap();
        let seeds: Vec<u64> = names
            .iter()
            .map(|n| xxhash_rust::xxh3::xxh3_64(n.as_bytes()))
            .collect();
        for k in 0..2000u64 {
            let kh = hash_key(&k.to_le_bytes());
            let draws: Vec<u64> = seeds.iter().map(|&s| fmix64(kh ^ s) >> 11).collect();
            let best = (0..names.len()).max_by_key(|&i| draws[i]).unwrap();
            assert_eq!(r.get(Key::Int(k)).unwrap() as usize, best, "{k}");
            let score = Rendezvous::node_score(kh, Rendezvous::node_seed(names[best]), 1.0, true);
            assert_eq!(score, Score::Draw(draws[best]));
        }
        let (kh, seed) = (hash_key(b"key"), seeds[0]);
        let u = ((fmix64(kh ^ seed) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let weighted = Rendezvous::node_score(kh, seed, 3.0, false);
        assert_eq!(weighted, Score::Weighted(3.0 / -u.ln()));
    }

    /// cargo-mutants survivor (shard 2/40): `preference(key, n)` is the first `n` of the full
    /// descending order, exactly `n` long.
    #[test]
    fn a_short_preference_is_the_head_of_the_full_one() {
        let r =
            Rendezvous::new([("a", 1.0), ("b", 2.0), ("c", 1.0), ("d", 3.0), ("e", 1.0)]).unwrap();
        let (mut full, mut short) = (Vec::new(), Vec::new());
        for k in 0..200u64 {
            r.preference_into(Key::Int(k), 5, &mut full).unwrap();
            for n in 1..=5 {
                r.preference_into(Key::Int(k), n, &mut short).unwrap();
                assert_eq!(short, full[..n], "key {k}, n {n}");
            }
        }
    }

    #[test]
    fn uniform_and_weighted_scores_rank_alike() {
        let names = ["a", "b", "c", "d", "e"];
        let uniform = Rendezvous::new(names.iter().map(|&n| (n, 2.0))).unwrap();
        let mut weighted = uniform.clone();
        weighted.uniform = false;
        let (mut p, mut q) = (Vec::new(), Vec::new());
        for k in 0..500u64 {
            uniform.preference_into(Key::Int(k), 5, &mut p).unwrap();
            weighted.preference_into(Key::Int(k), 5, &mut q).unwrap();
            assert_eq!(p, q);
        }
    }
}

/// `ketama.rs` and `ring.rs`: the hash ring (`tests_ring.rs`).
#[path = "tests_ring.rs"]
mod rings;

/// Tests written for cargo-mutants survivors since shard 5/40 (`tests_mutants.rs`).
#[path = "tests_mutants.rs"]
mod mutants;

/// `with_added` / `with_removed` of every hasher: the hasher `add` / `remove` make in place,
/// `self` unchanged; an error (a duplicate, a bad weight, an unknown node) returned as the
/// in-place call returns it.
mod copies {
    use super::*;

    fn check<H: ConsistentHash + Clone>(h: &H) {
        let keys: Vec<u64> = (0..500u64)
            .map(|k| k.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        let answers = |h: &H| -> Vec<Option<String>> {
            keys.iter()
                .map(|&k| {
                    h.get(Key::Int(k))
                        .ok()
                        .and_then(|id| h.name(id))
                        .map(|n| n.to_string())
                })
                .collect()
        };
        let before = answers(h);
        let names =
            |h: &H| -> Vec<String> { h.node_set().names().iter().map(|n| n.to_string()).collect() };
        let added = h.with_added("new", 1.0).unwrap();
        let mut want = h.clone();
        want.add("new", 1.0).unwrap();
        assert_eq!(
            (names(&added), answers(&added)),
            (names(&want), answers(&want))
        );
        assert_ne!(answers(&added), before, "no key moved to the new node");
        let removed = added.with_removed("n1").unwrap();
        want.remove("n1").unwrap();
        assert_eq!(
            (names(&removed), answers(&removed)),
            (names(&want), answers(&want))
        );
        assert_eq!(added.len(), h.len() + 1);
        assert_eq!(answers(h), before, "self changed");
        assert!(matches!(
            h.with_added("n0", 1.0),
            Err(crate::Error::Value(_))
        ));
        assert!(matches!(
            h.with_removed("missing"),
            Err(crate::Error::Key(_))
        ));
        let mut same = h.clone();
        assert!(same.add("n0", 1.0).is_err() && same.remove("missing").is_err());
        assert_eq!(answers(&same), before);
    }

    #[test]
    fn with_added_and_with_removed_are_add_and_remove_on_a_copy() {
        let nodes: Vec<(String, f64)> = (0..8).map(|i| (format!("n{i}"), 1.0)).collect();
        let pairs = || nodes.iter().map(|(n, w)| (n.as_str(), *w));
        check(&HashRing::new(pairs(), 160, RingHash::Ketama).unwrap());
        check(&HashRing::new(pairs(), 160, RingHash::Xxh3).unwrap());
        check(&Maglev::new(pairs(), 65_537).unwrap());
        check(&Rendezvous::new(pairs()).unwrap());
        let mut jump = JumpHash::default();
        for (n, w) in &nodes {
            jump.add(n, *w).unwrap();
        }
        check(&jump);
        assert!(
            matches!(jump.with_added("w", 2.0), Err(crate::Error::Value(_))),
            "JumpHash is unweighted"
        );
    }
}
