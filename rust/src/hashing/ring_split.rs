//! The split table: a ketama ring's batch lookups eight at a time, in AVX-512 gathers.
//!
//! Guarantees:
//! - [`SplitTable::owners_into`] appends exactly what [`super::HashRing::owner_of`] gives for
//!   each hash, in order, for any `u64` (ketama hashes are 32-bit; a larger value takes the ring's
//!   scan, and no gather reads outside the table).
//! - A table is built only for ketama rings whose entries fit 64 bits (below), and only where the
//!   CPU has AVX-512; elsewhere the ring looks up with its bucket table's scan alone.
//!
//! The ring's bucket table gives the first point at or after a bucket's lowest hash, then a short
//! scan with a data-dependent end and two more dependent loads (the points, the owner). With two
//! to four buckets per point, a bucket holds at most two points that a hash in it can pass (all
//! but 1.4% of buckets at worst: Poisson with mean 1/2), so the split table keeps per bucket the
//! offsets in it of those two points and the owners of the three ranges they cut it into: a
//! lookup is one load, two compares and a shift, eight lanes per instruction, with no branch.
//! Buckets with a third such point are marked, and their hashes take the ring's scan.
//!
//! An entry holds two offsets of `s` bits (a bucket spans `2^s` hashes) and three owners of `b`
//! bits (the largest node id's length), so the table exists when `2s + 3b <= 63`: with the
//! default 160 points per node, up to 16,384 nodes (1,024 nodes: 2 x 13 + 3 x 10 = 56); with few
//! points per node, for fewer (4 points each: up to 10 nodes).

use super::NodeId;

/// Marks a bucket whose hashes take the ring's scan (the top bit, above every field).
const SCAN: u64 = 1 << 63;

/// Per bucket of a ketama ring's bucket table (`2^s` hashes from `lo`), one entry:
/// `o2 << (2s + 2b) | o1 << (2s + b) | o0 << 2s | e1 << s | e0`, where `e0` and `e1` are the
/// offsets from `lo` of the first two points at or after it, each capped at `2^s - 1` (a point at
/// or past the bucket's last hash is below no hash in it), and `o0`, `o1`, `o2` the owners of
/// that first point and the next two: a hash at offset `o` goes to owner `k`, the number of
/// `e0`, `e1` below `o`. Plus [`SCAN`] when a third point lies before the bucket's last hash.
#[derive(Debug, Clone)]
// Elsewhere than x86-64 no table is built (`build` returns `None`), so its fields go unread.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) struct SplitTable {
    entries: Vec<u64>,
    /// `s`: a bucket's width in bits.
    shift: u32,
    /// `b`: the bits of an owner.
    owner_bits: u32,
}

impl SplitTable {
    /// The split table of a ketama ring: `points` sorted with its `u64::MAX` sentinel, `owners`
    /// with the wrap-around's, `table` and `shift` its bucket table over 32-bit hashes. `None`
    /// without AVX-512, or when the buckets are not those of 32-bit hashes or an entry's fields
    /// do not fit 63 bits.
    pub(super) fn build(
        points: &[u64],
        owners: &[NodeId],
        table: &[u32],
        shift: u32,
    ) -> Option<Self> {
        if !Self::available()
            || !(1..32).contains(&shift)
            || (table.len() as u64) << shift != 1 << 32
        {
            return None;
        }
        let cap = (1u64 << shift) - 1;
        let top = owners.iter().copied().max().unwrap_or(0);
        let owner_bits = (u32::BITS - top.leading_zeros()).max(1);
        if 2 * shift + 3 * owner_bits > 63 {
            return None;
        }
        let offset = |i: usize, lo: u64| {
            points
                .get(i)
                .map_or(cap, |&p| p.saturating_sub(lo).min(cap))
        };
        // Past the sentinel: never chosen (no point before it lies in the bucket).
        let owner = |i: usize| u64::from(owners.get(i).copied().unwrap_or(0));
        let entries = table
            .iter()
            .enumerate()
            .map(|(t, &first)| {
                let (lo, i) = ((t as u64) << shift, first as usize);
                let scan = if offset(i + 2, lo) < cap { SCAN } else { 0 };
                let o = 2 * shift;
                scan | owner(i + 2) << (o + 2 * owner_bits)
                    | owner(i + 1) << (o + owner_bits)
                    | owner(i) << o
                    | offset(i + 1, lo) << shift
                    | offset(i, lo)
            })
            .collect();
        Some(Self {
            entries,
            shift,
            owner_bits,
        })
    }

