//! Consistent hashing with bounded loads (Mirrokni, Thorup & Zadimoghaddam, "Consistent Hashing
//! with Bounded Loads", SODA 2018, arXiv:1608.01350).
//!
//! Invariants:
//! - With `T` requests already in flight, node `i` may take a new one only while its load is below
//!   its capacity `ceil(c * (T + 1) * s_i)`, where `s_i` is its share (`1/n`, or `w_i / sum(w)`
//!   with weights) and `T + 1` counts the incoming request, as in the paper. Capacities are at least
//!   1, so an idle node always qualifies. (`c * (T + 1) * s_i` is a float; a product within 1e-9
//!   relative of an integer is taken as that integer, so 1.1 x 50, 55.00000000000001 in f64,
//!   gives 55, not 56.)
//! - [`BoundedLoad::pick`] walks a preference order (a hasher's `preference`) and returns the first
//!   node under capacity. When the order lists every node and `c >= 1`, one always is: the
//!   capacities sum to at least `T + 1`, more than the `T` requests in flight.
//! - If no listed node is under capacity (a partial list), the listed node with the lowest
//!   load/capacity ratio (first in order on ties) is returned with `within_bound == false`.
//! - Nothing here allocates except [`BoundedLoad::pick_for`], which reuses the caller's buffer.

use super::{ConsistentHash, Key, NodeId};
use crate::error::Result;

/// Nodes [`BoundedLoad::pick_for`] asks for before falling back to the full preference order.
const FIRST_PROBES: usize = 8;

/// The load bound: a node may hold at most `c` times the mean load (including the new request).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoundedLoad {
    c: f64,
}

/// The outcome of a bounded-load pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoundedPick {
    /// The chosen node.
    pub node: NodeId,
    /// How many preference entries were examined (1 when the first choice was under capacity).
    pub probes: usize,
    /// False only when no examined node was under capacity.
    pub within_bound: bool,
}

impl Default for BoundedLoad {
    fn default() -> Self {
        Self { c: Self::DEFAULT_C }
    }
}

impl BoundedLoad {
    /// The paper's and DESIGN.md's default balance factor.
    pub const DEFAULT_C: f64 = 1.25;

    /// A bound of `c` times the mean load; `c` must be finite and at least 1.
    pub fn new(c: f64) -> Result<Self> {
        if c.is_finite() && c >= 1.0 {
            Ok(Self { c })
        } else {
            crate::value_err!("bounded-load factor c must be finite and >= 1, got {c}")
        }
    }

    /// The balance factor `c`.
    pub fn c(&self) -> f64 {
        self.c
    }

    /// Capacity of a node with share `share` (of 1) when `total_load` requests are in flight.
    pub fn capacity(&self, total_load: u64, share: f64) -> u64 {
        let x = self.c * (total_load as f64 + 1.0) * share;
        let mut cap = x.ceil();
        if x - (cap - 1.0) <= 1e-9 * x.max(1.0) {
            cap -= 1.0;
        }
        (cap as u64).max(1)
    }

    /// The first node of `preference` whose load is under its capacity.
    ///
    /// `loads` (and `weights`, when given) are indexed by [`NodeId`] and cover every node of the
    /// hasher; their sum is the load in flight. Fails when `preference` is empty, names a node
    /// outside `loads`, or `weights` has another length or a weight that is not finite and > 0.
    pub fn pick(
        &self,
        preference: &[NodeId],
        loads: &[u64],
        weights: Option<&[f64]>,
    ) -> Result<BoundedPick> {
        if preference.is_empty() {
            return crate::value_err!("bounded-load pick needs a non-empty preference order");
        }
        if let Some(&bad) = preference.iter().find(|&&id| id as usize >= loads.len()) {
            return crate::value_err!(
                "preference names node {bad} but loads cover {} nodes",
                loads.len()
            );
        }
        let total_weight = match weights {
            None => loads.len() as f64,
            Some(w) => {
                if w.len() != loads.len() {
                    return crate::value_err!(
                        "{} weights given for {} loads",
                        w.len(),
                        loads.len()
                    );
                }
                if let Some(bad) = w.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                    return crate::value_err!("weights must be finite and > 0, got {bad}");
                }
                w.iter().sum()
            }
        };
        let total_load: u64 = loads.iter().fold(0u64, |a, &l| a.saturating_add(l));
        let mut best: Option<(f64, NodeId)> = None;
        for (probe, &id) in preference.iter().enumerate() {
            let weight = weights
                .and_then(|w| w.get(id as usize).copied())
                .unwrap_or(1.0);
            let cap = self.capacity(total_load, weight / total_weight);
            let load = loads.get(id as usize).copied().unwrap_or(0);
            if load < cap {
                return Ok(BoundedPick {
                    node: id,
                    probes: probe + 1,
                    within_bound: true,
                });
            }
            let ratio = load as f64 / cap as f64;
            if best.is_none_or(|(r, _)| ratio < r) {
                best = Some((ratio, id));
            }
        }
        let node = best.map_or(0, |(_, id)| id);
        Ok(BoundedPick {
            node,
            probes: preference.len(),
            within_bound: false,
        })
    }

    /// [`BoundedLoad::pick`] over `hasher`'s preference order for `key`, asking for a short
    /// prefix first and for the whole order only when every node in it is full. `scratch` is
    /// reused for the preference list.
    pub fn pick_for<H: ConsistentHash>(
        &self,
        hasher: &H,
        key: Key<'_>,
        loads: &[u64],
        weights: Option<&[f64]>,
        scratch: &mut Vec<NodeId>,
    ) -> Result<BoundedPick> {
        if loads.len() != hasher.len() {
            return crate::value_err!(
                "{} loads given for a hasher of {} nodes",
                loads.len(),
                hasher.len()
            );
        }
        hasher.preference_into(key, FIRST_PROBES, scratch)?;
        let first = self.pick(scratch, loads, weights)?;
        if first.within_bound || scratch.len() == hasher.len() {
            return Ok(first);
        }
        hasher.preference_into(key, hasher.len(), scratch)?;
        self.pick(scratch, loads, weights)
    }
}
