//! Stable key hashing and the consistent-hashing family.
//!
//! Invariants:
//! - [`hash_key`] is XXH3-64 with seed 0 over the key's bytes (a string's UTF-8 bytes; an integer's
//!   8 little-endian bytes). It is part of the public contract and never changes between releases.
//! - [`jump_hash`] is Lamping & Veach's jump consistent hash, bit-exact with the paper's reference
//!   code, applied to the 64-bit key exactly as given.
//! - Every hasher ([`HashRing`], [`Maglev`], [`Rendezvous`], [`JumpHash`]) implements
//!   [`ConsistentHash`]: a key maps to one node, deterministically, as a function of the key and
//!   the current node set (names and weights) only — not of the order nodes were added in, except
//!   where documented ([`JumpHash`] buckets). `preference` lists distinct nodes, starting with
//!   `get`. A failed call returns an [`Error`](crate::Error) and leaves the hasher unchanged.
//! - [`bounded`] walks a preference order under a load bound (consistent hashing with bounded
//!   loads, Mirrokni, Thorup & Zadimoghaddam 2018).
//!
//! Rust API for the router and other modules: build a hasher with `HashRing::new(pairs, vnodes,
//! RingHash::Xxh3)`, `Maglev::new(pairs, table_size)`, `Rendezvous::new(pairs)` or
//! `JumpHash::new(names)` (`pairs` yields `(name, weight)`), then use the [`ConsistentHash`]
//! methods. Lookups return [`NodeId`]s (indices into `node_set()`, valid until the next mutation);
//! the batch and preference calls fill a caller-owned `Vec` so hot loops reuse one buffer.
//! [`BoundedLoad::pick_for`] chooses a node for a key given per-node loads.

pub mod bounded;
mod jump;
pub mod ketama;
mod maglev;
mod nodes;
mod rendezvous;
mod ring;
mod ring_split;

pub use bounded::{BoundedLoad, BoundedPick};
pub use jump::{jump_hash, jump_hash_many_into, JumpHash};
pub use maglev::{Maglev, DEFAULT_TABLE_SIZE, MAX_TABLE_SIZE};
pub use nodes::{check_weight, NodeSet, MAX_NODES};
pub use rendezvous::{Rendezvous, Score as RendezvousScore};
pub use ring::{HashRing, RingBatch, RingHash, DEFAULT_VNODES, MAX_POINTS};

use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64;

use crate::error::Result;

/// A routing key: arbitrary bytes (a `str` is its UTF-8 encoding) or an unsigned 64-bit integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key<'a> {
    /// Raw bytes (strings are passed as their UTF-8 encoding).
    Bytes(&'a [u8]),
    /// An integer key, 0 ≤ k < 2^64.
    Int(u64),
}

impl Key<'_> {
    /// The key's stable 64-bit hash; see [`hash_key`].
    #[inline]
    pub fn hash64(&self) -> u64 {
        match *self {
            Key::Bytes(b) => hash_key(b),
            Key::Int(k) => hash_key(&k.to_le_bytes()),
        }
    }

    /// The key as an already-hashed 64-bit value: an integer as given, bytes through [`hash_key`].
    /// This is how [`Maglev`] and [`JumpHash`] read keys (as Envoy and the jump paper do).
    #[inline]
    pub fn prehashed64(&self) -> u64 {
        match *self {
            Key::Bytes(b) => hash_key(b),
            Key::Int(k) => k,
        }
    }
}

