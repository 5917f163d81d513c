//! Jump consistent hashing: [`jump_hash`] (Lamping & Veach, 2014, arXiv:1406.2294) on a 64-bit
//! key, its batch form [`jump_hash_many_into`], and [`JumpHash`], jump hash over named nodes with
//! removal of any node by MementoHash (Coluzzi, Brocco, Antonucci & Leidi, "MementoHash: A
//! Stateful, Minimal Memory, Best Performing Consistent Hash Algorithm", IEEE/ACM ToN 2024,
//! arXiv:2306.09783).
//!
//! Invariants of [`jump_hash`]: bit-exact with the paper's reference code for every key and
//! every bucket count in `1..2^31`; the batch form returns exactly the single-key results.
//!
//! Invariants of [`JumpHash`]:
//! - Nodes occupy buckets `0..size` of a "b-array". With no removal, `get(k)` is
//!   `node[jump_hash(k, size)]`: the initial nodes take buckets in the order given, and a node added
//!   when nothing is removed takes the next bucket. Integer keys are read as already-hashed 64-bit
//!   values (as in the jump paper); byte keys go through [`super::hash_key`].
//! - Removing the last bucket while nothing else is removed just shrinks the b-array (plain jump
//!   hash). Removing any other bucket `b` records `(b, w, previous removal)`, `w` being the number
//!   of working buckets left; a key that lands on a removed bucket `b` is re-hashed to
//!   `XXH3-64(k as 8 LE bytes, seed = b) % w` and follows the replacements recorded since. Only the
//!   removed node's keys move, and they spread evenly over the remaining nodes (the paper's
//!   minimal-disruption and balance theorems).
//! - Adding a node restores the most recently removed bucket (LIFO), which undoes that removal
//!   exactly: keys move only to the added node.
//! - `preference(key, n)` is the failover order: entry `i + 1` is where the key would go if the
//!   first `i + 1` entries were removed (in that order), so `preference(k, 2)[1]` is exactly
//!   `get(k)` after removing `get(k)`.
//! - The hasher is unweighted: every weight is 1.
//! - Adding or removing a node costs O(1) (amortised): a removal records one bucket and gives
//!   the removed node's id to the node with the last id ([`NodeSet::swap_remove`]); nothing is
//!   renumbered.

use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{preference_len, ConsistentHash, Key, NodeId, NodeSet};
use crate::error::Result;

/// Bucket in `0..num_buckets` for `key`, bit-exact with the paper's reference implementation.
///
/// `num_buckets` must be at least 1 (callers validate; `0` yields `0` rather than panicking).
/// The reference loop keeps the bucket index as an integer and truncates the float jump to one;
/// here, where the CPU rounds a float in one instruction (SSE4.1's `roundsd`, AArch64's
/// `frintz`), the index stays an integer-valued `f64` instead, as in [`jump_lanes`]: each step's
/// dependency chain through `b` is then an add, a multiply and a round, without the two
/// int/float conversions. Every value is exact (`b + 1 <= 2^31`, the product below `2^62`), so
/// both loops give the same buckets. It inlines into its callers, which matters for a call from
/// Python that costs ~140 instructions in all.
#[inline]
pub fn jump_hash(key: u64, num_buckets: u32) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("sse4.1") {
            // SAFETY: the running CPU supports SSE4.1 (checked just above).
            return unsafe { jump_hash_sse41(key, num_buckets) };
        }
        jump_int(key, num_buckets)
    }
    #[cfg(target_arch = "aarch64")]
    {
        jump_float(key, num_buckets)
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        jump_int(key, num_buckets)
    }
}

