//! The named, weighted node set every hasher is built on.
//!
//! Invariants: names are unique; weights are finite and positive; [`NodeId`]s are dense
//! (`0..len`) and a new node takes id `len`. [`NodeSet::remove`] keeps ids in insertion order
//! (later ids shift down by one, O(n)) — the router relies on its hasher's ids following its
//! worker table; [`NodeSet::swap_remove`] gives the freed id to the node with the last one (every
//! other id stays, O(1)). An id is therefore only meaningful for the hasher state that produced
//! it. [`NodeSet::in_order`] lists the nodes in the order they were added, whatever the removals.

use std::sync::Arc;

use hashbrown::HashMap;

use super::NodeId;
use crate::error::{Error, Result};

/// The most nodes a hasher holds (ids must fit below the flag bit the lookup tables use).
pub const MAX_NODES: usize = 1 << 24;

/// Marks the ends of the insertion-order list.
const END: NodeId = NodeId::MAX;

/// Names and weights of a hasher's nodes, indexed by [`NodeId`], and their insertion order.
#[derive(Debug, Clone)]
pub struct NodeSet {
    names: Vec<Arc<str>>,
    weights: Vec<f64>,
    ids: HashMap<Arc<str>, NodeId>,
    /// Per id: `(previous, next)` in insertion order ([`END`] at the ends).
    links: Vec<(NodeId, NodeId)>,
    first: NodeId,
    last: NodeId,
}

impl Default for NodeSet {
    fn default() -> Self {
        NodeSet {
            names: Vec::new(),
            weights: Vec::new(),
            ids: HashMap::new(),
            links: Vec::new(),
            first: END,
            last: END,
        }
    }
}

/// `Ok` when `weight` is finite and positive; otherwise a `ValueError` naming the node.
pub fn check_weight(name: &str, weight: f64) -> Result<()> {
    if weight.is_finite() && weight > 0.0 {
        Ok(())
    } else {
        crate::value_err!("weight of node {name:?} must be finite and > 0, got {weight}")
    }
}

