//! The seeded policies at their draws' boundaries: a router's `seed` chosen, through the inverse
//! of SplitMix64's output step, so that its first draw is a given 53-bit value, and the pick
//! checked against the documented rule in exact integer arithmetic.

use super::tests::tokens;
use super::tests_ties::inverse;
use super::*;

/// SplitMix64's increment (Steele, Lea & Flood 2014).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// 2⁵³: a draw `u = k · 2⁻⁵³` with `0 ≤ k < 2⁵³`.
const ONE: u64 = 1 << 53;

/// The inverse of `y = x ^ (x >> k)`.
fn unshift(y: u64, k: u32) -> u64 {
    let mut x = y;
    for _ in 0..64 / k + 1 {
        x = y ^ (x >> k);
    }
    x
}

/// The seed whose first draw (`next_u64() >> 11`) is `k`: SplitMix64's output step undone, then
/// its increment. The premise is checked on the generator itself.
fn seed_drawing(k: u64) -> u64 {
    let mut z = unshift(k << 11, 31);
    z = unshift(z.wrapping_mul(inverse(0x94D0_49BB_1331_11EB)), 27);
    z = unshift(z.wrapping_mul(inverse(0xBF58_476D_1CE4_E5B9)), 30);
    let seed = z.wrapping_sub(GOLDEN);
    assert_eq!(SplitMix64(seed).next_u64() >> 11, k);
    seed
}

/// The worker a router seeded with `seed` routes one prompt to, the `exclude`d left out.
fn first_pick(policy: Policy, workers: &[(&str, f64)], seed: u64, exclude: &[&str]) -> String {
    let config = Config {
        policy,
        block_size: 4,
        capacity_blocks: 64,
        seed,
        ..Config::default()
    };
    let mut r = Router::new(workers.iter().copied(), config).unwrap();
    let mut req = r.tokens_request(&tokens(1, 8), None, None, 0.0).unwrap();
    req.exclude = exclude;
    r.route(req).unwrap().worker.to_string()
}

/// Surviving mutant (outside the samples, seen re-running router 19/40 by name): `Policy::Random`'s
/// `acc > target` → `>=` picked a candidate whose cumulative weight only equals the target. The
/// rule (the module docs): a draw `u` picks the first candidate, in slot order, whose cumulative
/// weight *exceeds* `u · Σ weight` — each candidate owns `[S_{i−1}, S_i)` of `[0, Σ)`. The
/// class: a draw on every boundary of that partition (0 and each partial sum), one unit of 2⁻⁵³
/// either side, and the largest draw, for the whole fleet and for a subset (a worker excluded
/// in the middle, so the partial sums are the candidates', not the fleet's). The weights are
/// halves and each total a power of two, so `u · Σ` is exact and the reference is integer
/// arithmetic: candidate `i` iff `S_{i−1} · 2⁵³ ≤ k · Σ < S_i · 2⁵³` (in halves).
#[test]
fn a_random_draw_on_a_partial_sum_picks_the_next_candidate() {
    let fleet = [("a", 0.5), ("b", 1.5), ("c", 8.0), ("d", 2.0), ("e", 4.0)];
    for exclude in [&[][..], &["c"][..]] {
        let cands: Vec<(&str, u64)> = fleet
            .iter()
            .filter(|(n, _)| !exclude.contains(n))
            .map(|&(n, w)| (n, (w * 2.0) as u64))
            .collect();
        let total: u64 = cands.iter().map(|c| c.1).sum();
        assert!(total.is_power_of_two(), "{total} halves");
        let want = |k: u64| {
            let mut sum = 0u128;
            for &(n, w) in &cands {
                sum += u128::from(w);
                if sum * u128::from(ONE) > u128::from(k) * u128::from(total) {
                    return n;
                }
            }
            unreachable!("k < 2⁵³")
        };
        let mut draws = vec![ONE - 1];
        let mut sum = 0;
        for &(_, w) in &cands {
            let k = sum * (ONE / total); // u · Σ = sum exactly
            draws.extend([k.saturating_sub(1), k, k + 1]);
            sum += w;
        }
        for k in draws {
            let got = first_pick(Policy::Random, &fleet, seed_drawing(k), exclude);
            assert_eq!(got, want(k), "draw {k} of 2^53, {exclude:?} excluded");
        }
    }
}

/// The same boundaries for `power_of_two`'s first draw, `⌊u₁ · n⌋` (the module docs): at equal
/// loads the first drawn wins, so the pick is candidate `⌊k · n / 2⁵³⌋`. Draws on every multiple
/// of `1/n` and one unit either side, and the largest, for 4 and 8 candidates (exact products)
/// and the largest for 3, 5, 6 and 7, where `u · n` rounds.
#[test]
fn a_power_of_two_first_draw_on_a_boundary_picks_by_its_floor() {
    let names = ["a", "b", "c", "d", "e", "f", "g", "h"];
    for n in 3..=8u64 {
        let fleet: Vec<(&str, f64)> = names[..n as usize].iter().map(|&w| (w, 1.0)).collect();
        let mut draws = vec![ONE - 1];
        if n.is_power_of_two() {
            for i in 0..n {
                let k = i * (ONE / n);
                draws.extend([k.saturating_sub(1), k, k + 1]);
            }
        }
        for k in draws {
            let want = names[(u128::from(k) * u128::from(n) / u128::from(ONE)) as usize];
            let got = first_pick(Policy::PowerOfTwo, &fleet, seed_drawing(k), &[]);
            assert_eq!(got, want, "draw {k} of 2^53 over {n}");
        }
    }
}
