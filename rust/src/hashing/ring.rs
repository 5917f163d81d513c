//! Consistent-hash ring (Karger et al.) in two flavours: libketama-compatible and XXH3.
//!
//! Invariants:
//! - A key maps to the owner of the first point `>= hash(key)` on the ring, wrapping to the first
//!   point (libketama's `ketama_get_server`). When several nodes own the same point, the node whose
//!   name sorts first (byte-wise) owns it, so placement depends only on the node set, never on the
//!   order nodes were added in.
//! - [`RingHash::Ketama`]: points and key hashes are libketama's ([`super::ketama`]); node `i`
//!   with weight `w_i` (a whole number) gets `4 * floor((vnodes/4) * n * w_i / sum(w))` points,
//!   computed exactly in integers (`uhashring`'s formula; see [`HashRing`] for how this relates to
//!   libketama's float32 arithmetic). `vnodes` must be a multiple of 4; the default 160 is
//!   libketama's 40 digests x 4 points and `uhashring`'s `vnodes=40`.
//! - [`RingHash::Xxh3`]: node `name` of weight `w` owns `max(1, round(vnodes * w))` points, point
//!   `j` at `XXH3-64(name, seed = j)`; keys hash with [`super::hash_key`]. A node's points depend
//!   only on its own name and weight, so adding or removing a node moves only keys to or from it.
//! - `preference(key, n)` walks the ring clockwise from the key's point, collecting distinct
//!   owners; nodes that own no point (possible in ketama mode for a tiny weight share) come last,
//!   in name order.
//! - [`RingBatch`] gives exactly [`HashRing::get`] of each key pushed, in order.
//! - Lookups are O(1) expected: a table indexed by the top bits of the hash (about two buckets per
//!   point) gives the first point of the key's bucket, and a short scan finds the answer.
//!   Batches on a ketama ring run eight lookups at a time in AVX-512 gathers where the CPU has
//!   them ([`super::ring_split`]), with the same answers.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::ketama::{ketama_hash, ketama_points, KetamaLanes};
use super::ring_split::SplitTable;
use super::{
    cycle_from, extend_distinct, preference_len, ConsistentHash, Key, NodeId, NodeSet, SeenNodes,
};
use crate::error::Result;
use crate::mem::prefetch;

/// Points per unit of weight by default: libketama's 40 digests x 4 points.
pub const DEFAULT_VNODES: u32 = 160;
/// The most points a ring may hold (about 200 MB of tables).
pub const MAX_POINTS: usize = 1 << 24;
/// Largest bucket table: 2^22 entries (16 MiB).
const MAX_TABLE_BITS: u32 = 22;

/// How a ring places points and hashes keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingHash {
    /// libketama / `uhashring` `hash_fn="ketama"`: MD5, 32-bit points, integer weights.
    Ketama,
    /// XXH3-64 points and keys; weights are multipliers of `vnodes`.
    Xxh3,
}

impl RingHash {
    fn hash_bits(self) -> u32 {
        match self {
            RingHash::Ketama => 32,
            RingHash::Xxh3 => 64,
        }
    }
}

/// A consistent-hash ring; see the module documentation for its guarantees.
///
/// Ketama mode versus its two references:
/// - Points per server: libketama computes the digest count as
///   `floorf((float)w / (float)sum * 40.0 * n)`, through a float32 share; `uhashring` as
///   `(40 * n * w) // sum` in integers. They differ when the exact count is an integer (or within
///   float32 rounding of one) that the float32 share rounds below: weights 1, 18, 21 give the third
///   server exactly 63 digests, but libketama computes floorf(62.999997) = 62. This ring uses the
///   exact integer formula: it matches `uhashring`, is platform-independent, and agrees with
///   libketama on every published vector (random weight lists differ about once in 7000).
/// - A key whose 32-bit hash equals a point goes to that point (libketama; `uhashring` bisects to
///   the next point). A point owned by two servers goes to the name that sorts first (libketama
///   keeps its sorted order, `uhashring` the server added last). Both cases need a 32-bit
///   collision: about `points / 2^32` per key, or `points^2 / 2^33` colliding points per ring.
/// - Hash 0 goes to the first point, as in libketama and `uhashring` (go-ketama, following Perl's
///   binary search, answers the last point).
#[derive(Debug, Clone)]
pub struct HashRing {
    pub(super) nodes: NodeSet,
    hash: RingHash,
    vnodes: u32,
    /// Sorted points, followed by a `u64::MAX` sentinel.
    pub(super) points: Vec<u64>,
    /// Owner of each point, followed by the owner of the first point (the wrap-around).
    owners: Vec<NodeId>,
    /// Per bucket of the top hash bits: the first point `>=` the bucket's lowest hash.
    pub(super) table: Vec<u32>,
    pub(super) shift: u32,
    pointless: Vec<NodeId>,
    /// Batch lookups eight at a time, where the CPU can (ketama rings only).
    pub(super) split: Option<SplitTable>,
}

