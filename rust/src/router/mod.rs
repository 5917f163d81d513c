//! The router: one object that takes a request and answers which worker, why, and how much of the
//! prompt is expected to be cached there.
//!
//! # Route, step by step
//! The prompt's tokens are hashed into chained block hashes by the router's [`BlockHasher`] (or
//! the endpoint's salted one) before the router's lock is taken ([`Router::hasher_for`]); then
//! [`Router::route`] (in `route.rs`) runs five steps:
//! 1. **Check** the request (`now`, lengths, endpoint and excluded names) and gather the
//!    candidates: healthy, in the endpoint's pool, not excluded.
//! 2. **Match**: blocks idle past the TTL leave the approx model, then one walk of the
//!    [`PrefixIndex`] gives every worker's cached overlap, turned into credit (tiers, freshness).
//! 3. **Pick** ([`policy`]): a pure function of the router's state and the request; it returns
//!    the chosen worker, the scores compared (the `kv_aware` cost is `policy::kv_cost`) and the
//!    state change the choice implies (the generator's next state, the round-robin step).
//! 4. **Validate** (approx mode, [`approx`]): the prompt's chain must agree with the index; this
//!    stores it there or fails changing nothing. It is the last step that can fail.
//! 5. **Commit**: the pick's state change, the chosen worker's modelled cache, the decision count;
//!    the [`Decision`] is returned.
//!
//! [`Router::route_pd`] (in `pd.rs`) runs the same steps for a prefill/decode pair: worker roles,
//! the decode worker's choice and conditional disaggregation are described in [`pd`].
//! Membership (workers, roles, health, endpoints) is in `membership.rs`; load accounting
//! (`begin`, `prefilled`, `finish`, `observe`) here.
//!
//! # Guarantees
//! - **Candidates.** Only healthy workers are ever chosen; with `endpoint`, only members of its
//!   pool ([`endpoints`]); never a worker listed in `exclude`; for a phase, only workers whose
//!   role does it (a whole request: workers that decode). No candidate → [`Error::NoWorker`]
//!   (`kvroute.NoWorkerError`, a `ValueError`), and nothing else raises it.
//! - **Whole requests without tokens.** A request with no block hashes (no tokens, or less than
//!   one block) has no prefix to match; every policy routes it (`hash` by its key or endpoint,
//!   `kv_aware` by load alone).
//! - **Index modes.** `Approx`: the router's own model of every worker's cache ([`approx`]), kept
//!   in the index it exposes (read it, do not write it). `Events`: the index is fed from outside
//!   (engine KV events through an [`crate::events::Applier`] built by
//!   [`Router::new_event_applier`], or a simulator); the router only reads it, and scores blocks
//!   found only in a slower tier (the applier's tier indexes: `"CPU"`, disk, …) at that tier's
//!   weight. In both modes a worker's overlap credit is scaled by its freshness
//!   ([`workers`]), so a worker whose event stream is stale is trusted less and less.
//! - **Whole engine blocks.** An engine caches and serves whole blocks of its own size `E`; the
//!   router's blocks may be finer (rehash mode with `R | E`, a fleet of mixed engines). Once a
//!   worker's `E` is known — from its KV events through [`Router::new_event_applier`]'s applier,
//!   or [`Router::set_engine_block_size`] — its overlap (GPU, every tier, in flight) counts only
//!   the whole engine blocks within it, and a decision's cached blocks are capped at the last
//!   whole engine block before the prompt's last token (vLLM, SGLang).
//! - **Tier credit.** With per-tier overlaps `o_t` (leading blocks held in tier `t`, GPU included
//!   with weight 1) the credit is `Σ_{i < max o_t} max{ w_t : o_t > i }`: each block counts at the
//!   weight of the best tier holding it, as far as some tier holds the whole prefix.
//! - **Load accounting** ([`workers`]): `begin` adds a decision's request to its worker's
//!   counters, `prefilled` takes its prefill blocks off the queue, `finish` takes the rest off.
//!   In events mode `begin` also records the prompt among the worker's in-flight blocks and
//!   `finish` releases it ([`inflight`]), so a request routed while an earlier one with the same
//!   prefix is still queued or prefilling there is credited with that prefix (the engine
//!   announces blocks only once computed): a decision's `inflight_blocks`, beside its
//!   `cached_blocks` (the index's), and its prefill blocks are what is left after both.
//!   Beginning twice, finishing twice or before beginning, or passing another router's decision
//!   is an error that changes nothing. Counters are exact: every change happens under the
//!   router's lock (`&mut self`).
//! - **Withdrawing** ([`Router::withdraw`], `withdraw.rs`): a decision whose request never ran
//!   (shed after routing, or served by another worker) is taken back — its load if begun, and in
//!   approx mode the blocks only its route recorded — exactly and at most once.
//! - **Errors change nothing** (except that blocks idle past the TTL expire as time passes):
//!   unknown worker / endpoint names are [`Error::Key`], bad values [`Error::Value`]. A pick
//!   changes nothing by construction, so a failed route leaves the generator and the
//!   round-robin state where they were.
//! - **Scale.** Building a router over n workers is O(n); adding, removing or changing the
//!   health of a worker is O(1) amortised in n, plus O(pool) per endpoint ([`workers`],
//!   [`endpoints`]); adding an endpoint draws its pool from every worker once, O(n). A route is
//!   O(n): it scores every candidate.
//! - **Time.** Every call that depends on time takes `now` in seconds (any clock, e.g. virtual
//!   time in a simulator, but one clock for one router): the TTL of idle blocks in approx mode and
//!   the decay of stale workers use it.
//! - **Defaults** live in [`Config::default`] (and the `Default`s it names) only; the bindings
//!   pass what the caller did not give as "unset".
//!
//! # Rust use
//! Build with [`Router::new`] from a [`Config`]; hash with `router.hasher_for(endpoint)?` (an
//! `Arc<BlockHasher>`, so hashing can run without the router's lock) or give block hashes
//! directly (salted for an endpoint by [`Router::salt_block_hashes`]); then
//! `router.route(RouteRequest { .. })`, `begin`, `prefilled`, `finish`, `observe` with the
//! returned [`Decision`]. Share a router between threads behind a `Mutex`.

