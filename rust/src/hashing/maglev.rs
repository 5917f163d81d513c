//! Maglev hashing (Eisenbud et al., NSDI 2016) with Envoy's table construction.
//!
//! Invariants:
//! - The table has a prime number `M` of slots and is a pure function of the node set: nodes are
//!   sorted by name (byte-wise), node `name` has `offset = XXH64(name, seed 0) % M` and
//!   `skip = XXH64(name, seed 1) % (M - 1) + 1`, and slots are filled exactly as Envoy's
//!   `MaglevTable` does, weights included (normalised weight `w / sum(w)`; on pass `i = 1, 2, ...`
//!   a node takes its next free preferred slot only if `i * weight >= target`, after which its
//!   target grows by the largest normalised weight).
//! - `get(key)` is `table[k % M]`, where `k` is an integer key as given (an already-hashed 64-bit
//!   value, as Envoy's request hash) or [`super::hash_key`] of a byte key.
//! - `preference(key, n)` follows Envoy's host-selection retries: attempt `a >= 1` looks up
//!   `k ^ (2^64 - a)`. After `16 * len + 64` attempts it completes the list by sweeping the table
//!   from the key's slot, then appends nodes that own no slot (possible only with weights), in name
//!   order.

use xxhash_rust::xxh64::xxh64;

use super::{
    cycle_from, extend_distinct, preference_len, ConsistentHash, Key, NodeId, NodeSet, SeenNodes,
};
use crate::error::Result;

/// Envoy's default table size (prime).
pub const DEFAULT_TABLE_SIZE: u64 = 65_537;
/// Largest accepted table size.
pub const MAX_TABLE_SIZE: u64 = 1 << 26;

/// A Maglev lookup table over named, weighted nodes.
#[derive(Debug, Clone)]
pub struct Maglev {
    nodes: NodeSet,
    table_size: u64,
    table: Vec<NodeId>,
    slotless: Vec<NodeId>,
}

fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2u64;
    while d * d <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}

/// Per node while filling: its permutation and Envoy's weight bookkeeping.
struct Filler {
    id: NodeId,
    position: u64,
    skip: u64,
    weight: f64,
    target: f64,
}

impl Maglev {
    /// A Maglev table of `table_size` slots (a prime in `2..=2^26`) over `(name, weight)` pairs.
    pub fn new<S: AsRef<str>>(
        nodes: impl IntoIterator<Item = (S, f64)>,
        table_size: u64,
    ) -> Result<Self> {
        if !(2..=MAX_TABLE_SIZE).contains(&table_size) || !is_prime(table_size) {
            return crate::value_err!(
                "table_size must be a prime in 2..={MAX_TABLE_SIZE}, got {table_size}"
            );
        }
        Ok(Self::build(NodeSet::from_pairs(nodes)?, table_size))
    }

    /// Number of slots `M`.
    pub fn table_size(&self) -> u64 {
        self.table_size
    }

    /// The node of every slot (empty when there is no node).
    pub fn table(&self) -> &[NodeId] {
        &self.table
    }

    fn build(nodes: NodeSet, table_size: u64) -> Self {
        let m = table_size;
        let mut table = vec![NodeId::MAX; if nodes.is_empty() { 0 } else { m as usize }];
        let total: f64 = nodes.weights().iter().sum();
        let mut fillers: Vec<Filler> = nodes
            .ids_by_name()
            .into_iter()
            .map(|id| {
                let name = nodes.name(id).map(|n| n.as_bytes()).unwrap_or_default();
                let weight = nodes.weights().get(id as usize).copied().unwrap_or(0.0);
                Filler {
                    id,
                    position: xxh64(name, 0) % m,
                    skip: xxh64(name, 1) % (m - 1) + 1,
                    weight: weight / total,
                    target: 0.0,
                }
            })
            .collect();
        let max_weight = fillers.iter().map(|f| f.weight).fold(0.0, f64::max);
        let mut filled = 0u64;
        let mut iteration = 1u64;
        while filled < m && !fillers.is_empty() {
            for f in fillers.iter_mut() {
                if filled == m {
                    break;
                }
                if (iteration as f64) * f.weight < f.target {
                    continue;
                }
                f.target += max_weight;
                // The permutation visits every slot once per M steps, and a free slot exists.
                while table
                    .get(f.position as usize)
                    .is_some_and(|&s| s != NodeId::MAX)
                {
                    f.position = (f.position + f.skip) % m;
                }
                if let Some(slot) = table.get_mut(f.position as usize) {
                    *slot = f.id;
                }
                f.position = (f.position + f.skip) % m;
                filled += 1;
            }
            iteration += 1;
        }
        let slotless = nodes.unowned_by_name(&table);
        Self {
            nodes,
            table_size,
            table,
            slotless,
        }
    }

    #[inline]
    fn slot(&self, hash: u64) -> NodeId {
        self.table
            .get((hash % self.table_size) as usize)
            .copied()
            .unwrap_or(0)
    }
}

impl ConsistentHash for Maglev {
    fn node_set(&self) -> &NodeSet {
        &self.nodes
    }

    fn get(&self, key: Key<'_>) -> Result<NodeId> {
        self.require_nodes()?;
        Ok(self.slot(key.prehashed64()))
    }

    fn preference_into(&self, key: Key<'_>, n: usize, out: &mut Vec<NodeId>) -> Result<()> {
        let n = preference_len(n, self.len())?;
        out.clear();
        let mut seen = SeenNodes::new(self.len());
        let hash = key.prehashed64();
        let attempts = 16 * self.len() as u64 + 64;
        // Attempt `a` probes `hash ^ (2^64 - a)`; attempt 0 is the key's own slot.
        let retries = (0..attempts).map(|a| self.slot(hash ^ a.wrapping_neg()));
        extend_distinct(out, n, &mut seen, retries);
        let start = (hash % self.table_size) as usize;
        let sweep = cycle_from(&self.table, start).chain(self.slotless.iter().copied());
        extend_distinct(out, n, &mut seen, sweep);
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
        Ok(Self::build(
            self.nodes.with_node(name, weight)?,
            self.table_size,
        ))
    }

    fn with_removed(&self, name: &str) -> Result<Self> {
        Ok(Self::build(self.nodes.without_node(name)?, self.table_size))
    }
}