    /// Whether this CPU runs the gathers (AVX-512F).
    fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Appends the owner of each of `hashes` to `out`: from the table, or `scan(h)` (the ring's
    /// own lookup) for a hash in a bucket marked [`SCAN`] or above 32 bits.
    pub(super) fn owners_into(
        &self,
        hashes: &[u64],
        out: &mut Vec<NodeId>,
        scan: impl Fn(u64) -> NodeId,
    ) {
        out.reserve(hashes.len());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a table exists only where AVX-512F is present (see `build`).
        unsafe {
            self.owners_avx512(hashes, out, &scan)
        };
        #[cfg(not(target_arch = "x86_64"))]
        out.extend(hashes.iter().map(|&h| scan(h)));
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn owners_avx512(&self, hashes: &[u64], out: &mut Vec<NodeId>, scan: &impl Fn(u64) -> NodeId) {
        use std::arch::x86_64::*;
        let s = i64::from(self.shift);
        let shift = _mm512_set1_epi64(s);
        let cap = _mm512_set1_epi64((1i64 << s) - 1);
        let scan_bit = _mm512_set1_epi64(SCAN as i64);
        let max_hash = _mm512_set1_epi64(i64::from(u32::MAX));
        let owner_mask = _mm512_set1_epi64((1i64 << self.owner_bits) - 1);
        let first_owner = _mm512_set1_epi64(2 * s);
        let next_owner = _mm512_set1_epi64(i64::from(self.owner_bits));
        let mut chunks = hashes.chunks_exact(8);
        for chunk in &mut chunks {
            // SAFETY: `chunk` holds 8 u64 (64 bytes); the load is unaligned.
            let h = unsafe { _mm512_loadu_si512(chunk.as_ptr().cast()) };
            // Only 32-bit positions are looked up here: their bucket, `h >> s`, is below
            // `entries.len()`, which is `2^(32 - s)` (checked in `build`). The other lanes load
            // nothing (their entry reads as 0) and take the scan.
            let positions = _mm512_cmple_epu64_mask(h, max_hash);
            let t = _mm512_srlv_epi64(h, shift);
            // SAFETY: only the lanes in `positions` are read, each inside `entries` (above),
            // scaled by 8 bytes an entry.
            let e = unsafe {
                _mm512_mask_i64gather_epi64::<8>(
                    _mm512_setzero_si512(),
                    positions,
                    t,
                    self.entries.as_ptr().cast(),
                )
            };
            let o = _mm512_and_si512(h, cap);
            let past0 = _mm512_cmpgt_epu64_mask(o, _mm512_and_si512(e, cap));
            let past1 =
                _mm512_cmpgt_epu64_mask(o, _mm512_and_si512(_mm512_srlv_epi64(e, shift), cap));
            // The owner's field: the first, moved one field on per point the hash is past.
            let at = _mm512_mask_add_epi64(first_owner, past0, first_owner, next_owner);
            let at = _mm512_mask_add_epi64(at, past1, at, next_owner);
            let owner = _mm512_and_si512(_mm512_srlv_epi64(e, at), owner_mask);
            let found = _mm512_cvtepi64_epi32(owner);
            let mut lanes = [0u32; 8];
            // SAFETY: `lanes` holds 8 u32 (32 bytes); the store is unaligned.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), found) };
            let mut rescan = _mm512_test_epi64_mask(e, scan_bit) | !positions;
            while rescan != 0 {
                let lane = rescan.trailing_zeros() as usize;
                if let (Some(slot), Some(&h)) = (lanes.get_mut(lane), chunk.get(lane)) {
                    *slot = scan(h);
                }
                rescan &= rescan - 1;
            }
            out.extend_from_slice(&lanes);
        }
        out.extend(chunks.remainder().iter().map(|&h| scan(h)));
    }
}