mod approx;
mod decision;
mod endpoints;
mod inflight;
mod membership;
mod pd;
mod policy;
mod route;
mod snapshot;
mod sync;
mod withdraw;
mod workers;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::RwLock;

use crate::blocks::{BlockHasher, Options, Profile};
use crate::error::{Error, Result};
use crate::events::{Applier, EngineBlockSizes, Mode, TierRegistry};
use crate::hashing::{BoundedLoad, Key};
use crate::index::{PrefixIndex, SharedPrefixIndex, WorkerId};
use crate::{key_err, value_err};

pub use decision::{Decision, Half, Stage};
pub use endpoints::{Endpoint, EndpointSpec};
pub use pd::{PdConfig, PdDecision, PdReason, Phase, Role};
pub use policy::{CostWeights, Policy, Reason, SplitMix64};
pub use route::{prepared_then_locked, prompt_hashes};
pub use sync::ApplyStats;
pub use workers::{Freshness, Load, Worker, WorkerTable};

use approx::Model;
use inflight::InFlight;
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
    /// Events mode: how the applier of [`Router::new_event_applier`] keys engine blocks
    /// (default: the events module's, [`crate::events::Config`]).
    pub event_mode: Mode,
    /// Keep an outbox of updates for other replicas: load changes and, in approx mode, model
    /// changes ([`sync`]; default off).
    pub updates: bool,
    /// Prefill/decode pairs: when [`Router::route_pd`] runs the prefill on the decode worker
    /// ([`PdConfig`]).
    pub pd: PdConfig,
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
            event_mode: crate::events::Config::default().mode,
            updates: false,
            pd: PdConfig::default(),
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
    endpoints: HashMap<Arc<str>, Endpoint>,
    index: SharedPrefixIndex,
    tiers: Option<TierRegistry>,
    /// Each worker's engine block size, written by the event appliers and
    /// [`Router::set_engine_block_size`]; copied to the workers when its version moves.
    engine_sizes: Arc<EngineBlockSizes>,
    engine_sizes_seen: u64,
    model: Option<Model>,
    /// Events mode: the prompt blocks of the requests begun and not finished, per worker.
    inflight: Option<InFlight>,
    rng: SplitMix64,
    bound: BoundedLoad,
    /// Worker names by slot, shared with decisions (for their scores); rebuilt at the next
    /// route once `roster_stale`.
    roster: Arc<[Option<Arc<str>>]>,
    roster_stale: bool,
    decisions: u64,
    /// Index worker id → (the index's name for it, our slot), validated by pointer.
    id_cache: Vec<Option<(Arc<str>, u32)>>,
    /// The same for the in-flight index.
    inflight_ids: Vec<Option<(Arc<str>, u32)>>,
    scratch: Scratch,
    /// Model updates for other replicas ([`sync`]).
    outbox: sync::Outbox,
}

