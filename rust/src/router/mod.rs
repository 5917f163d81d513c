//! The router: one object that takes a request and answers which worker, why, and how much of the
//! prompt is expected to be cached there.
//!
//! [`Router::route`] reads in four steps, all in this file and [`policy`]: the prompt's tokens are
//! hashed into chained block hashes (by the router's [`BlockHasher`], or the endpoint's salted one;
//! done by the caller before taking the router's lock, see [`Router::hasher_for`]) → one walk of
//! the [`PrefixIndex`] gives every worker's cached overlap → each candidate gets the policy's score
//! ([`policy`]) → the best one is picked, and in approx mode the prompt is recorded on it
//! ([`approx`]).
//!
//! # Guarantees
//! - **Candidates.** Only healthy workers are ever chosen; with `endpoint`, only members of its
//!   pool ([`endpoints`]); never a worker listed in `exclude`. No candidate → [`Error::Value`]
//!   ("no healthy worker").
//! - **Index modes.** `Approx`: the router's own model of every worker's cache ([`approx`]), kept
//!   in the index it exposes (read it, do not write it). `Events`: the index is fed from outside
//!   (engine KV events through an [`crate::events::Applier`] built by
//!   [`Router::new_event_applier`], or a simulator); the router only reads it, and scores blocks
//!   found only in a slower tier (the applier's tier indexes: `"CPU"`, disk, …) at that tier's
//!   weight. In both modes a worker's overlap credit is scaled by its freshness
//!   ([`workers`]), so a worker whose event stream is stale is trusted less and less.
//! - **Tier credit.** With per-tier overlaps `o_t` (leading blocks held in tier `t`, GPU included
//!   with weight 1) the credit is `Σ_{i < max o_t} max{ w_t : o_t > i }`: each block counts at the
//!   weight of the best tier holding it, as far as some tier holds the whole prefix.
//! - **Load accounting** ([`workers`]): `begin` adds a decision's request to its worker's
//!   counters, `prefilled` takes its prefill blocks off the queue, `finish` takes the rest off.
//!   Beginning twice, finishing twice or before beginning, or passing another router's decision
//!   is an error that changes nothing. Counters are exact: every change happens under the
//!   router's lock (`&mut self`).
//! - **Errors change nothing** (except that blocks idle past the TTL expire as time passes):
//!   unknown worker / endpoint names are [`Error::Key`], bad values [`Error::Value`].
//! - **Time.** Every call that depends on time takes `now` in seconds (any clock, e.g. virtual
//!   time in a simulator, but one clock for one router): the TTL of idle blocks in approx mode and
//!   the decay of stale workers use it.
//!
//! # Rust use
//! Build with [`Router::new`] from a [`Config`]; hash with `router.hasher_for(endpoint)?` (an
//! `Arc<BlockHasher>`, so hashing can run without the router's lock) or give block hashes
//! directly (salted for an endpoint by [`Router::salt_block_hashes`]); then
//! `router.route(&RouteRequest { .. })`, `begin`, `prefilled`, `finish`, `observe` with the
//! returned [`Decision`]. Share a router between threads behind a `Mutex`.

mod approx;
mod decision;
mod endpoints;
mod policy;
mod workers;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::RwLock;

use crate::blocks::{BlockHasher, ChainState, Options, Profile, TokenId};
use crate::error::{Error, Result};
use crate::events::{Applier, Mode, TierRegistry};
use crate::hashing::{BoundedLoad, ConsistentHash, Key, Rendezvous};
use crate::index::{PrefixIndex, SharedPrefixIndex, WorkerId};
use crate::{key_err, value_err};

pub use decision::{Decision, Stage};
pub use endpoints::Endpoint;
pub use policy::{CostWeights, Policy, Reason, SplitMix64};
pub use workers::{Freshness, Worker, WorkerTable};

use approx::Model;
use workers::check_finite;

/// Where the router's index comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexMode {
    /// The router models each worker's cache from where it sent prefixes.
    Approx,
    /// The index is fed from outside (engine KV events).
    Events,
}

impl IndexMode {
    /// `"approx"` or `"events"`.
    pub fn name(self) -> &'static str {
        match self {
            IndexMode::Approx => "approx",
            IndexMode::Events => "events",
        }
    }
}

