//! Jump consistent hash (Lamping & Veach, 2014, arXiv:1406.2294).

/// Bucket in `0..num_buckets` for `key`, bit-exact with the paper's reference implementation.
///
/// `num_buckets` must be at least 1 (callers validate; `0` yields `0` rather than panicking).
#[inline]
pub fn jump_hash(mut key: u64, num_buckets: u32) -> u32 {
    let mut b: i64 = -1;
    let mut j: i64 = 0;
    let n = i64::from(num_buckets);
    while j < n {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        j = ((b + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
    }
    // b is in 0..num_buckets here (or -1 when num_buckets == 0, mapped to 0).
    b.max(0) as u32
}

#[cfg(test)]
mod tests {
    use super::jump_hash;

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