#[derive(Default)]
struct Scratch {
    matches: Vec<(WorkerId, u32)>,
    overlap: Vec<u32>,
    /// Events mode: each slot's in-flight prefix of the prompt.
    inflight: Vec<u32>,
    credit: Vec<f64>,
    candidates: Vec<u32>,
    /// `route_pd`: the decode candidates (`candidates` holds the prefill ones).
    decoders: Vec<u32>,
    /// Workers whose reservations dropped in a pool update.
    freed: Vec<u32>,
    pick: policy::Buffers,
    tier_overlap: Vec<(u32, f64)>,
    tier_hits: Vec<(u32, u32, f64)>,
    /// `apply_updates`: the chain of a record.
    chain: Vec<u64>,
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
        config.pd.check()?;
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
        let inflight = match config.mode {
            IndexMode::Approx => None, // the model records each prompt where it is routed
            IndexMode::Events => Some(InFlight::new()?),
        };
        let mut router = Router {
            id: NEXT_ROUTER.fetch_add(1, Ordering::Relaxed),
            rng: SplitMix64(config.seed),
            outbox: sync::Outbox::new(config.updates),
            config,
            hasher: Arc::new(hasher),
            workers: WorkerTable::default(),
            endpoints: HashMap::new(),
            index: Arc::new(RwLock::new(PrefixIndex::new(None)?)),
            tiers: None,
            engine_sizes: Arc::default(),
            engine_sizes_seen: 0,
            model,
            inflight,
            bound,
            roster: Arc::from(Vec::new()),
            roster_stale: false,
            decisions: 0,
            id_cache: Vec::new(),
            inflight_ids: Vec::new(),
            scratch: Scratch::default(),
        };
        let workers = workers.into_iter();
        router.workers.reserve(workers.size_hint().0);
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

    /// An event applier (in [`Config::event_mode`]) feeding the router's index with the
    /// router's block size, profile and vLLM seed; the router reads the tiers it creates. Events
    /// mode only.
    pub fn new_event_applier(&mut self) -> Result<Applier> {
        if self.config.mode != IndexMode::Events {
            return value_err!("an event applier needs index='events'");
        }
        let mut applier = Applier::new(
            self.index.clone(),
            crate::events::Config {
                mode: self.config.event_mode,
                block_size: self.config.block_size,
                profile: self.config.profile,
                seed: self.config.hash_options.seed.clone(),
                group_idx: 0,
            },
        )?;
        self.tiers = Some(applier.tier_registry());
        applier.share_engine_block_sizes(self.engine_sizes.clone());
        Ok(applier)
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
        let slot = self
            .workers
            .slot_of_uid(&d.worker, d.worker_uid, d.slot_hint)?;
        self.workers.get_mut(slot)
    }