impl std::str::FromStr for IndexMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "approx" => Ok(IndexMode::Approx),
            "events" => Ok(IndexMode::Events),
            other => value_err!("index must be 'approx' or 'events', got {other:?}"),
        }
    }
}

/// Weight of overlap found only in a tier not named in [`Config::tier_weights`].
pub const OTHER_TIER_WEIGHT: f64 = 0.25;

/// The router's configuration (see the module docs and [`policy`] for the meaning of each term).
#[derive(Clone, Debug)]
pub struct Config {
    /// The routing policy (default `KvAware`).
    pub policy: Policy,
    /// Tokens per block (default 16).
    pub block_size: usize,
    /// Block hash profile (default `Native`).
    pub profile: Profile,
    /// Hasher options: a router-wide salt, LoRA, vLLM seed (default none).
    pub hash_options: Options,
    /// Index mode (default `Approx`).
    pub mode: IndexMode,
    /// Approx mode: modelled cache capacity per worker, in blocks (default 32 768: 512k tokens of
    /// 16, roughly an 8B model's KV space on an 80 GB GPU).
    pub capacity_blocks: usize,
    /// Approx mode: blocks idle longer than this many seconds are considered gone (default none).
    pub ttl: Option<f64>,
    /// `kv_aware` load-term weights.
    pub weights: CostWeights,
    /// `hash` bounded-load factor `c` (default 1.25).
    pub bound_c: f64,
    /// Seed of `random` and `power_of_two` (default 0).
    pub seed: u64,
    /// Seconds for a stale worker's freshness to halve (default 5).
    pub stale_half_life: f64,
    /// Overlap weight per non-GPU tier (default `CPU` and `CPU_PINNED` 0.5; others
    /// [`OTHER_TIER_WEIGHT`]).
    pub tier_weights: Vec<(String, f64)>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            policy: Policy::KvAware,
            block_size: 16,
            profile: Profile::Native,
            hash_options: Options::default(),
            mode: IndexMode::Approx,
            capacity_blocks: 32_768,
            ttl: None,
            weights: CostWeights::default(),
            bound_c: BoundedLoad::DEFAULT_C,
            seed: 0,
            stale_half_life: 5.0,
            tier_weights: vec![("CPU".into(), 0.5), ("CPU_PINNED".into(), 0.5)],
        }
    }
}

/// One request to route.
#[derive(Clone, Debug, Default)]
pub struct RouteRequest<'a> {
    /// The prompt's block hashes (from [`Router::hasher_for`], or given and salted with
    /// [`Router::salt_block_hashes`]).
    pub hashes: Vec<u64>,
    /// The prompt's length in tokens (`None`: `hashes.len() × block_size`).
    pub prompt_tokens: Option<usize>,
    /// The `hash` policy's key.
    pub key: Option<Key<'a>>,
    /// The dedicated endpoint, if any.
    pub endpoint: Option<&'a str>,
    /// Workers not to choose (e.g. already tried).
    pub exclude: &'a [&'a str],
    /// The time, in seconds.
    pub now: f64,
}

/// Distinct routers get distinct ids, so a decision is only accepted by its own router.
static NEXT_ROUTER: AtomicU64 = AtomicU64::new(1);

/// The router (see the module docs).
pub struct Router {
    id: u64,
    config: Config,
    hasher: Arc<BlockHasher>,
    workers: WorkerTable,
    ring: Rendezvous,
    endpoints: HashMap<Arc<str>, Endpoint>,
    index: SharedPrefixIndex,
    tiers: Option<TierRegistry>,
    model: Option<Model>,
    rng: SplitMix64,
    bound: BoundedLoad,
    roster: Arc<[Arc<str>]>,
    decisions: u64,
    /// Index worker id → (the index's name for it, our slot), validated by pointer.
    id_cache: Vec<Option<(Arc<str>, u32)>>,
    scratch: Scratch,
}

#[derive(Default)]
struct Scratch {
    matches: Vec<(WorkerId, u32)>,
    overlap: Vec<u32>,
    credit: Vec<f64>,
    candidates: Vec<u32>,
    order: Vec<u32>,
    loads: Vec<u64>,
    shares: Vec<f64>,
    tier_overlap: Vec<(u32, f64)>,
    tier_hits: Vec<(u32, u32, f64)>,
}

