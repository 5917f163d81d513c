//! Jump consistent hash (Lamping & Veach, 2014, arXiv:1406.2294).

/// Bucket in `0..num_buckets` for `key`, bit-exact with the paper's reference implementation.
///
/// `num_buckets` must be at least 1 (callers validate; `0` yields `0` rather than panicking).
#[inline]
pub fn jump_hash(key: u64, num_buckets: u32) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sse4.1") {
        // SAFETY: the running CPU supports SSE4.1 (checked just above).
        return unsafe { jump_hash_sse41(key, num_buckets) };
    }
    jump_float(key, f64::from(num_buckets))
}

/// The reference loop with `b` and `j` kept as integer-valued `f64`s. The reference converts
/// them to and from floats on every step; skipping those conversions (exact, since both stay
/// below 2^31 while the loop runs) shortens the dependency chain without changing any result.
#[inline(always)]
fn jump_float(mut key: u64, n: f64) -> u32 {
    let mut b = 0.0f64;
    let mut j = 0.0f64;
    while j < n {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        // (key >> 33) < 2^31, so the i32 conversion is exact.
        j = ((b + 1.0) * ((1u64 << 31) as f64 / (f64::from((key >> 33) as i32) + 1.0))).trunc();
    }
    b as u32
}

/// The same loop where `trunc` is one instruction (`roundsd`) instead of a libm call.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.1")]
fn jump_hash_sse41(key: u64, num_buckets: u32) -> u32 {
    jump_float(key, f64::from(num_buckets))
}

/// Keys advanced together by [`jump_hash_many_into`]. The single-key loop waits on one float
/// division per step; interleaving independent keys (in SIMD lanes where the CPU has AVX2) keeps
/// the divider busy instead.
const LANES: usize = 16;

/// The jump loop on `L` keys at once, in the float domain so that it vectorises: `j` and `b` are
/// kept as exact integer-valued `f64`s (both stay below 2^31 while a lane is active), and every
/// arithmetic step is the reference's IEEE operation, so the result is bit-identical.
#[inline(always)]
fn jump_lanes<const L: usize>(keys: &[u64; L], n: f64) -> [u32; L] {
    let mut key = *keys;
    let mut b = [0.0f64; L];
    let mut j = [0.0f64; L];
    loop {
        let mut running = 0u32;
        for l in 0..L {
            let active = j[l] < n;
            running |= u32::from(active);
            let next_key = key[l]
                .wrapping_mul(2_862_933_555_777_941_757)
                .wrapping_add(1);
            // (next_key >> 33) < 2^31, so the i32 conversion is exact.
            let divisor = f64::from((next_key >> 33) as i32) + 1.0;
            let next_j = ((j[l] + 1.0) * ((1u64 << 31) as f64 / divisor)).trunc();
            // Branch-free selects keep the lanes in registers.
            let keep = u64::from(active).wrapping_neg();
            b[l] = f64::from_bits((j[l].to_bits() & keep) | (b[l].to_bits() & !keep));
            key[l] = (next_key & keep) | (key[l] & !keep);
            j[l] = f64::from_bits((next_j.to_bits() & keep) | (j[l].to_bits() & !keep));
        }
        if running == 0 {
            break;
        }
    }
    b.map(|x| x as u32)
}

fn jump_lanes_portable(keys: &[u64; LANES], n: f64) -> [u32; LANES] {
    jump_lanes(keys, n)
}

/// The same loop compiled for AVX2 (4 doubles per vector).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn jump_lanes_avx2(keys: &[u64; LANES], n: f64) -> [u32; LANES] {
    jump_lanes(keys, n)
}

/// [`jump_hash`] of every key, written to `out` (cleared first). Same results, several times the
/// throughput of a loop of single calls.
pub fn jump_hash_many_into<T: From<u32>>(keys: &[u64], num_buckets: u32, out: &mut Vec<T>) {
    out.clear();
    out.reserve(keys.len());
    let n = f64::from(num_buckets);
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    let mut chunks = keys.chunks_exact(LANES);
    for chunk in &mut chunks {
        let mut lanes = [0u64; LANES];
        lanes.copy_from_slice(chunk);
        #[cfg(target_arch = "x86_64")]
        let buckets = if avx2 {
            // SAFETY: the running CPU supports AVX2 (checked above).
            unsafe { jump_lanes_avx2(&lanes, n) }
        } else {
            jump_lanes_portable(&lanes, n)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let buckets = jump_lanes_portable(&lanes, n);
        out.extend(buckets.map(T::from));
    }
    out.extend(
        chunks
            .remainder()
            .iter()
            .map(|&k| T::from(jump_hash(k, num_buckets))),
    );
}

#[cfg(test)]
mod tests {
    use super::{jump_hash, jump_hash_many_into};

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