/// XXH3-64, seed 0, over `bytes`. Stable forever: persisted placements depend on it.
#[inline]
pub fn hash_key(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// Index of a node in its hasher's [`NodeSet`] (insertion order). Valid until the next mutation.
pub type NodeId = u32;

/// The face every consistent hasher shares.
///
/// `get` and `get_many_into` never allocate except to grow the caller's `out` buffer;
/// `preference_into` may also use scratch proportional to the number of nodes (a seen-set, or
/// every node's score). Mutations rebuild what they must and either succeed completely or change
/// nothing.
pub trait ConsistentHash {
    /// The hasher's nodes; [`NodeId`]s index into it.
    fn node_set(&self) -> &NodeSet;

    /// The node `key` maps to. Fails only when the hasher has no node.
    fn get(&self, key: Key<'_>) -> Result<NodeId>;

    /// Appends the node of every key to `out` (cleared first).
    fn get_many_into<'k, I>(&self, keys: I, out: &mut Vec<NodeId>) -> Result<()>
    where
        I: IntoIterator<Item = Key<'k>>,
    {
        self.require_nodes()?;
        out.clear();
        for key in keys {
            out.push(self.get(key)?);
        }
        Ok(())
    }

    /// Replaces `out` with `min(n, len)` distinct nodes in this hasher's fallback order for
    /// `key`; the first is [`ConsistentHash::get`]. Fails when `n == 0` or the hasher is empty.
    fn preference_into(&self, key: Key<'_>, n: usize, out: &mut Vec<NodeId>) -> Result<()>;

    /// Adds a node. Fails (changing nothing) on a duplicate name or an unacceptable weight.
    fn add(&mut self, name: &str, weight: f64) -> Result<()>;

    /// Removes a node. Fails with [`Error::Key`](crate::Error::Key) when it is unknown.
    fn remove(&mut self, name: &str) -> Result<()>;

    /// A new hasher: this one with the node added (`self` unchanged). Fails as
    /// [`ConsistentHash::add`] does. A hasher that rebuilds on a change builds it from `self`
    /// without copying itself first.
    fn with_added(&self, name: &str, weight: f64) -> Result<Self>
    where
        Self: Clone,
    {
        let mut next = self.clone();
        next.add(name, weight)?;
        Ok(next)
    }

    /// A new hasher: this one with the node removed (`self` unchanged). Fails as
    /// [`ConsistentHash::remove`] does, before copying anything.
    fn with_removed(&self, name: &str) -> Result<Self>
    where
        Self: Clone,
    {
        self.node_set().require(name)?;
        let mut next = self.clone();
        next.remove(name)?;
        Ok(next)
    }

    /// Number of nodes.
    fn len(&self) -> usize {
        self.node_set().len()
    }

    /// True when the hasher has no node.
    fn is_empty(&self) -> bool {
        self.node_set().is_empty()
    }

    /// True when a node is called `name`.
    fn contains(&self, name: &str) -> bool {
        self.node_set().contains(name)
    }

    /// The name of node `id`.
    fn name(&self, id: NodeId) -> Option<&Arc<str>> {
        self.node_set().name(id)
    }

    /// `Ok` when there is at least one node to route to.
    fn require_nodes(&self) -> Result<()> {
        if self.is_empty() {
            crate::value_err!("cannot route a key: the hasher has no nodes")
        } else {
            Ok(())
        }
    }
}

/// Validates a preference length against `len` nodes: `n == 0` fails, `n > len` is clamped.
pub(crate) fn preference_len(n: usize, len: usize) -> Result<usize> {
    if n == 0 {
        return crate::value_err!("preference length n must be >= 1, got 0");
    }
    if len == 0 {
        return crate::value_err!("cannot route a key: the hasher has no nodes");
    }
    Ok(n.min(len))
}

/// Appends the ids of `candidates` not in `seen` to `out`, in order, until `out` holds `n`.
pub(crate) fn extend_distinct(
    out: &mut Vec<NodeId>,
    n: usize,
    seen: &mut SeenNodes,
    candidates: impl IntoIterator<Item = NodeId>,
) {
    for id in candidates {
        if out.len() >= n {
            break;
        }
        if seen.insert(id) {
            out.push(id);
        }
    }
}

/// `ids` read cyclically, starting at position `start` (clamped to the end).
pub(crate) fn cycle_from(ids: &[NodeId], start: usize) -> impl Iterator<Item = NodeId> + '_ {
    let (before, after) = ids.split_at(start.min(ids.len()));
    after.iter().chain(before).copied()
}

/// A set of node ids seen so far, for building preference lists without duplicates.
pub(crate) struct SeenNodes {
    bits: Vec<u64>,
}

impl SeenNodes {
    pub(crate) fn new(len: usize) -> Self {
        Self {
            bits: vec![0; len.div_ceil(64)],
        }
    }

    /// Marks `id`; returns true if it was not marked before.
    #[inline]
    pub(crate) fn insert(&mut self, id: NodeId) -> bool {
        let (word, bit) = ((id / 64) as usize, 1u64 << (id % 64));
        match self.bits.get_mut(word) {
            Some(w) if *w & bit == 0 => {
                *w |= bit;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests;