    /// The request starts on its worker: adds it to the worker's load. Returns the blocks the
    /// worker's requests had left to prefill just before (`prefill_blocks` of its load: the queue
    /// ahead of this request).
    ///
    /// Errors: another router's decision or one already begun (`Value`); its worker was removed
    /// since (`Key`).
    pub fn begin(&mut self, d: &Decision) -> Result<u64> {
        self.own(d)?;
        match d.stage() {
            Stage::Routed => {}
            Stage::Withdrawn => return value_err!("decision {} was withdrawn", d.id),
            _ => return value_err!("decision {} was already begun", d.id),
        }
        let Some(slot) = self
            .workers
            .slot_of_uid(&d.worker, d.worker_uid, d.slot_hint)
        else {
            return key_err!("worker {:?} of decision {} was removed", d.worker, d.id);
        };
        let Some(w) = self.workers.get_mut(slot) else {
            return key_err!("worker {:?} of decision {} was removed", d.worker, d.id);
        };
        let ahead = w.prefill_blocks;
        let (prefill, prompt) = (d.prefill_blocks() as i64, d.prompt_blocks as i64);
        let delta = [1, 1, prefill, prompt, prefill];
        w.add_load(delta);
        if let Some(inflight) = self.inflight.as_mut() {
            // A chain that contradicts the in-flight blocks (given block hashes reusing a hash
            // under another parent) is simply not tracked: the request then gives no in-flight
            // credit to later ones, and `finish` releases nothing for it.
            if inflight.add(&w.name, d.id, &d.hashes).is_ok() {
                d.set_in_flight();
            }
        }
        d.set_begun();
        self.outbox.load(&d.worker, delta);
        Ok(ahead)
    }

    /// The engine's own figures for worker `name` (e.g. scraped from its `/metrics`): its
    /// total load, this router's requests included. What this router does not account for
    /// itself at this moment is kept as the others' load ([`Worker::others`]) until the next
    /// report, so between reports the worker's load is that baseline plus this router's own
    /// changes. A figure left `None` keeps its previous baseline.
    pub fn set_load(
        &mut self,
        name: &str,
        active: Option<u64>,
        queued: Option<u64>,
        prefill_blocks: Option<u64>,
        decode_blocks: Option<u64>,
    ) -> Result<()> {
        let w = self.workers.named_mut(name)?;
        if let Some(a) = active {
            w.others.active = a.saturating_sub(w.active);
        }
        if let Some(q) = queued {
            w.others.queued = q.saturating_sub(w.queued);
        }
        if let Some(p) = prefill_blocks {
            w.others.prefill_blocks = p.saturating_sub(w.prefill_blocks);
        }
        if let Some(d) = decode_blocks {
            w.others.decode_blocks = d.saturating_sub(w.decode_blocks);
        }
        Ok(())
    }

    /// Worker `name`'s engine caches blocks of `tokens` tokens (e.g. read from its
    /// `cache_config_info` metric): from the next route on, its matches count whole engine
    /// blocks only. An event applier of this router sets it from each engine's stores.
    ///
    /// Errors: an unknown worker (`Key`), `tokens` 0 or over `u32::MAX` (`Value`).
    pub fn set_engine_block_size(&mut self, name: &str, tokens: u64) -> Result<()> {
        self.workers.require(name)?;
        match u32::try_from(tokens) {
            Ok(t) if t > 0 => {
                self.engine_sizes.set(name, t);
                Ok(())
            }
            _ => value_err!(
                "engine block size of worker {name:?} must be 1..=4294967295 tokens, got {tokens}"
            ),
        }
    }

    /// Worker `name`'s engine block size (tokens), once known.
    ///
    /// Errors: an unknown worker (`Key`).
    pub fn engine_block_size(&self, name: &str) -> Result<Option<u32>> {
        self.workers.require(name)?;
        Ok(self.engine_sizes.get(name))
    }