impl HashRing {
    /// A ring over `nodes` (`(name, weight)` pairs, names unique, weights finite and positive;
    /// whole numbers in ketama mode) with `vnodes` points per unit of weight.
    pub fn new<S: AsRef<str>>(
        nodes: impl IntoIterator<Item = (S, f64)>,
        vnodes: u32,
        hash: RingHash,
    ) -> Result<Self> {
        Self::build(NodeSet::from_pairs(nodes)?, vnodes, hash)
    }

    /// How points and keys are hashed.
    pub fn hash_kind(&self) -> RingHash {
        self.hash
    }

    /// Points per unit of weight.
    pub fn vnodes(&self) -> u32 {
        self.vnodes
    }

    /// Number of points on the ring.
    pub fn num_points(&self) -> usize {
        self.points.len().saturating_sub(1)
    }

    /// The ring's points in ascending order, with their owners.
    pub fn points(&self) -> impl ExactSizeIterator<Item = (u64, NodeId)> + '_ {
        let n = self.num_points();
        let points = self.points.get(..n).unwrap_or_default();
        let owners = self.owners.get(..n).unwrap_or_default();
        points.iter().copied().zip(owners.iter().copied())
    }

    /// The position of `key` on the ring (a 32-bit value in ketama mode).
    #[inline]
    pub fn key_hash(&self, key: Key<'_>) -> u64 {
        match self.hash {
            RingHash::Ketama => u64::from(ketama_hash(key)),
            RingHash::Xxh3 => key.hash64(),
        }
    }

    pub(super) fn point_counts(nodes: &NodeSet, vnodes: u32, hash: RingHash) -> Result<Vec<usize>> {
        if vnodes == 0 {
            return crate::value_err!("vnodes must be >= 1, got 0");
        }
        let counts: Vec<usize> = match hash {
            RingHash::Ketama => {
                if !vnodes.is_multiple_of(4) {
                    return crate::value_err!(
                        "ketama places points in fours: vnodes must be a multiple of 4, got {vnodes}"
                    );
                }
                const EXACT: f64 = (1u64 << 53) as f64;
                for (name, &w) in nodes.names().iter().zip(nodes.weights()) {
                    if w.fract() != 0.0 || w > EXACT {
                        return crate::value_err!(
                            "ketama weights must be whole numbers <= 2**53, got {w} for node {name:?}"
                        );
                    }
                }
                let total: u128 = nodes.weights().iter().map(|&w| w as u128).sum();
                let scale = u128::from(vnodes / 4) * nodes.len() as u128;
                if scale * 4 > MAX_POINTS as u128 {
                    return crate::value_err!(
                        "ring too large: {} nodes x {vnodes} vnodes exceeds {MAX_POINTS} points",
                        nodes.len()
                    );
                }
                nodes
                    .weights()
                    .iter()
                    .map(|&w| (4 * (scale * w as u128 / total.max(1))) as usize)
                    .collect()
            }
            RingHash::Xxh3 => {
                let total: f64 = nodes
                    .weights()
                    .iter()
                    .map(|&w| (f64::from(vnodes) * w).round())
                    .sum();
                if total > MAX_POINTS as f64 {
                    return crate::value_err!(
                        "ring too large: weights x {vnodes} vnodes exceed {MAX_POINTS} points"
                    );
                }
                nodes
                    .weights()
                    .iter()
                    .map(|&w| ((f64::from(vnodes) * w).round() as usize).max(1))
                    .collect()
            }
        };
        Ok(counts)
    }

    fn build(nodes: NodeSet, vnodes: u32, hash: RingHash) -> Result<Self> {
        let counts = Self::point_counts(&nodes, vnodes, hash)?;
        let ranks = nodes.name_ranks();
        let mut entries: Vec<(u64, u32, NodeId)> = Vec::with_capacity(counts.iter().sum());
        for (id, (name, &count)) in nodes.names().iter().zip(&counts).enumerate() {
            let id = id as NodeId;
            let rank = ranks.get(id as usize).copied().unwrap_or(0);
            match hash {
                RingHash::Ketama => {
                    for j in 0..(count / 4) as u64 {
                        for p in ketama_points(name, j) {
                            entries.push((u64::from(p), rank, id));
                        }
                    }
                }
                RingHash::Xxh3 => {
                    for j in 0..count as u64 {
                        entries.push((xxh3_64_with_seed(name.as_bytes(), j), rank, id));
                    }
                }
            }
        }
        entries.sort_unstable();
        let mut points: Vec<u64> = entries.iter().map(|e| e.0).collect();
        let mut owners: Vec<NodeId> = entries.iter().map(|e| e.2).collect();
        let table = bucket_table(&points, hash.hash_bits());
        if let Some(&first) = owners.first() {
            points.push(u64::MAX);
            owners.push(first);
        }
        let pointless = nodes.unowned_by_name(&owners);
        let (table, shift) = table;
        let split = (hash == RingHash::Ketama)
            .then(|| SplitTable::build(&points, &owners, &table, shift))
            .flatten();
        Ok(Self {
            nodes,
            hash,
            vnodes,
            points,
            owners,
            table,
            shift,
            pointless,
            split,
        })
    }

    /// Index of the first point `>= h`, wrapping to 0.
    pub(super) fn position(&self, h: u64) -> usize {
        let i = self.points.partition_point(|&p| p < h);
        if i >= self.num_points() {
            0
        } else {
            i
        }
    }

    /// The owner of the first point `>= h` (wrapping). The ring must have points.
    ///
    /// The bucket table gives a start at most a few points before the answer; the sentinel stops
    /// every scan, and its owner is the wrap-around. Two unconditional steps cover almost every
    /// bucket, so lookups in a batch rarely mispredict a branch.
    #[inline]
    pub(super) fn owner_of(&self, h: u64) -> NodeId {
        let before = |i: usize| self.points.get(i).is_some_and(|&p| p < h);
        let mut i = self
            .table
            .get((h >> self.shift) as usize)
            .copied()
            .unwrap_or(0) as usize;
        i += usize::from(before(i));
        i += usize::from(before(i));
        while before(i) {
            i += 1;
        }
        self.owners.get(i).copied().unwrap_or(0)
    }
}

