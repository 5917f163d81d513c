//! Membership: workers joining, leaving, changing health or freshness, and the dedicated
//! endpoints whose pools follow them (see [`super::endpoints`] for the pool's guarantees).
//!
//! Cost: adding, removing or changing the health of a worker is O(1) amortised in the number of
//! workers (see [`super::workers`] for the table, [`super::endpoints`] for the pools), plus
//! O(pool) per endpoint; adding an endpoint draws its pool from every worker once, O(n).

use std::sync::Arc;

use crate::error::Result;
use crate::{key_err, value_err};

use super::approx::Model;
use super::endpoints::{Endpoint, EndpointSpec};
use super::pd::{Phase, Role};
use super::workers::{check_finite, WorkerTable};
use super::{IndexMode, Router};

impl Router {
    /// Adds worker `name` with relative capacity `weight`, doing both phases.
    pub fn add_worker(&mut self, name: &str, weight: f64) -> Result<()> {
        self.add_worker_as(name, weight, Role::default())
    }

    /// Adds worker `name` with relative capacity `weight` and `role` (see [`super::pd`]).
    pub fn add_worker_as(&mut self, name: &str, weight: f64, role: Role) -> Result<()> {
        self.workers.check_new(name, weight)?;
        let cache = match &self.model {
            Some(m) => Some(Box::new(m.new_cache()?)),
            None => None,
        };
        let index_id = match self.config.mode {
            IndexMode::Approx => Some(self.index.write().add_worker(name)?),
            IndexMode::Events => None,
        };
        let uniform = self.workers.uniform();
        let slot = self.workers.push(name, weight, role)?;
        if let Some(w) = self.workers.get_mut(slot) {
            w.cache = cache;
            w.index_id = index_id;
            w.engine_block_size = self.engine_sizes.get(name);
        }
        self.roster_stale = true;
        let resort = uniform != self.workers.uniform();
        self.update_pools(|workers, ep| {
            if resort {
                ep.resort(workers);
            }
            ep.joined(workers, slot) || resort
        });
        Ok(())
    }

    /// Removes worker `name`, its load, its blocks (from the index and every tier index) and its
    /// engine block size: a worker added later under the name is a new engine, counted in router
    /// blocks until its own size is known.
    pub fn remove_worker(&mut self, name: &str) -> Result<()> {
        let uniform = self.workers.uniform();
        let (slot, _) = self.workers.remove(name)?;
        self.engine_sizes.forget(name);
        // Harmless when it fails: the only error is "unknown worker", i.e. the index holds
        // nothing of it (events mode before its first event, or a tier it never used).
        let _ = self.index.write().remove_worker(name);
        if let Some(tiers) = &self.tiers {
            for (_, index) in tiers.read().iter() {
                // Same: a tier that never held the worker has nothing to drop.
                let _ = index.write().remove_worker(name);
            }
        }
        if let Some(inflight) = self.inflight.as_mut() {
            inflight.remove_worker(name);
        }
        self.roster_stale = true;
        let resort = uniform != self.workers.uniform();
        self.update_pools(|workers, ep| {
            if resort {
                ep.resort(workers);
            }
            ep.left(slot) || resort
        });
        if let Some(renumber) = self.workers.compact() {
            for ep in self.endpoints.values_mut() {
                ep.renumber(&renumber);
            }
            self.id_cache.clear();
            self.inflight_ids.clear();
        }
        Ok(())
    }

    /// Gives worker `name` the role `role`: it leaves the endpoint pools of the phases it no
    /// longer does and may join those of the phases it now does. Its load and blocks stay.
    pub fn set_role(&mut self, name: &str, role: Role) -> Result<()> {
        let (slot, changed) = self.workers.set_role(name, role)?;
        if changed {
            self.update_pools(|workers, ep| {
                let was = ep.left(slot);
                ep.joined(workers, slot) || was
            });
        }
        Ok(())
    }

    /// Worker `name`'s role.
    pub fn role(&self, name: &str) -> Result<Role> {
        Ok(self.workers.named(name)?.role)
    }

    /// Marks worker `name` healthy or not (unhealthy workers are never chosen).
    pub fn set_healthy(&mut self, name: &str, healthy: bool) -> Result<()> {
        let (slot, changed) = self.workers.set_healthy(name, healthy)?;
        if changed {
            self.update_pools(|_, ep| ep.ranks(slot));
        }
        Ok(())
    }

    /// Worker `name`'s index stream is stale since `now` (see [`workers`]).
    pub fn mark_stale(&mut self, name: &str, now: f64) -> Result<()> {
        self.workers.mark_stale(name, now)
    }

    /// Worker `name`'s index stream is trusted again.
    pub fn mark_fresh(&mut self, name: &str) -> Result<()> {
        self.workers.mark_fresh(name)
    }

    /// Sets worker `name`'s freshness to `value` in `[0, 1]`.
    pub fn set_freshness(&mut self, name: &str, value: f64) -> Result<()> {
        self.workers.set_freshness(name, value)
    }

    /// Worker `name`'s freshness at `now` (`Value` error when `now` is not finite).
    pub fn freshness(&self, name: &str, now: f64) -> Result<f64> {
        check_finite(now, "now")?;
        let half_life = self.config.stale_half_life;
        Ok(self.workers.named(name)?.freshness_at(now, half_life))
    }