impl Router {
    /// A router over `workers` (`(name, weight)` pairs).
    ///
    /// Errors (`Value`): a duplicate or empty name, a weight not finite and > 0, `block_size` 0,
    /// bad hasher options, a negative weight or TTL, `bound_c` below 1.
    pub fn new<S: AsRef<str>>(
        workers: impl IntoIterator<Item = (S, f64)>,
        config: Config,
    ) -> Result<Self> {
        config.weights.check()?;
        let bound = BoundedLoad::new(config.bound_c)?;
        if let Some(ttl) = config.ttl {
            if !(ttl.is_finite() && ttl > 0.0) {
                return value_err!("ttl must be a finite number of seconds > 0, got {ttl}");
            }
        }
        if !(config.stale_half_life.is_finite() && config.stale_half_life > 0.0) {
            return value_err!(
                "stale_half_life must be a finite number of seconds > 0, got {}",
                config.stale_half_life
            );
        }
        for (tier, w) in &config.tier_weights {
            if !(w.is_finite() && (0.0..=1.0).contains(w)) {
                return value_err!("tier weight of {tier:?} must be in [0, 1], got {w}");
            }
        }
        if config.mode == IndexMode::Approx && config.capacity_blocks == 0 {
            return value_err!("capacity_blocks must be >= 1");
        }
        let hasher = BlockHasher::new(
            config.block_size,
            config.profile,
            config.hash_options.clone(),
        )?;
        let model = match config.mode {
            IndexMode::Approx => {
                let model = Model::new(config.capacity_blocks, config.ttl);
                model.new_cache()?; // checks the capacity
                Some(model)
            }
            IndexMode::Events => None,
        };
        let mut router = Router {
            id: NEXT_ROUTER.fetch_add(1, Ordering::Relaxed),
            rng: SplitMix64(config.seed),
            config,
            hasher: Arc::new(hasher),
            workers: WorkerTable::default(),
            ring: Rendezvous::new(std::iter::empty::<(&str, f64)>())?,
            endpoints: HashMap::new(),
            index: Arc::new(RwLock::new(PrefixIndex::new(None)?)),
            tiers: None,
            model,
            bound,
            roster: Arc::from(Vec::new()),
            decisions: 0,
            id_cache: Vec::new(),
            scratch: Scratch::default(),
        };
        for (name, weight) in workers {
            router.add_worker(name.as_ref(), weight)?;
        }
        Ok(router)
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The shared prefix index (approx: the router's model, read it only; events: feed it).
    pub fn index(&self) -> &SharedPrefixIndex {
        &self.index
    }

    /// The worker table.
    pub fn workers(&self) -> &WorkerTable {
        &self.workers
    }

    /// The endpoints.
    pub fn endpoints(&self) -> impl Iterator<Item = &Endpoint> + '_ {
        self.endpoints.values()
    }

    /// An event applier (rehash or direct `mode`) feeding the router's index with the router's
    /// block size, profile and vLLM seed; the router reads the tiers it creates. Events mode only.
    pub fn new_event_applier(&mut self, mode: Mode) -> Result<Applier> {
        if self.config.mode != IndexMode::Events {
            return value_err!("an event applier needs index='events'");
        }
        let applier = Applier::new(
            self.index.clone(),
            crate::events::Config {
                mode,
                block_size: self.config.block_size,
                profile: self.config.profile,
                seed: self.config.hash_options.seed.clone(),
                group_idx: 0,
            },
        )?;
        self.tiers = Some(applier.tier_registry());
        Ok(applier)
    }

    // ---- membership -------------------------------------------------------------------------

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
        let _ = self.index.write().remove_worker(name);
        if let Some(tiers) = &self.tiers {
            for (_, index) in tiers.read().iter() {
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

    // ---- routing ----------------------------------------------------------------------------

    /// The hasher for requests of `endpoint` (the router's own without one).
    pub fn hasher_for(&self, endpoint: Option<&str>) -> Result<Arc<BlockHasher>> {
        match endpoint {
            None => Ok(self.hasher.clone()),
            Some(id) => Ok(self.endpoint(id)?.hasher.clone()),
        }
    }

    /// Salts given block hashes for `endpoint` (see [`endpoints`]); no-op without one.
    pub fn salt_block_hashes(&self, endpoint: Option<&str>, hashes: &mut [u64]) -> Result<()> {
        if let Some(id) = endpoint {
            self.endpoint(id)?.salt_block_hashes(hashes);
        }
        Ok(())
    }

    /// Hashes `tokens` for `endpoint` and routes them (a convenience over
    /// [`Router::hasher_for`] + [`Router::route`]).
    pub fn route_tokens<T: TokenId>(
        &mut self,
        tokens: &[T],
        key: Option<Key<'_>>,
        endpoint: Option<&str>,
        now: f64,
    ) -> Result<Decision> {
        let hasher = self.hasher_for(endpoint)?;
        let mut hashes = Vec::new();
        hasher.hash_into(tokens, &ChainState::Root, &[], &mut hashes)?;
        self.route(RouteRequest {
            hashes,
            prompt_tokens: Some(tokens.len()),
            key,
            endpoint,
            exclude: &[],
            now,
        })
    }

    /// Routes one request: match → score → pick (→ record, in approx mode).
    pub fn route(&mut self, req: RouteRequest<'_>) -> Result<Decision> {
        check_finite(req.now, "now")?;
        let bs = self.config.block_size;
        let prompt_tokens = match req.prompt_tokens {
            Some(t) => {
                if t / bs != req.hashes.len() {
                    return value_err!(
                        "{} block hashes given for a prompt of {t} tokens (blocks of {bs})",
                        req.hashes.len()
                    );
                }
                t
            }
            None => req.hashes.len().saturating_mul(bs),
        };
        let endpoint_id = match req.endpoint {
            Some(id) => Some(self.endpoint(id)?.id.clone()),
            None => None,
        };
        // Candidates: healthy, in the pool, not excluded (ascending slots).
        let mut candidates = std::mem::take(&mut self.scratch.candidates);
        candidates.clear();
        match endpoint_id.as_ref().and_then(|e| self.endpoints.get(e)) {
            Some(ep) => candidates.extend_from_slice(&ep.pool),
            None => candidates.extend(
                self.workers
                    .iter()
                    .enumerate()
                    .filter(|(_, w)| w.healthy)
                    .map(|(s, _)| s as u32),
            ),
        }
        for name in req.exclude {
            let slot = match self.workers.require(name) {
                Ok(s) => s,
                Err(e) => {
                    self.scratch.candidates = candidates;
                    return Err(e);
                }
            };
            candidates.retain(|&c| c != slot);
        }
        if candidates.is_empty() {
            self.scratch.candidates = candidates;
            let healthy = self.workers.iter().filter(|w| w.healthy).count();
            return value_err!(
                "no healthy worker to route to ({} workers, {healthy} healthy{}{})",
                self.workers.len(),
                endpoint_id
                    .as_ref()
                    .map_or(String::new(), |e| format!(", endpoint {e:?}")),
                if req.exclude.is_empty() {
                    String::new()
                } else {
                    format!(", {} excluded", req.exclude.len())
                }
            );
        }

        // Match: one index walk (after dropping blocks idle past the TTL).
        let result = self.route_candidates(&req, &candidates, prompt_tokens, endpoint_id);
        self.scratch.candidates = candidates;
        result
    }

    fn route_candidates(
        &mut self,
        req: &RouteRequest<'_>,
        candidates: &[u32],
        prompt_tokens: usize,
        endpoint_id: Option<Arc<str>>,
    ) -> Result<Decision> {
        let now = req.now;
        let mut index = self.index.write();
        if let Some(model) = self.model.as_mut() {
            for w in self.workers.iter_mut() {
                model.expire_idle(w, &mut index, now);
            }
        }
        let n = self.workers.len();
        self.scratch.overlap.clear();
        self.scratch.overlap.resize(n, 0);
        index.match_into(&req.hashes, &mut self.scratch.matches);
        for &(id, blocks) in &self.scratch.matches {
            if let Some(slot) = slot_of_index_worker(&mut self.id_cache, &self.workers, &index, id)
            {
                if let Some(o) = self.scratch.overlap.get_mut(slot as usize) {
                    *o = blocks;
                }
            }
        }
        // Credit: freshness × (GPU overlap, or the tiered sum in events mode).
        self.scratch.credit.clear();
        self.scratch
            .credit
            .extend(self.scratch.overlap.iter().map(|&o| f64::from(o)));
        if let Some(tiers) = &self.tiers {
            add_tier_credit(
                tiers,
                &self.config.tier_weights,
                &self.workers,
                &req.hashes,
                &mut self.scratch,
            );
        }
        let half_life = self.config.stale_half_life;
        for (credit, w) in self.scratch.credit.iter_mut().zip(self.workers.iter()) {
            if !matches!(w.freshness, Freshness::Fresh) {
                *credit *= w.freshness_at(now, half_life);
            }
        }

        // Score and pick.
        let first_block = req.hashes.first().map(|&h| Key::Int(h));
        let endpoint_key = endpoint_id.as_deref().map(|e| Key::Bytes(e.as_bytes()));
        let hash_key = req
            .key
            .or(endpoint_key)
            .or(first_block)
            .unwrap_or(Key::Int(0));
        let tie_key = first_block
            .or(req.key)
            .or(endpoint_key)
            .unwrap_or(Key::Int(0));
        let saved_rng = self.rng.clone();
        let saved_rr: Vec<f64> = if self.config.policy == Policy::RoundRobin {
            self.workers.iter().map(|w| w.rr_current).collect()
        } else {
            Vec::new()
        };
        let request = policy::Request {
            candidates,
            prompt_blocks: req.hashes.len(),
            credit: &self.scratch.credit,
            hash_key,
            tie_key,
        };
        let mut state = policy::PickState {
            rng: &mut self.rng,
            ring: &self.ring,
            bound: self.bound,
            weights: self.config.weights,
            order: &mut self.scratch.order,
            loads: &mut self.scratch.loads,
            shares: &mut self.scratch.shares,
        };
        let pick = policy::pick(self.config.policy, &mut self.workers, &request, &mut state)?;
        let slot = pick.slot;
        let cached_blocks = self
            .scratch
            .overlap
            .get(slot as usize)
            .copied()
            .unwrap_or(0) as usize;

        // Record (approx): the chosen worker will hold the prompt.
        let Some(worker) = self.workers.get_mut(slot) else {
            return value_err!("no healthy worker to route to");
        };
        let mut hashes = Vec::new();
        if let Some(model) = self.model.as_mut() {
            let partition = reserved_partition(&self.endpoints, endpoint_id.as_ref());
            if let Err(e) = model.record(worker, &mut index, &req.hashes, partition, now) {
                self.rng = saved_rng;
                for (w, rr) in self.workers.iter_mut().zip(saved_rr) {
                    w.rr_current = rr;
                }
                return Err(e);
            }
            hashes = req.hashes.clone();
        }
        drop(index);
        self.decisions += 1;
        let (name, uid) = (worker.name.clone(), worker.uid);
        Ok(Decision::new(
            self.decisions,
            self.id,
            name,
            uid,
            slot,
            self.config.policy,
            pick.reason,
            self.config.block_size,
            prompt_tokens,
            req.hashes.len(),
            cached_blocks,
            endpoint_id,
            hashes,
            self.roster.clone(),
            pick.scores,
        ))
    }

    // ---- lifecycle --------------------------------------------------------------------------

    fn own(&self, d: &Decision) -> Result<()> {
        if d.router != self.id {
            return value_err!("decision {} was made by another router", d.id);
        }
        Ok(())
    }

    /// The decision's worker, if it is still in the router.
    fn worker_of(&mut self, d: &Decision) -> Option<&mut Worker> {
        let slot = self.workers.slot_of_uid(d.worker_uid, d.slot_hint)?;
        self.workers.get_mut(slot)
    }

    /// The request starts on its worker: adds it to the worker's load.
    ///
    /// Errors: another router's decision or one already begun (`Value`); its worker was removed
    /// since (`Key`).
    pub fn begin(&mut self, d: &Decision) -> Result<()> {
        self.own(d)?;
        if d.stage() != Stage::Routed {
            return value_err!("decision {} was already begun", d.id);
        }
        let Some(w) = self.worker_of(d) else {
            return key_err!("worker {:?} of decision {} was removed", d.worker, d.id);
        };
        w.active += 1;
        w.prefill_blocks += d.prefill_blocks() as u64;
        w.decode_blocks += d.prompt_blocks as u64;
        d.set_begun();
        Ok(())
    }

    /// The request's prefill is done (first token): its blocks leave the worker's prefill queue.
    pub fn prefilled(&mut self, d: &Decision) -> Result<()> {
        self.own(d)?;
        if d.stage() != Stage::Active {
            return value_err!("decision {} is not active (begin it first)", d.id);
        }
        if d.is_prefilled() {
            return value_err!("decision {} was already marked prefilled", d.id);
        }
        if let Some(w) = self.worker_of(d) {
            w.prefill_blocks = w.prefill_blocks.saturating_sub(d.prefill_blocks() as u64);
        }
        d.set_prefilled();
        Ok(())
    }

    /// The request ended: takes it off its worker's load; in approx mode the prompt's blocks are
    /// refreshed on the worker at `now` (the engine frees them then).
    pub fn finish(&mut self, d: &Decision, now: f64) -> Result<()> {
        self.own(d)?;
        check_finite(now, "now")?;
        match d.stage() {
            Stage::Active => {}
            Stage::Routed => return value_err!("decision {} was not begun", d.id),
            Stage::Finished => return value_err!("decision {} was already finished", d.id),
        }
        let prefill = if d.is_prefilled() {
            0
        } else {
            d.prefill_blocks() as u64
        };
        d.set_finished();
        let index = self.index.clone();
        let partition = self.partition_of(d);
        let Some(slot) = self.workers.slot_of_uid(d.worker_uid, d.slot_hint) else {
            return Ok(());
        };
        let Some(w) = self.workers.get_mut(slot) else {
            return Ok(());
        };
        w.active = w.active.saturating_sub(1);
        w.prefill_blocks = w.prefill_blocks.saturating_sub(prefill);
        w.decode_blocks = w.decode_blocks.saturating_sub(d.prompt_blocks as u64);
        if let Some(model) = self.model.as_mut() {
            let _ = model.record(w, &mut index.write(), &d.hashes, partition.as_deref(), now);
        }
        Ok(())
    }

    /// The engine reported `cached_tokens` of the prompt served from its cache (OpenAI
    /// `usage.prompt_tokens_details.cached_tokens`). Approx mode: fewer blocks than predicted
    /// means the worker lacked the blocks from there on — they (and what hangs below them) are
    /// dropped from the model, then the prompt the request computed is recorded. Events mode:
    /// validated only (the events are authoritative). At most once per decision.
    pub fn observe(&mut self, d: &Decision, cached_tokens: usize, now: f64) -> Result<()> {
        self.own(d)?;
        check_finite(now, "now")?;
        if cached_tokens > d.prompt_tokens {
            return value_err!(
                "cached_tokens = {cached_tokens} exceeds the prompt's {} tokens",
                d.prompt_tokens
            );
        }
        if d.is_observed() {
            return value_err!("decision {} was already observed", d.id);
        }
        d.set_observed();
        let observed = (cached_tokens / d.block_size).min(d.prompt_blocks);
        let index = self.index.clone();
        let partition = self.partition_of(d);
        let Some(slot) = self.workers.slot_of_uid(d.worker_uid, d.slot_hint) else {
            return Ok(());
        };
        let (Some(model), Some(w)) = (self.model.as_mut(), self.workers.get_mut(slot)) else {
            return Ok(());
        };
        let mut index = index.write();
        if observed < d.cached_blocks {
            model.forget_from(w, &mut index, &d.hashes, observed);
        }
        let _ = model.record(w, &mut index, &d.hashes, partition.as_deref(), now);
        Ok(())
    }

    /// The cache partition a decision's blocks go to (its endpoint's, when reserved).
    fn partition_of(&self, d: &Decision) -> Option<Arc<str>> {
        reserved_partition(&self.endpoints, d.endpoint.as_ref()).map(Arc::from)
    }

    /// Checks the approx model's invariant (index = caches) for tests; `Err` describes a mismatch.
    #[doc(hidden)]
    pub fn check_model(&self) -> std::result::Result<(), String> {
        let index = self.index.read();
        index.check_invariants()?;
        for w in self.workers.iter() {
            if let (Some(cache), Some(_)) = (&w.cache, w.index_id) {
                let held = index.num_blocks(&w.name).unwrap_or(0) as usize;
                if held != cache.len() {
                    return Err(format!(
                        "worker {:?}: index holds {held} blocks, cache {}",
                        w.name,
                        cache.len()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The cache partition of `endpoint`'s blocks: its id, when it reserves blocks.
fn reserved_partition<'a>(
    endpoints: &HashMap<Arc<str>, Endpoint>,
    endpoint: Option<&'a Arc<str>>,
) -> Option<&'a str> {
    endpoint
        .filter(|e| {
            endpoints
                .get(*e)
                .is_some_and(|ep| ep.reserved_blocks.is_some())
        })
        .map(|e| &**e)
}

/// Our slot for index worker `id`, through a cache validated by the index's own name pointer.
fn slot_of_index_worker(
    cache: &mut Vec<Option<(Arc<str>, u32)>>,
    workers: &WorkerTable,
    index: &PrefixIndex,
    id: WorkerId,
) -> Option<u32> {
    let name = index.worker_name(id)?;
    let at = id as usize;
    if let Some(Some((cached, slot))) = cache.get(at) {
        if std::ptr::eq(cached.as_ptr(), name.as_ptr()) && cached.len() == name.len() {
            return Some(*slot);
        }
    }
    let slot = workers.slot(name)?;
    if cache.len() <= at {
        cache.resize(at + 1, None);
    }
    if let Some(entry) = cache.get_mut(at) {
        *entry = index.worker_name_arc(id).map(|arc| (arc, slot));
    }
    Some(slot)
}

/// Adds, per worker, the credit of blocks found only in slower tiers (see the module docs).
fn add_tier_credit(
    tiers: &TierRegistry,
    weights: &[(String, f64)],
    workers: &WorkerTable,
    query: &[u64],
    scratch: &mut Scratch,
) {
    let tiers = tiers.read();
    if tiers.is_empty() || query.is_empty() {
        return;
    }
    // (slot, overlap, weight) of every tier holding part of the prefix on a worker.
    let hits = &mut scratch.tier_hits;
    hits.clear();
    for (name, index) in tiers.iter() {
        let weight = weights
            .iter()
            .find(|(t, _)| **t == **name)
            .map_or(OTHER_TIER_WEIGHT, |&(_, w)| w);
        let index = index.read();
        index.match_into(query, &mut scratch.matches);
        for &(id, blocks) in &scratch.matches {
            if let Some(slot) = index.worker_name(id).and_then(|n| workers.slot(n)) {
                hits.push((slot, blocks, weight));
            }
        }
    }
    hits.sort_unstable_by_key(|h| h.0);
    for worker_hits in hits.chunk_by(|a, b| a.0 == b.0) {
        let Some(&(slot, _, _)) = worker_hits.first() else {
            continue;
        };
        let gpu = scratch.overlap.get(slot as usize).copied().unwrap_or(0);
        let per_tier = &mut scratch.tier_overlap;
        per_tier.clear();
        per_tier.extend(
            worker_hits
                .iter()
                .map(|&(_, blocks, weight)| (blocks, weight)),
        );
        per_tier.push((gpu, 1.0));
        if let Some(c) = scratch.credit.get_mut(slot as usize) {
            *c = tiered_credit(per_tier);
        }
    }
}

/// `Σ_{i < max o_t} max{ w_t : o_t > i }` for `(o_t, w_t)` pairs (reordered in place).
fn tiered_credit(sorted: &mut [(u32, f64)]) -> f64 {
    // Descending overlap: walking down, the best weight among tiers reaching past each block.
    sorted.sort_unstable_by_key(|t| std::cmp::Reverse(t.0));
    let mut credit = 0.0;
    let mut best = 0.0f64;
    for (k, &(o, w)) in sorted.iter().enumerate() {
        best = best.max(w);
        let below = sorted.get(k + 1).map_or(0, |&(n, _)| n);
        credit += f64::from(o - below.min(o)) * best;
    }
    credit
}

#[cfg(test)]
mod tests;