impl HashRing {
    /// Appends the owner of each of `hashes` to `out`, in order. Large rings do
    /// not fit in cache, and each lookup is three dependent loads (bucket, point, owner); so the
    /// bucket entry of hash `i + 2D` and the point and owner of hash `i + D` are prefetched while
    /// hash `i` is resolved. A ring whose tables fit in L2 is looked up without: there the
    /// prefetches cost more than they hide (64 nodes, 248 KiB: 2.3 ns per key without, 3.2 with;
    /// 1,024 nodes, 2.6 MiB: 5.6 with, 8.4 without; Sapphire Rapids, 2 MiB L2).
    #[inline]
    fn resolve(&self, hashes: &[u64], out: &mut Vec<NodeId>) {
        const D: usize = 8;
        let (n, hash) = (hashes.len(), |i: usize| hashes.get(i).copied().unwrap_or(0));
        out.reserve(n);
        /// Table bytes above which lookups prefetch (a common L2 size is 0.5 to 2 MiB).
        const PREFETCH_ABOVE: usize = 512 << 10;
        let bytes = 8 * self.points.len() + 4 * (self.owners.len() + self.table.len());
        if bytes <= PREFETCH_ABOVE {
            out.extend(hashes.iter().map(|&h| self.owner_of(h)));
            return;
        }
        for i in 0..n {
            if i + 2 * D < n {
                prefetch(self.table.get((hash(i + 2 * D) >> self.shift) as usize));
            }
            if i + D < n {
                let h = hash(i + D);
                let at = self
                    .table
                    .get((h >> self.shift) as usize)
                    .copied()
                    .unwrap_or(0) as usize;
                prefetch(self.points.get(at));
                prefetch(self.owners.get(at));
            }
            out.push(self.owner_of(hash(i)));
        }
    }
}

/// The bucket table over the top `bits` of the hash space: for each bucket, the index of the
/// first point `>=` its lowest hash (see [`HashRing::owner_of`]). Returns it with the shift that
/// maps a hash to its bucket.
pub(super) fn bucket_table(points: &[u64], hash_bits: u32) -> (Vec<u32>, u32) {
    if points.is_empty() {
        return (Vec::new(), hash_bits - 1);
    }
    // About two buckets per point.
    let bits = (usize::BITS - (points.len() - 1).leading_zeros() + 1).clamp(1, MAX_TABLE_BITS);
    let shift = hash_bits - bits;
    let mut table = Vec::with_capacity(1 << bits);
    let mut first = 0;
    for t in 0..(1u64 << bits) {
        let lo = t << shift;
        while points.get(first).is_some_and(|&p| p < lo) {
            first += 1;
        }
        table.push(first as u32);
    }
    (table, shift)
}

impl HashRing {
    /// Appends the owner of each ring position in `hashes` to `out`, in order: in gathers where
    /// the ring has a split table, else with [`HashRing::resolve`].
    fn owners_into(&self, hashes: &[u64], out: &mut Vec<NodeId>) {
        if let Some(split) = &self.split {
            split.owners_into(hashes, out, |h| self.owner_of(h));
            return;
        }
        self.resolve(hashes, out);
    }
}

