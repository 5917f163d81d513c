//! Jump hash over named nodes with removal of any node: MementoHash (Coluzzi, Brocco, Antonucci &
//! Leidi, "MementoHash: A Stateful, Minimal Memory, Best Performing Consistent Hash Algorithm",
//! IEEE/ACM ToN 2024, arXiv:2306.09783).
//!
//! Invariants:
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

use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{jump_hash, preference_len, ConsistentHash, Key, NodeId, NodeSet};
use crate::error::Result;

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
        self.nodes.remove(name)?;
        self.bucket_of.remove(id as usize);
        for node in self.node_at.iter_mut() {
            if *node != NONE && *node > id {
                *node -= 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
