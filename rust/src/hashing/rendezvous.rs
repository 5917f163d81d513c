//! Weighted rendezvous (highest-random-weight) hashing, Thaler & Ravishankar 1998, with the
//! logarithmic method for weights (Schindelhauer & Schomaker 2005; Resch, "New Hashing Algorithms
//! for Data Storage").
//!
//! Invariants:
//! - For key hash `k` (= [`super::hash_key`] of the key; integers as 8 little-endian bytes) and node
//!   `i` with seed `s_i = XXH3-64(name_i)`, the draw is `h = fmix64(k ^ s_i)` (MurmurHash3's
//!   finaliser) and `u = ((h >> 11) + 0.5) / 2^53` in (0, 1). The node's score is
//!   `w_i / -ln(u)`; the key goes to the highest score. Then each node receives exactly the share
//!   `w_i / sum(w)` of keys in expectation, and changing one node's presence or weight moves keys
//!   only to or from that node.
//! - When all weights are equal the score order is the order of `h >> 11` (the same ranking,
//!   without logarithms).
//! - Ties (probability ~2^-53) go to the node whose name sorts first. `preference(key, n)` is the
//!   descending score order.
//! - `add` and `remove` change the node set in place: O(1), plus an O(n) scan of the weights when
//!   removing from a non-uniform set (no rebuild, no sort).

use std::cmp::Ordering;

use xxhash_rust::xxh3::xxh3_64;

use super::{preference_len, ConsistentHash, Key, NodeId, NodeSet};
use crate::error::Result;

/// A weighted rendezvous hasher.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    nodes: NodeSet,
    seeds: Vec<u64>,
    pub(super) uniform: bool,
}

#[inline]
pub(super) fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// A node's comparable score for one key: larger wins. Uniform weights compare the 53-bit draw;
/// weighted ones the logarithmic score (see the module docs). Scores compare only within one
/// mode (all uniform or all weighted).
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub enum Score {
    /// The draw `h >> 11` (every node has the same weight).
    Draw(u64),
    /// `w / -ln(u)`.
    Weighted(f64),
}

impl Rendezvous {
    /// A node's seed: `XXH3-64` of its name.
    pub fn node_seed(name: &str) -> u64 {
        xxh3_64(name.as_bytes())
    }

    /// The score of the node with `seed` and `weight` for the key hashing to `key_hash`;
    /// `uniform` when every node has the same weight (see the module docs). What a rendezvous
    /// hasher ranks by, for users (the router) that keep their own table of nodes.
    #[inline]
    pub fn node_score(key_hash: u64, seed: u64, weight: f64, uniform: bool) -> Score {
        let draw = fmix64(key_hash ^ seed) >> 11;
        if uniform {
            return Score::Draw(draw);
        }
        let u = (draw as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
        Score::Weighted(weight / -u.ln())
    }

    /// A rendezvous hasher over `(name, weight)` pairs.
    pub fn new<S: AsRef<str>>(nodes: impl IntoIterator<Item = (S, f64)>) -> Result<Self> {
        Ok(Self::build(NodeSet::from_pairs(nodes)?))
    }

    fn build(nodes: NodeSet) -> Self {
        let seeds = nodes.names().iter().map(|n| Self::node_seed(n)).collect();
        let uniform = all_equal(nodes.weights());
        Self {
            nodes,
            seeds,
            uniform,
        }
    }

    #[inline]
    fn score(&self, key_hash: u64, i: usize) -> Score {
        let seed = self.seeds.get(i).copied().unwrap_or(0);
        let w = self.nodes.weights().get(i).copied().unwrap_or(0.0);
        Self::node_score(key_hash, seed, w, self.uniform)
    }

    /// Descending score, then ascending name.
    fn order(&self, a: (Score, usize), b: (Score, usize)) -> Ordering {
        b.0.partial_cmp(&a.0)
            .unwrap_or(Ordering::Equal)
            .then_with(|| {
                let name = |i: usize| self.nodes.names().get(i);
                name(a.1).cmp(&name(b.1))
            })
    }

    fn best(&self, key_hash: u64) -> NodeId {
        let mut best = (self.score(key_hash, 0), 0usize);
        for i in 1..self.seeds.len() {
            let cand = (self.score(key_hash, i), i);
            if self.order(cand, best) == Ordering::Less {
                best = cand;
            }
        }
        best.1 as NodeId
    }
}

impl ConsistentHash for Rendezvous {
    fn node_set(&self) -> &NodeSet {
        &self.nodes
    }

    fn get(&self, key: Key<'_>) -> Result<NodeId> {
        self.require_nodes()?;
        Ok(self.best(key.hash64()))
    }

    fn preference_into(&self, key: Key<'_>, n: usize, out: &mut Vec<NodeId>) -> Result<()> {
        let n = preference_len(n, self.len())?;
        let k = key.hash64();
        let mut scored: Vec<(Score, usize)> = (0..self.seeds.len())
            .map(|i| (self.score(k, i), i))
            .collect();
        if n < scored.len() {
            scored.select_nth_unstable_by(n - 1, |&a, &b| self.order(a, b));
            scored.truncate(n);
        }
        scored.sort_unstable_by(|&a, &b| self.order(a, b));
        out.clear();
        out.extend(scored.iter().map(|&(_, i)| i as NodeId));
        Ok(())
    }

    fn add(&mut self, name: &str, weight: f64) -> Result<()> {
        // `push` validates first: on error nothing has changed.
        self.nodes.push(name, weight)?;
        self.seeds.push(Self::node_seed(name));
        self.uniform = self.uniform && self.nodes.weights().first() == Some(&weight);
        Ok(())
    }

    fn remove(&mut self, name: &str) -> Result<()> {
        // Ids are internal (answers are names; ties break by name), so the last node may take
        // the removed one's id.
        let id = self.nodes.swap_remove(name)? as usize;
        if id < self.seeds.len() {
            self.seeds.swap_remove(id);
        }
        self.uniform = self.uniform || all_equal(self.nodes.weights());
        Ok(())
    }
}

/// Whether every weight is the same (true for none or one).
fn all_equal(weights: &[f64]) -> bool {
    weights.windows(2).all(|w| w[0] == w[1])
}