/// Hashes [`RingBatch`] holds before looking them up: the lookups of a group run while its
/// hashes are in registers or L1 and the ring's tables still in cache, between the reads of
/// the next keys (looking 100k hashes up after hashing them all found the tables evicted by
/// the keys read meanwhile).
pub(super) const LOOKUP_GROUP: usize = 256;

/// `get` of keys given one at a time, for a caller that cannot hold on to its keys (a Python
/// list, read with the GIL held): each key is hashed as it comes (ketama keys in the MD5 lanes,
/// [`KetamaLanes`], a group of keys at a time) and the hashes looked up in groups of
/// [`LOOKUP_GROUP`]. After [`RingBatch::finish`], `out` holds the owner of every key pushed, in
/// order: exactly [`HashRing::get`] of each. The ring must have a node.
pub struct RingBatch<'r> {
    ring: &'r HashRing,
    lanes: KetamaLanes,
    hashes: [u64; LOOKUP_GROUP],
    /// Hashes pending in `hashes`.
    pending: usize,
}

impl<'r> RingBatch<'r> {
    /// A batch of lookups on `ring`; fails when it has no node.
    pub fn new(ring: &'r HashRing) -> Result<Self> {
        ring.require_nodes()?;
        Ok(Self {
            ring,
            lanes: KetamaLanes::new(),
            hashes: [0; LOOKUP_GROUP],
            pending: 0,
        })
    }

    /// Adds `key`. Owners reach `out` a group of hashes at a time, the rest at
    /// [`RingBatch::finish`].
    #[inline(always)]
    pub fn push(&mut self, key: Key<'_>, out: &mut Vec<NodeId>) {
        match self.ring.hash {
            RingHash::Ketama => {
                let (hashes, pending, ring) = (&mut self.hashes, &mut self.pending, self.ring);
                self.lanes.push(key, &mut |h| {
                    Self::add(ring, hashes, pending, u64::from(h), out)
                });
            }
            RingHash::Xxh3 => {
                Self::add(
                    self.ring,
                    &mut self.hashes,
                    &mut self.pending,
                    key.hash64(),
                    out,
                );
            }
        }
    }

    #[inline(always)]
    fn add(
        ring: &HashRing,
        hashes: &mut [u64; LOOKUP_GROUP],
        pending: &mut usize,
        h: u64,
        out: &mut Vec<NodeId>,
    ) {
        if let Some(slot) = hashes.get_mut(*pending) {
            *slot = h;
        }
        *pending += 1;
        if *pending == LOOKUP_GROUP {
            ring.owners_into(hashes, out);
            *pending = 0;
        }
    }

    /// Looks up the keys still pending, appending their owners to `out`; the batch is then empty.
    pub fn finish(&mut self, out: &mut Vec<NodeId>) {
        let (hashes, pending, ring) = (&mut self.hashes, &mut self.pending, self.ring);
        self.lanes
            .flush(&mut |h| Self::add(ring, hashes, pending, u64::from(h), out));
        ring.owners_into(hashes.get(..*pending).unwrap_or_default(), out);
        *pending = 0;
    }
}

impl ConsistentHash for HashRing {
    fn node_set(&self) -> &NodeSet {
        &self.nodes
    }

    fn get(&self, key: Key<'_>) -> Result<NodeId> {
        self.require_nodes()?;
        Ok(self.owner_of(self.key_hash(key)))
    }

    fn get_many_into<'k, I>(&self, keys: I, out: &mut Vec<NodeId>) -> Result<()>
    where
        I: IntoIterator<Item = Key<'k>>,
    {
        let mut batch = RingBatch::new(self)?;
        out.clear();
        for key in keys {
            batch.push(key, out);
        }
        batch.finish(out);
        Ok(())
    }

    fn preference_into(&self, key: Key<'_>, n: usize, out: &mut Vec<NodeId>) -> Result<()> {
        let n = preference_len(n, self.len())?;
        out.clear();
        let mut seen = SeenNodes::new(self.len());
        let start = self.position(self.key_hash(key));
        let owners = self.owners.get(..self.num_points()).unwrap_or_default();
        let walk = cycle_from(owners, start).chain(self.pointless.iter().copied());
        extend_distinct(out, n, &mut seen, walk);
        Ok(())
    }

    fn add(&mut self, name: &str, weight: f64) -> Result<()> {
        *self = self.with_added(name, weight)?;
        Ok(())
    }

    fn remove(&mut self, name: &str) -> Result<()> {
        *self = self.with_removed(name)?;
        Ok(())
    }

    fn with_added(&self, name: &str, weight: f64) -> Result<Self> {
        Self::build(self.nodes.with_node(name, weight)?, self.vnodes, self.hash)
    }

    fn with_removed(&self, name: &str) -> Result<Self> {
        Self::build(self.nodes.without_node(name)?, self.vnodes, self.hash)
    }
}