    /// Copies the engine block sizes to the workers when they changed since the last copy.
    pub(super) fn sync_engine_block_sizes(&mut self) {
        let version = self.engine_sizes.version();
        if version == self.engine_sizes_seen {
            return;
        }
        for w in self.workers.iter_mut() {
            w.engine_block_size = self.engine_sizes.get(&w.name);
        }
        self.engine_sizes_seen = version;
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
        let delta = [0, -1, -(d.prefill_blocks() as i64), 0, 0];
        if let Some(w) = self.worker_of(d) {
            w.add_load(delta);
        }
        d.set_prefilled();
        self.outbox.load(&d.worker, delta);
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
            Stage::Withdrawn => return value_err!("decision {} was withdrawn", d.id),
        }
        // A prefilled request has left the prefill queue already.
        let (prefill, queued) = if d.is_prefilled() {
            (0, 0)
        } else {
            (d.prefill_blocks() as i64, 1)
        };
        d.set_finished();
        let written = d.prefill_blocks() as i64;
        let delta = [-1, -queued, -prefill, -(d.prompt_blocks as i64), -written];
        self.outbox.load(&d.worker, delta);
        let index = self.index.clone();
        let partition = self.partition_of(d);
        let Some(slot) = self
            .workers
            .slot_of_uid(&d.worker, d.worker_uid, d.slot_hint)
        else {
            return Ok(());
        };
        let Some(w) = self.workers.get_mut(slot) else {
            return Ok(());
        };
        w.add_load(delta);
        if let (Some(inflight), true) = (self.inflight.as_mut(), d.is_in_flight()) {
            inflight.release(&w.name, d.id);
        }
        if let Some(model) = self.model.as_mut() {
            // Other replicas touch the prompt too: anchored at what the worker still holds of
            // it here (all of it, unless part was evicted since the route).
            let known = w.cache.as_ref().map_or(0, |c| c.peek_prefix(&d.hashes));
            // Harmless when it fails: the chain was valid at route time and fails only if given
            // block hashes were since stored under another parent; the model then simply does
            // not refresh these blocks (and changed nothing).
            let _ = model.record(w, &mut index.write(), &d.hashes, partition.as_deref(), now);
            self.outbox
                .record(&w.name, partition.as_deref(), &d.hashes, known);
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
        if d.stage() == Stage::Withdrawn {
            return value_err!("decision {} was withdrawn", d.id);
        }
        d.set_observed();
        let observed = (cached_tokens / d.block_size).min(d.prompt_blocks);
        let index = self.index.clone();
        let partition = self.partition_of(d);
        let Some(slot) = self
            .workers
            .slot_of_uid(&d.worker, d.worker_uid, d.slot_hint)
        else {
            return Ok(());
        };
        let (Some(model), Some(w)) = (self.model.as_mut(), self.workers.get_mut(slot)) else {
            return Ok(());
        };
        let mut index = index.write();
        if observed < d.cached_blocks {
            model.forget_from(w, &mut index, &d.hashes, observed);
            if let Some(&first) = d.hashes.get(observed) {
                self.outbox.forget(&w.name, first);
            }
        }
        let known = w.cache.as_ref().map_or(0, |c| c.peek_prefix(&d.hashes));
        // Harmless when it fails, as in `finish`: the prompt is then not re-recorded.
        let _ = model.record(w, &mut index, &d.hashes, partition.as_deref(), now);
        self.outbox
            .record(&w.name, partition.as_deref(), &d.hashes, known);
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
                // A worker the index does not know holds nothing there.
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

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_capacity;
#[cfg(test)]
mod tests_draws;
#[cfg(test)]
mod tests_engine_blocks;
#[cfg(test)]
mod tests_model;
#[cfg(test)]
mod tests_mutants;
#[cfg(test)]
mod tests_names;
#[cfg(test)]
mod tests_policies;
#[cfg(test)]
mod tests_sync;
#[cfg(test)]
mod tests_ties;