    /// Refreshes the pool of every endpoint for which `touched` (which may update its order
    /// first) says the change matters and, in approx mode, moves the reservations with the
    /// members of the prefill pool: a worker leaving it keeps the endpoint's partition at 0
    /// blocks, one joining gets the reservation (as far as its cache has room).
    fn update_pools(&mut self, mut touched: impl FnMut(&WorkerTable, &mut Endpoint) -> bool) {
        let Router {
            endpoints,
            workers,
            scratch,
            ..
        } = self;
        let freed = &mut scratch.freed;
        freed.clear();
        for ep in endpoints.values_mut() {
            if !touched(workers, ep) {
                continue;
            }
            let before = ep.pool(Phase::Prefill).to_vec();
            ep.refresh_pool(workers);
            let Some(blocks) = ep.reserved_blocks else {
                continue;
            };
            let pool = ep.pool(Phase::Prefill);
            for &s in &before {
                if pool.binary_search(&s).is_err() {
                    if let Some(w) = workers.get_mut(s) {
                        Model::reserve(w, &ep.id, 0);
                        freed.push(s);
                    }
                }
            }
            for &s in pool {
                if before.binary_search(&s).is_err() {
                    if let Some(w) = workers.get_mut(s) {
                        Model::reserve(w, &ep.id, blocks);
                    }
                }
            }
        }
        top_up(endpoints.values(), workers, freed);
    }

    // ---- endpoints --------------------------------------------------------------------------

    /// Adds dedicated endpoint `id` as `spec` declares it: a pool of `spec.pool_size` workers
    /// per phase; `salt`: the endpoint's hash namespace (`None`: the endpoint id); `isolate =
    /// false` shares the router's namespace instead; `reserved_blocks` (approx mode) reserves
    /// that many blocks in each prefill-pool member's modelled cache; `priority` goes on its
    /// decisions.
    ///
    /// Errors: the id exists (`Value`), `pool_size` is 0 or above the healthy workers of every
    /// phase, a reservation does not fit in a member's cache (`Value`).
    pub fn add_endpoint(&mut self, id: &str, spec: EndpointSpec<'_>) -> Result<()> {
        if self.endpoints.contains_key(id) {
            return value_err!("endpoint {id:?} already exists");
        }
        let healthy = |phase: Phase| {
            self.workers
                .iter()
                .filter(|w| w.healthy && w.role.does(phase))
                .count()
        };
        let most = healthy(Phase::Prefill).max(healthy(Phase::Decode));
        let pool_size = spec.pool_size;
        if pool_size == 0 || pool_size > most {
            return value_err!(
                "pool_size must be between 1 and the {most} healthy workers of a phase, got \
                 {pool_size}"
            );
        }
        let mut ep = Endpoint::new(id, &spec, &self.hasher)?;
        ep.rank(&self.workers);
        ep.refresh_pool(&self.workers);
        if let Some(blocks) = spec.reserved_blocks {
            for &s in ep.pool(Phase::Prefill) {
                if let Some(w) = self.workers.get(s) {
                    if !Model::can_reserve(w, blocks) {
                        return value_err!(
                            "reserved_blocks = {blocks} does not fit in worker {:?}'s modelled \
                             cache next to its other reservations",
                            w.name
                        );
                    }
                }
            }
        }
        if let Some(blocks) = spec.reserved_blocks {
            for &s in ep.pool(Phase::Prefill) {
                if let Some(w) = self.workers.get_mut(s) {
                    Model::reserve(w, &ep.id, blocks);
                }
            }
        }
        self.endpoints.insert(ep.id.clone(), ep);
        Ok(())
    }

    /// Removes endpoint `id` (its reservations drop to 0).
    pub fn remove_endpoint(&mut self, id: &str) -> Result<()> {
        let Some(ep) = self.endpoints.remove(id) else {
            return key_err!("unknown endpoint {id:?}");
        };
        if ep.reserved_blocks.is_some() {
            // Only members hold more than 0 blocks of it (a worker leaving the pool drops to 0).
            let pool = ep.pool(Phase::Prefill);
            for &s in pool {
                if let Some(w) = self.workers.get_mut(s) {
                    Model::reserve(w, &ep.id, 0);
                }
            }
            top_up(self.endpoints.values(), &mut self.workers, pool);
        }
        Ok(())
    }

    /// Endpoint `id`.
    pub fn endpoint(&self, id: &str) -> Result<&Endpoint> {
        match self.endpoints.get(id) {
            Some(ep) => Ok(ep),
            None => key_err!("unknown endpoint {id:?}"),
        }
    }

    /// Names of endpoint `id`'s pool members, in slot order: those of `phase`, or (`None`) of
    /// either phase.
    pub fn endpoint_pool(&self, id: &str, phase: Option<Phase>) -> Result<Vec<Arc<str>>> {
        let ep = self.endpoint(id)?;
        let slots = match phase {
            Some(p) => ep.pool(p).to_vec(),
            None => ep.members(),
        };
        Ok(slots
            .iter()
            .filter_map(|&s| self.workers.get(s).map(|w| w.name.clone()))
            .collect())
    }
}

/// Gives the members among `slots` of every endpoint the reservation they may have been short
/// of (their cache had less room unreserved when they joined), now that room was freed there.
fn top_up<'a>(
    endpoints: impl Iterator<Item = &'a Endpoint>,
    workers: &mut WorkerTable,
    slots: &[u32],
) {
    if slots.is_empty() {
        return;
    }
    for ep in endpoints {
        let Some(blocks) = ep.reserved_blocks else {
            continue;
        };
        for &s in slots {
            if ep.pool(Phase::Prefill).binary_search(&s).is_ok() {
                if let Some(w) = workers.get_mut(s) {
                    Model::reserve(w, &ep.id, blocks);
                }
            }
        }
    }
}