/// The reference loop: the bucket index as an integer, the jump a float product truncated to an
/// integer. `j` stays below `2^62` (`(b + 1) <= 2^31` times a factor `<= 2^31`), so the
/// `f64 -> i64` conversion is exact truncation, as in C.
#[inline(always)]
pub(super) fn jump_int(mut key: u64, num_buckets: u32) -> u32 {
    let n = i64::from(num_buckets);
    let mut b: i64 = 0;
    let mut j: i64 = 0;
    while j < n {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        let next = (b + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64);
        // SAFETY: `next` is finite and below 2^62 (`b + 1 <= 2^31` while the loop runs, the
        // factor `<= 2^31`), so it fits `i64`: this is C's truncating conversion, unchecked.
        j = unsafe { next.to_int_unchecked::<i64>() };
    }
    b as u32
}

/// The reference loop with `b` and `j` as integer-valued `f64`s: `trunc` of the same product
/// is the same integer, and `j < n` compares the same exact values.
#[inline(always)]
pub(super) fn jump_float(mut key: u64, num_buckets: u32) -> u32 {
    let n = f64::from(num_buckets);
    let mut b = 0.0f64;
    let mut j = 0.0f64;
    while j < n {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        // (key >> 33) < 2^31, so the i32 conversion is exact.
        let divisor = f64::from((key >> 33) as i32) + 1.0;
        j = ((b + 1.0) * ((1u64 << 31) as f64 / divisor)).trunc();
    }
    // `b` is an integer below 2^31: the conversion is exact.
    b as u32
}

