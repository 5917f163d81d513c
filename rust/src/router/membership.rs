//! Membership: workers joining, leaving, changing health or freshness, and the dedicated
//! endpoints whose pools follow them (see [`super::endpoints`] for the pool's guarantees).

use std::sync::Arc;

use crate::error::Result;
use crate::hashing::ConsistentHash;
use crate::{key_err, value_err};

use super::approx::Model;
use super::endpoints::Endpoint;
use super::{IndexMode, Router};

impl Router {
    /// Adds worker `name` with relative capacity `weight`.
    pub fn add_worker(&mut self, name: &str, weight: f64) -> Result<()> {
        self.workers.check_new(name, weight)?;
        let mut ring = self.ring.clone();
        ring.add(name, weight)?;
        let cache = match &self.model {
            Some(m) => Some(m.new_cache()?),
            None => None,
        };
        let index_id = match self.config.mode {
            IndexMode::Approx => Some(self.index.write().add_worker(name)?),
            IndexMode::Events => None,
        };
        let slot = self.workers.push(name, weight)?;
        if let Some(w) = self.workers.get_mut(slot) {
            w.cache = cache;
            w.index_id = index_id;
        }
        self.ring = ring;
        self.membership_changed();
        Ok(())
    }

    /// Removes worker `name`, its load and its blocks (from the index and every tier index).
    pub fn remove_worker(&mut self, name: &str) -> Result<()> {
        self.workers.require(name)?;
        let mut ring = self.ring.clone();
        ring.remove(name)?;
        self.workers.remove(name)?;
        self.ring = ring;
        // Harmless when it fails: the only error is "unknown worker", i.e. the index holds
        // nothing of it (events mode before its first event, or a tier it never used).
        let _ = self.index.write().remove_worker(name);
        if let Some(tiers) = &self.tiers {
            for (_, index) in tiers.read().iter() {
                // Same: a tier that never held the worker has nothing to drop.
                let _ = index.write().remove_worker(name);
            }
        }
        self.membership_changed();
        Ok(())
    }

    /// Marks worker `name` healthy or not (unhealthy workers are never chosen).
    pub fn set_healthy(&mut self, name: &str, healthy: bool) -> Result<()> {
        self.workers.named_mut(name)?.healthy = healthy;
        self.refresh_pools();
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

    /// Worker `name`'s freshness at `now`.
    pub fn freshness(&self, name: &str, now: f64) -> Result<f64> {
        let half_life = self.config.stale_half_life;
        Ok(self.workers.named(name)?.freshness_at(now, half_life))
    }

    fn membership_changed(&mut self) {
        self.roster = self.workers.iter().map(|w| w.name.clone()).collect();
        self.id_cache.clear();
        self.refresh_pools();
    }

    /// Recomputes every endpoint's pool and, in approx mode, the members' reservations.
    fn refresh_pools(&mut self) {
        let Router {
            endpoints,
            ring,
            workers,
            scratch,
            ..
        } = self;
        for ep in endpoints.values_mut() {
            ep.refresh_pool(ring, workers, &mut scratch.order);
            if let Some(blocks) = ep.reserved_blocks {
                for slot in 0..workers.len() as u32 {
                    let member = ep.pool.binary_search(&slot).is_ok();
                    if let Some(w) = workers.get_mut(slot) {
                        let holds = w
                            .cache
                            .as_ref()
                            .is_some_and(|c| c.partition(&ep.id).is_ok());
                        if member || holds {
                            Model::reserve(w, &ep.id, if member { blocks } else { 0 });
                        }
                    }
                }
            }
        }
    }

    // ---- endpoints --------------------------------------------------------------------------

    /// Adds a dedicated endpoint with a pool of `pool_size` workers. `salt`: the endpoint's hash
    /// namespace (`None`: the endpoint id); `isolate = false` shares the router's namespace
    /// instead. `reserved_blocks` (approx mode) reserves that many blocks in each member's
    /// modelled cache.
    ///
    /// Errors: the id exists (`Value`), `pool_size` is 0 or above the healthy workers, a
    /// reservation does not fit in a member's cache (`Value`).
    pub fn add_endpoint(
        &mut self,
        id: &str,
        pool_size: usize,
        reserved_blocks: Option<usize>,
        salt: Option<&str>,
        isolate: bool,
    ) -> Result<()> {
        if self.endpoints.contains_key(id) {
            return value_err!("endpoint {id:?} already exists");
        }
        let healthy = self.workers.iter().filter(|w| w.healthy).count();
        if pool_size == 0 || pool_size > healthy {
            return value_err!(
                "pool_size must be between 1 and the {healthy} healthy workers, got {pool_size}"
            );
        }
        let salt = isolate.then(|| salt.unwrap_or(id).to_owned());
        let mut ep = Endpoint::new(id, pool_size, reserved_blocks, salt, &self.hasher)?;
        ep.refresh_pool(&self.ring, &self.workers, &mut self.scratch.order);
        if let Some(blocks) = reserved_blocks {
            for &s in &ep.pool {
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
        self.endpoints.insert(ep.id.clone(), ep);
        self.refresh_pools();
        Ok(())
    }

    /// Removes endpoint `id` (its reservations drop to 0).
    pub fn remove_endpoint(&mut self, id: &str) -> Result<()> {
        let Some(ep) = self.endpoints.remove(id) else {
            return key_err!("unknown endpoint {id:?}");
        };
        if ep.reserved_blocks.is_some() {
            for w in self.workers.iter_mut() {
                if w.cache
                    .as_ref()
                    .is_some_and(|c| c.partition(&ep.id).is_ok())
                {
                    Model::reserve(w, &ep.id, 0);
                }
            }
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

    /// Names of endpoint `id`'s pool members, in slot order.
    pub fn endpoint_pool(&self, id: &str) -> Result<Vec<Arc<str>>> {
        let ep = self.endpoint(id)?;
        Ok(ep
            .pool
            .iter()
            .filter_map(|&s| self.workers.get(s).map(|w| w.name.clone()))
            .collect())
    }
}
