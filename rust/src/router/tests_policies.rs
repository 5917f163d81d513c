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