/// [`jump_float`] compiled with SSE4.1, whose `roundsd` makes `trunc` one instruction (without
/// it, a call into libm).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.1")]
fn jump_hash_sse41(key: u64, num_buckets: u32) -> u32 {
    jump_float(key, num_buckets)
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

/// Marks "no node" / "not removed" in the per-bucket arrays.
const NONE: u32 = u32::MAX;

/// Jump consistent hashing over named nodes, any of which may be removed.
#[derive(Debug, Clone, Default)]
pub struct JumpHash {
    nodes: NodeSet,
    /// Per node id: its bucket.
    bucket_of: Vec<u32>,
    /// Per bucket of the b-array: its node, or `NONE` when removed.
    node_at: Vec<NodeId>,
    /// Per bucket: the working-set size right after its removal, or `NONE`.
    replacer: Vec<u32>,
    /// Per removed bucket: the bucket removed just before it.
    prev_removed: Vec<u32>,
    last_removed: u32,
    removed: u32,
}

/// Follows MementoHash's replacements from `jump_hash(k, size)` to a working bucket.
/// `replacer(b)` is `NONE` for a working bucket.
#[inline]
fn lookup(k: u64, size: u32, replacer: impl Fn(u32) -> u32) -> u32 {
    let mut b = jump_hash(k, size);
    let mut r = replacer(b);
    // Each pass of the outer loop strictly lowers `r`, so it ends within `removed` passes.
    while r != NONE && r > 0 {
        let mut h = (xxh3_64_with_seed(&k.to_le_bytes(), u64::from(b)) % u64::from(r)) as u32;
        let mut r2 = replacer(h);
        // `h` was removed before `b` (when more buckets worked): take the bucket that replaced it.
        while r2 != NONE && r2 >= r {
            h = r2;
            r2 = replacer(h);
        }
        b = h;
        r = r2;
    }
    b
}

fn check_unweighted(name: &str, weight: f64) -> Result<()> {
    if weight == 1.0 {
        Ok(())
    } else {
        crate::value_err!("JumpHash is unweighted: weight of node {name:?} must be 1, got {weight}")
    }
}

impl JumpHash {
    /// Jump hash over `nodes`; node `i` takes bucket `i`.
    pub fn new<S: AsRef<str>>(nodes: impl IntoIterator<Item = S>) -> Result<Self> {
        let mut hasher = Self::default();
        for name in nodes {
            hasher.add(name.as_ref(), 1.0)?;
        }
        Ok(hasher)
    }

    /// Size of the b-array (working plus removed buckets).
    pub fn buckets(&self) -> u32 {
        self.node_at.len() as u32
    }

    /// The bucket node `id` occupies.
    pub fn bucket_of(&self, id: NodeId) -> Option<u32> {
        self.bucket_of.get(id as usize).copied()
    }

    #[inline]
    fn replacer_at(&self, b: u32) -> u32 {
        self.replacer.get(b as usize).copied().unwrap_or(NONE)
    }

    #[inline]
    fn node_of_bucket(&self, b: u32) -> NodeId {
        self.node_at.get(b as usize).copied().unwrap_or(NONE)
    }

    #[inline]
    fn locate(&self, k: u64) -> NodeId {
        self.node_of_bucket(lookup(k, self.buckets(), |b| self.replacer_at(b)))
    }
}

impl ConsistentHash for JumpHash {
    fn node_set(&self) -> &NodeSet {
        &self.nodes
    }

    fn get(&self, key: Key<'_>) -> Result<NodeId> {
        self.require_nodes()?;
        Ok(self.locate(key.prehashed64()))
    }

    fn preference_into(&self, key: Key<'_>, n: usize, out: &mut Vec<NodeId>) -> Result<()> {
        let n = preference_len(n, self.len())?;
        let k = key.prehashed64();
        out.clear();
        // Removals simulated on top of the real ones, exactly as `remove` would record them.
        let mut extra: HashMap<u32, u32> = HashMap::new();
        let mut size = self.buckets();
        let mut working = self.len() as u32;
        loop {
            let replacer = |b: u32| {
                extra
                    .get(&b)
                    .copied()
                    .unwrap_or_else(|| self.replacer_at(b))
            };
            let b = lookup(k, size, replacer);
            out.push(self.node_of_bucket(b));
            if out.len() >= n {
                return Ok(());
            }
            if self.removed == 0 && extra.is_empty() && b + 1 == size {
                size -= 1;
            } else {
                extra.insert(b, working - 1);
            }
            working -= 1;
        }
    }

    fn add(&mut self, name: &str, weight: f64) -> Result<()> {
        check_unweighted(name, weight)?;
        let id = self.nodes.push(name, weight)?;
        let bucket = if self.removed == 0 {
            self.node_at.push(id);
            self.replacer.push(NONE);
            self.prev_removed.push(NONE);
            self.last_removed = self.buckets();
            self.buckets() - 1
        } else {
            let b = self.last_removed;
            let at = b as usize;
            if let (Some(node), Some(rep), Some(prev)) = (
                self.node_at.get_mut(at),
                self.replacer.get_mut(at),
                self.prev_removed.get(at),
            ) {
                *node = id;
                *rep = NONE;
                self.last_removed = *prev;
            }
            self.removed -= 1;
            b
        };
        self.bucket_of.push(bucket);
        Ok(())
    }

    fn remove(&mut self, name: &str) -> Result<()> {
        let id = self.nodes.require(name)?;
        let b = self.bucket_of.get(id as usize).copied().unwrap_or(NONE);
        let size = self.buckets();
        if self.removed == 0 && b + 1 == size {
            self.node_at.pop();
            self.replacer.pop();
            self.prev_removed.pop();
            self.last_removed = size - 1;
        } else {
            let working_after = self.len() as u32 - 1;
            let at = b as usize;
            if let (Some(node), Some(rep), Some(prev)) = (
                self.node_at.get_mut(at),
                self.replacer.get_mut(at),
                self.prev_removed.get_mut(at),
            ) {
                *node = NONE;
                *rep = working_after;
                *prev = self.last_removed;
            }
            self.last_removed = b;
            self.removed += 1;
        }
        // The node with the last id takes `id` (see `NodeSet::swap_remove`): repoint its bucket.
        self.nodes.swap_remove(name)?;
        self.bucket_of.swap_remove(id as usize);
        if let Some(&moved) = self.bucket_of.get(id as usize) {
            if let Some(node) = self.node_at.get_mut(moved as usize) {
                *node = id;
            }
        }
        Ok(())
    }
}