impl NodeSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// A set holding `nodes` in order; fails on a duplicate name or a bad weight.
    pub fn from_pairs<S: AsRef<str>>(nodes: impl IntoIterator<Item = (S, f64)>) -> Result<Self> {
        let mut set = Self::new();
        for (name, weight) in nodes {
            set.push(name.as_ref(), weight)?;
        }
        Ok(set)
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// True when there is no node.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Node names, indexed by [`NodeId`].
    pub fn names(&self) -> &[Arc<str>] {
        &self.names
    }

    /// Node weights, indexed by [`NodeId`].
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// The name of node `id`.
    pub fn name(&self, id: NodeId) -> Option<&Arc<str>> {
        self.names.get(id as usize)
    }

    /// The id of the node called `name`.
    pub fn id(&self, name: &str) -> Option<NodeId> {
        self.ids.get(name).copied()
    }

    /// True when a node is called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.ids.contains_key(name)
    }

    /// Checks that `name` could be added with `weight`, without adding it.
    pub fn check_new(&self, name: &str, weight: f64) -> Result<()> {
        if self.contains(name) {
            return crate::value_err!("node {name:?} is already present");
        }
        if self.len() >= MAX_NODES {
            return crate::value_err!("cannot add node {name:?}: at most {MAX_NODES} nodes");
        }
        check_weight(name, weight)
    }

    /// Appends a node; returns its id (`len` before the call).
    pub fn push(&mut self, name: &str, weight: f64) -> Result<NodeId> {
        self.check_new(name, weight)?;
        let id = self.names.len() as NodeId;
        let name: Arc<str> = Arc::from(name);
        self.ids.insert(Arc::clone(&name), id);
        self.names.push(name);
        self.weights.push(weight);
        self.links.push((self.last, END));
        match self.links.get_mut(self.last as usize) {
            Some(prev) => prev.1 = id,
            None => self.first = id,
        }
        self.last = id;
        Ok(id)
    }

    /// The id of `name`, or a `KeyError` naming it.
    pub fn require(&self, name: &str) -> Result<NodeId> {
        self.id(name)
            .ok_or_else(|| Error::Key(format!("unknown node {name:?}")))
    }

    /// Removes `name`; returns the id it had. Ids above it shift down by one. O(n).
    pub fn remove(&mut self, name: &str) -> Result<NodeId> {
        let id = self.require(name)?;
        self.unlink(id);
        let at = id as usize;
        self.names.remove(at);
        self.weights.remove(at);
        self.links.remove(at);
        self.ids.remove(name);
        let shift = |x: &mut NodeId| {
            if *x != END && *x > id {
                *x -= 1;
            }
        };
        for later in self.ids.values_mut() {
            shift(later);
        }
        for (prev, next) in &mut self.links {
            shift(prev);
            shift(next);
        }
        shift(&mut self.first);
        shift(&mut self.last);
        Ok(id)
    }

    /// Removes `name`; returns the id it had, which the node with the last id (`len` after the
    /// call) now has, unless it was that node. O(1).
    pub fn swap_remove(&mut self, name: &str) -> Result<NodeId> {
        let id = self.require(name)?;
        self.unlink(id);
        let at = id as usize;
        self.names.swap_remove(at);
        self.weights.swap_remove(at);
        self.links.swap_remove(at);
        self.ids.remove(name);
        let moved = self.names.len() as NodeId;
        if id != moved {
            // The last node now has `id`: repoint its map entry and its neighbours' links.
            if let Some(n) = self.names.get(at) {
                if let Some(slot) = self.ids.get_mut(n) {
                    *slot = id;
                }
            }
            let (prev, next) = self.links.get(at).copied().unwrap_or((END, END));
            match self.links.get_mut(prev as usize) {
                Some(p) => p.1 = id,
                None => self.first = id,
            }
            match self.links.get_mut(next as usize) {
                Some(n) => n.0 = id,
                None => self.last = id,
            }
        }
        Ok(id)
    }

    /// Takes `id` out of the insertion-order list.
    fn unlink(&mut self, id: NodeId) {
        let (prev, next) = self.links.get(id as usize).copied().unwrap_or((END, END));
        match self.links.get_mut(prev as usize) {
            Some(p) => p.1 = next,
            None => self.first = next,
        }
        match self.links.get_mut(next as usize) {
            Some(n) => n.0 = prev,
            None => self.last = prev,
        }
    }

    /// The node ids in the order the nodes were added.
    pub fn in_order(&self) -> impl Iterator<Item = NodeId> + '_ {
        let mut at = self.first;
        std::iter::from_fn(move || {
            let id = at;
            at = self.links.get(id as usize)?.1;
            Some(id)
        })
    }

    /// Node ids ordered by name, byte-wise (the order hashers use to break ties).
    pub fn ids_by_name(&self) -> Vec<NodeId> {
        let mut ids: Vec<NodeId> = (0..self.len() as NodeId).collect();
        ids.sort_unstable_by(|&a, &b| self.names[a as usize].cmp(&self.names[b as usize]));
        ids
    }

    /// A copy with node `name` appended (see [`NodeSet::push`]); `self` is unchanged on error.
    pub fn with_node(&self, name: &str, weight: f64) -> Result<Self> {
        let mut set = self.clone();
        set.push(name, weight)?;
        Ok(set)
    }

    /// A copy without node `name` (see [`NodeSet::remove`]); `self` is unchanged on error.
    pub fn without_node(&self, name: &str) -> Result<Self> {
        let mut set = self.clone();
        set.remove(name)?;
        Ok(set)
    }

    /// The ids, in name order, of the nodes that appear nowhere in `owners` (a lookup table's
    /// entries), so that preference lists can still reach them.
    pub fn unowned_by_name(&self, owners: &[NodeId]) -> Vec<NodeId> {
        let mut owns = vec![false; self.len()];
        for &id in owners {
            if let Some(slot) = owns.get_mut(id as usize) {
                *slot = true;
            }
        }
        self.ids_by_name()
            .into_iter()
            .filter(|&id| !owns.get(id as usize).copied().unwrap_or(true))
            .collect()
    }

    /// For each node id, its position in [`NodeSet::ids_by_name`].
    pub fn name_ranks(&self) -> Vec<u32> {
        let mut ranks = vec![0u32; self.len()];
        for (rank, id) in self.ids_by_name().into_iter().enumerate() {
            if let Some(r) = ranks.get_mut(id as usize) {
                *r = rank as u32;
            }
        }
        ranks
    }
}
