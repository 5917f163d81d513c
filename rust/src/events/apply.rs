//! Applying decoded KV events to prefix indexes (see the module docs of [`crate::events`]).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use hashbrown::{Equivalent, HashMap};
use parking_lot::RwLock;

use super::decode::{Batch, Decoder, Event, EventKind};
use super::pages::Pages;
use super::sizes::EngineBlockSizes;
use crate::blocks::{BlockHasher, ChainState, Options, Profile};
use crate::error::{Error, Result};
use crate::index::{PrefixIndex, SharedPrefixIndex, WorkerId};
use crate::value_err;

/// The name of the tier the main index tracks (`medium` nil or `"GPU"`).
pub const GPU: &str = "GPU";

/// Most non-GPU tiers tracked; events naming further media are skipped (counted `unsupported`).
pub const MAX_TIERS: usize = 8;

/// The non-GPU tiers of an [`Applier`] as `(medium, index)`, in order of appearance, shared so
/// a reader (the router) can see the tiers without taking the applier's lock.
pub type TierRegistry = Arc<RwLock<Vec<(Arc<str>, SharedPrefixIndex)>>>;

/// Most distinct (salt, LoRA) hashers kept; past it the cache is emptied and rebuilt on demand.
const MAX_NAMESPACES: usize = 1024;

/// How engine block hashes become index keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Recompute the router's own block hashes from the event's `token_ids`.
    Rehash,
    /// Use the engine's block hashes as they are.
    Direct,
}

impl Mode {
    /// The mode's name as accepted by [`Mode::from_str`].
    pub fn name(self) -> &'static str {
        match self {
            Mode::Rehash => "rehash",
            Mode::Direct => "direct",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "rehash" => Ok(Mode::Rehash),
            "direct" => Ok(Mode::Direct),
            other => value_err!("mode must be 'rehash' or 'direct', got {other:?}"),
        }
    }
}

/// How an [`Applier`] turns events into index operations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Rehash (default) or direct.
    pub mode: Mode,
    /// The router's block size in tokens.
    pub block_size: usize,
    /// The router's hash profile (rehash: the hasher used; direct: documents what the engine's
    /// hashes must equal).
    pub profile: Profile,
    /// vLLM NONE_HASH seed for the `vllm` profile (`None`: vLLM's default).
    pub seed: Option<String>,
    /// The KV-cache group followed (vLLM `group_idx`; events of other groups are skipped).
    pub group_idx: i64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mode: Mode::Rehash,
            block_size: 16,
            profile: Profile::Native,
            seed: None,
            group_idx: 0,
        }
    }
}

/// Per-worker counters. Events are counted once each; `skipped_*` say why an event changed
/// nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerCounters {
    /// Payloads decoded and applied.
    pub batches: u64,
    /// Payloads refused by the decoder (they changed nothing).
    pub malformed: u64,
    /// Events in applied payloads.
    pub events: u64,
    /// `BlockStored` events.
    pub stored_events: u64,
    /// `BlockRemoved` events.
    pub removed_events: u64,
    /// `AllBlocksCleared` events.
    pub cleared_events: u64,
    /// Engine blocks of `BlockStored` events that were applied.
    pub blocks_stored: u64,
    /// Engine blocks named by `BlockRemoved` events (of the followed group).
    pub blocks_removed: u64,
    /// Stores whose parent block the worker was not known to hold.
    pub skipped_unknown_parent: u64,
    /// Stores of a partial block (fewer tokens than a router block, or tokens ≠ blocks × size).
    pub skipped_partial: u64,
    /// Stores whose engine block size is not a multiple of the router's (or, in direct mode,
    /// differs from it).
    pub skipped_block_size: u64,
    /// Stores the router cannot rehash (multimodal/embedding extra keys, lookahead tokens,
    /// token ids beyond 32 bits) or media beyond [`MAX_TIERS`].
    pub skipped_unsupported: u64,
    /// Events of another KV-cache group.
    pub skipped_other_group: u64,
    /// Events of an unknown type.
    pub skipped_unknown_type: u64,
    /// Stores the index refused (the parent was evicted by its memory budget, or inconsistent
    /// hashes).
    pub index_rejected: u64,
    /// Resets requested by the caller ([`Applier::clear_worker`]: gap, restart).
    pub resets: u64,
    /// Direct mode: root stores whose first block's hash is not the router's hash of its tokens
    /// (an engine hashing with another algorithm, seed or block size: nothing it stores can
    /// match a request). Stores with a salt, LoRA or extra keys are not compared.
    pub foreign_hashes: u64,
    /// Not a count: the engine's block size, the largest in the GPU `BlockStored` events of the
    /// followed group since the worker was last cleared ([`Applier::clear_worker`]; 0 before the
    /// first), so that a size the router cannot use can be named.
    pub engine_block_size: u64,
}

/// What one payload contained.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BatchOutcome {
    /// Number of events.
    pub events: usize,
    /// True when the batch held an `AllBlocksCleared`.
    pub cleared: bool,
    /// The batch's `ts`.
    pub ts: f64,
}

/// One worker's view of one tier's index.
#[derive(Default)]
pub(super) struct TierState {
    /// The worker's id in the tier's index and the name `Arc` the index held for it, to notice
    /// when the worker was removed from the index by someone else (ids are reused).
    pub(super) registered: Option<(WorkerId, Arc<str>)>,
    /// Rehash mode: engine hash → the last router block inside it (the parent of what follows;
    /// for the `native` profile also the chain state). 16-byte entries, the hot map.
    pub(super) links: HashMap<u64, u64>,
    /// Engine hash → the first router block inside it (what a removal drops), only for engine
    /// blocks of more than one router block (otherwise it is the `links` value).
    pub(super) firsts: HashMap<u64, u64>,
    /// Engine hash → SHA-256 chain state after its last router block (digest profiles only).
    pub(super) digests: HashMap<u64, [u8; 32]>,
    /// Engine blocks smaller than the router's that do not complete one (see `pages`).
    pub(super) pages: Pages,
}

impl TierState {
    fn forget(&mut self) {
        self.links.clear();
        self.firsts.clear();
        self.digests.clear();
        self.pages.clear();
    }
}

#[derive(Default)]
pub(super) struct WorkerState {
    pub(super) counters: WorkerCounters,
    /// Indexed like [`Applier::indexes`]: 0 = GPU.
    pub(super) tiers: Vec<TierState>,
}

#[derive(Hash, PartialEq, Eq)]
struct Namespace {
    salt: Option<Box<str>>,
    lora: Option<Box<str>>,
}

/// Borrowed form of [`Namespace`]; hashes identically (derived `Hash` over the same `str`s).
#[derive(Hash)]
struct NamespaceRef<'a> {
    salt: Option<&'a str>,
    lora: Option<&'a str>,
}

impl Equivalent<Namespace> for NamespaceRef<'_> {
    fn equivalent(&self, key: &Namespace) -> bool {
        self.salt == key.salt.as_deref() && self.lora == key.lora.as_deref()
    }
}

/// Applies engine KV-event payloads, per worker, to a shared GPU index and per-tier indexes.
pub struct Applier {
    config: Config,
    hasher: BlockHasher,
    namespaces: HashMap<Namespace, BlockHasher>,
    gpu: SharedPrefixIndex,
    /// `(tier name, index)`; entry 0 is the GPU index given at construction.
    indexes: Vec<(Arc<str>, SharedPrefixIndex)>,
    /// The same non-GPU tiers, for readers outside the applier's lock.
    registry: TierRegistry,
    /// Each worker's engine block size, for readers outside the applier's lock.
    sizes: Arc<EngineBlockSizes>,
    workers: HashMap<String, WorkerState>,
    decoder: Decoder,
    batch: Batch,
    scratch: Scratch,
}

#[derive(Default)]
pub(super) struct Scratch {
    /// The tokens of one router block gathered from engine pages (see `pages`).
    pub(super) tokens: Vec<u32>,
    own: Vec<u64>,
    ends: Vec<[u8; 32]>,
    /// Engine hashes of consecutive `BlockRemoved` events, not yet applied.
    pending: Vec<u64>,
    /// The index blocks they translate to.
    removed: Vec<u64>,
}

impl Applier {
    /// An applier feeding `index` (the GPU tier) under `config`.
    ///
    /// Errors (`Value`): `block_size == 0`; a `seed` outside the `vllm` profile.
    pub fn new(index: SharedPrefixIndex, config: Config) -> Result<Self> {
        let hasher = BlockHasher::new(
            config.block_size,
            config.profile,
            Options {
                seed: config.seed.clone(),
                ..Options::default()
            },
        )?;
        Ok(Applier {
            config,
            hasher,
            namespaces: HashMap::new(),
            gpu: index.clone(),
            indexes: vec![(Arc::from(GPU), index)],
            registry: TierRegistry::default(),
            sizes: Arc::default(),
            workers: HashMap::new(),
            decoder: Decoder::new(),
            batch: Batch::default(),
            scratch: Scratch::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The GPU index.
    pub fn index(&self) -> &SharedPrefixIndex {
        &self.gpu
    }

    /// The index of tier `medium` (`"GPU"` gives the main index), if that tier has been seen.
    pub fn tier_index(&self, medium: &str) -> Option<SharedPrefixIndex> {
        if medium == GPU {
            return Some(self.index().clone());
        }
        self.indexes
            .iter()
            .find(|(name, _)| &**name == medium)
            .map(|(_, index)| index.clone())
    }

    /// The non-GPU tiers, shared: new tiers appear in it as the applier creates them.
    pub fn tier_registry(&self) -> TierRegistry {
        self.registry.clone()
    }

    /// Records each worker's engine block size, from its next store on, in `sizes` (shared with
    /// a reader such as the router; an applier has its own until then).
    pub fn share_engine_block_sizes(&mut self, sizes: Arc<EngineBlockSizes>) {
        self.sizes = sizes;
    }

    /// Names of the non-GPU tiers seen so far, in order of appearance.
    pub fn tiers(&self) -> Vec<Arc<str>> {
        self.indexes
            .iter()
            .skip(1)
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Names of the workers that sent at least one payload (or were reset), sorted.
    pub fn workers(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.workers.keys().map(|k| &**k).collect();
        names.sort_unstable();
        names
    }

    /// The counters of `worker`, if known.
    pub fn counters(&self, worker: &str) -> Option<WorkerCounters> {
        self.workers.get(worker).map(|w| w.counters)
    }

    /// The context that applies events for `worker` (registered on first use), beside the
    /// decoded batch it reads: disjoint borrows of this applier's fields.
    fn context<'a>(&'a mut self, worker: &'a str) -> (Ctx<'a>, &'a Batch) {
        let Applier {
            config,
            hasher,
            namespaces,
            indexes,
            registry,
            sizes,
            workers,
            batch,
            scratch,
            ..
        } = self;
        let ctx = Ctx {
            config,
            hasher,
            namespaces,
            indexes,
            registry,
            sizes,
            name: worker,
            state: worker_state(workers, worker),
            scratch,
            pending_tier: None,
        };
        (ctx, batch)
    }

    /// Decodes `payload` completely, then applies its events in order for `worker`.
    ///
    /// A payload the decoder refuses returns `Err` and changes nothing but the worker's
    /// `malformed` counter. Events that cannot be applied are skipped and counted; they never
    /// fail the batch.
    pub fn apply(&mut self, worker: &str, payload: &[u8]) -> Result<BatchOutcome> {
        let decoded = self.decoder.decode(payload, &mut self.batch);
        let (mut ctx, batch) = self.context(worker);
        if let Err(e) = decoded {
            ctx.state.counters.malformed += 1;
            return Err(e);
        }
        ctx.state.counters.batches += 1;
        ctx.state.counters.events += batch.len() as u64;
        let mut outcome = BatchOutcome {
            events: batch.len(),
            cleared: false,
            ts: batch.ts,
        };
        for event in batch.events(payload) {
            if event.kind != EventKind::Removed {
                ctx.flush_removals();
            }
            match event.kind {
                EventKind::Stored => ctx.store(&event),
                EventKind::Removed => ctx.remove(&event),
                EventKind::Cleared => {
                    ctx.state.counters.cleared_events += 1;
                    ctx.clear();
                    outcome.cleared = true;
                }
                EventKind::Unknown => ctx.state.counters.skipped_unknown_type += 1,
            }
        }
        ctx.flush_removals();
        Ok(outcome)
    }

    /// Drops everything known about `worker`'s blocks, in every tier (after a sequence gap that
    /// cannot be replayed, or an engine restart); counts a reset.
    pub fn clear_worker(&mut self, worker: &str) {
        let (mut ctx, _) = self.context(worker);
        ctx.state.counters.resets += 1;
        // A restarted engine may store blocks of another size: its next GPU store names it.
        ctx.state.counters.engine_block_size = 0;
        ctx.clear();
    }

    /// Clears `worker` (as [`Applier::clear_worker`], without counting a reset), removes it from
    /// the tier indexes this applier owns, and forgets its state and counters. It stays
    /// registered in the GPU index, whose owner decides membership. Returns whether it was known.
    pub fn remove_worker(&mut self, worker: &str) -> bool {
        if !self.workers.contains_key(worker) {
            return false;
        }
        self.clear_worker(worker);
        if let Some(state) = self.workers.remove(worker) {
            for (tier, (_, index)) in state.tiers.iter().zip(&self.indexes).skip(1) {
                let mut index = index.write();
                if let Some(id) = valid_id(&index, tier) {
                    let r = index.remove_worker_id(id);
                    debug_assert!(r.is_ok(), "valid_id checked the id under this lock: {r:?}");
                }
            }
        }
        true
    }
}

fn worker_state<'w>(
    workers: &'w mut HashMap<String, WorkerState>,
    worker: &str,
) -> &'w mut WorkerState {
    workers.entry_ref(worker).or_default()
}

/// The worker's id in `index` if the registration recorded in `tier` is still the live one.
fn valid_id(index: &PrefixIndex, tier: &TierState) -> Option<WorkerId> {
    let (id, name) = tier.registered.as_ref()?;
    let live = index.worker_name(*id)?;
    std::ptr::eq(live.as_ptr(), name.as_ptr()).then_some(*id)
}

/// The worker's id in `index`, registering it when new (or when the index forgot it, in which
/// case whatever the tier remembered about its blocks is dropped too).
pub(super) fn ensure_id(
    index: &mut PrefixIndex,
    tier: &mut TierState,
    name: &str,
) -> Result<WorkerId> {
    if let Some(id) = valid_id(index, tier) {
        return Ok(id);
    }
    tier.forget();
    tier.registered = None;
    let id = index.add_worker(name)?;
    if let Some(arc) = index.worker_name_arc(id) {
        tier.registered = Some((id, arc));
    }
    Ok(id)
}

/// Borrowed parts of the applier while one worker's events are applied.
pub(super) struct Ctx<'s> {
    pub(super) config: &'s Config,
    hasher: &'s BlockHasher,
    namespaces: &'s mut HashMap<Namespace, BlockHasher>,
    pub(super) indexes: &'s mut Vec<(Arc<str>, SharedPrefixIndex)>,
    registry: &'s TierRegistry,
    sizes: &'s EngineBlockSizes,
    pub(super) name: &'s str,
    pub(super) state: &'s mut WorkerState,
    pub(super) scratch: &'s mut Scratch,
    /// The tier of the removals gathered in `scratch.removed`, not yet applied.
    pending_tier: Option<usize>,
}

impl Ctx<'_> {
    /// The tier number of `medium`, creating the tier when new (`None` past [`MAX_TIERS`]).
    fn tier(&mut self, medium: Option<&str>, create: bool) -> Option<usize> {
        let tier = match medium {
            None => 0,
            Some(m) if m == GPU => 0,
            Some(m) => match self.indexes.iter().position(|(name, _)| &**name == m) {
                Some(t) => t,
                None if create && self.indexes.len() <= MAX_TIERS => {
                    let budget = self.indexes.first()?.1.read().max_bytes();
                    let index = PrefixIndex::new(budget).ok()?;
                    let tier: (Arc<str>, SharedPrefixIndex) =
                        (Arc::from(m), Arc::new(RwLock::new(index)));
                    self.registry.write().push(tier.clone());
                    self.indexes.push(tier);
                    self.indexes.len() - 1
                }
                None => return None,
            },
        };
        if self.state.tiers.len() <= tier {
            self.state.tiers.resize_with(tier + 1, TierState::default);
        }
        Some(tier)
    }

    /// The hasher for a chain in namespace (`salt`, `lora`).
    pub(super) fn hasher(
        &mut self,
        salt: Option<&str>,
        lora: Option<&str>,
    ) -> Result<&BlockHasher> {
        if salt.is_none() && lora.is_none() {
            return Ok(self.hasher);
        }
        let key = NamespaceRef { salt, lora };
        if !self.namespaces.contains_key(&key) {
            if self.namespaces.len() >= MAX_NAMESPACES {
                self.namespaces.clear();
            }
            let hasher = BlockHasher::new(
                self.config.block_size,
                self.config.profile,
                Options {
                    salt: salt.map(str::to_owned),
                    lora_name: lora.map(str::to_owned),
                    lora_path: None,
                    seed: self.config.seed.clone(),
                },
            )?;
            let owned = Namespace {
                salt: salt.map(Box::from),
                lora: lora.map(Box::from),
            };
            self.namespaces.insert(owned, hasher);
        }
        match self.namespaces.get(&key) {
            Some(h) => Ok(h),
            None => value_err!("hasher for salt {salt:?}, LoRA {lora:?} is missing"),
        }
    }

    fn store(&mut self, ev: &Event<'_>) {
        let counters = &mut self.state.counters;
        counters.stored_events += 1;
        if ev.group_idx != self.config.group_idx {
            counters.skipped_other_group += 1;
            return;
        }
        let n = ev.block_hashes.len();
        if n == 0 {
            return;
        }
        // The engine's block size: the largest of its GPU stores since it was last cleared. A
        // vLLM 0.33 partial-window entry names the window's length (less than the block), and a
        // KV connector's other tier (CPU, storage) its own block size, not the GPU's.
        let on_gpu = ev.medium.is_none_or(|m| m == GPU);
        if on_gpu && ev.block_size > counters.engine_block_size {
            counters.engine_block_size = ev.block_size;
            self.sizes
                .set(self.name, u32::try_from(ev.block_size).unwrap_or(0));
        }
        let router = self.config.block_size;
        let engine = usize::try_from(ev.block_size).unwrap_or(usize::MAX);
        // Pages of fewer tokens than a router block are gathered into router blocks (rehash
        // mode, a divisor of the router's size, and on the GPU the engine's block size: a
        // smaller store there is a partial window or an SGLang short last page).
        let pages = engine < router
            && self.config.mode == Mode::Rehash
            && router.is_multiple_of(engine)
            && !(on_gpu && engine < counters.engine_block_size as usize);
        if engine == 0
            || n.checked_mul(engine) != Some(ev.token_ids.len())
            || (engine < router && !pages)
        {
            counters.skipped_partial += 1;
            return;
        }
        let fits = match self.config.mode {
            Mode::Rehash => pages || engine % router == 0,
            Mode::Direct => engine == router,
        };
        if !fits {
            counters.skipped_block_size += 1;
            return;
        }
        let Some(tier) = self.tier(ev.medium, true) else {
            self.state.counters.skipped_unsupported += 1;
            return;
        };
        match self.config.mode {
            Mode::Rehash if pages => self.store_pages(ev, tier, engine),
            Mode::Rehash => self.store_rehash(ev, tier, engine / router),
            Mode::Direct => self.store_direct(ev, tier),
        }
    }

    fn store_direct(&mut self, ev: &Event<'_>, tier: usize) {
        if ev.parent.is_none() && !self.own_first_hash(ev) {
            self.state.counters.foreign_hashes += 1;
        }
        let Some(state) = self.state.tiers.get_mut(tier) else {
            return;
        };
        let Some((_, index)) = self.indexes.get(tier) else {
            return;
        };
        let mut index = index.write();
        let out = ensure_id(&mut index, state, self.name)
            .and_then(|id| index.store_id(id, ev.block_hashes, ev.parent));
        drop(index);
        let counters = &mut self.state.counters;
        match out {
            Ok(()) => counters.blocks_stored += ev.block_hashes.len() as u64,
            Err(Error::Key(_)) => counters.skipped_unknown_parent += 1,
            Err(_) => counters.index_rejected += 1,
        }
    }

    /// Whether a root store's first block hash is the router's own hash of its tokens (true
    /// when it cannot be compared: a salt, LoRA, extra keys, lookahead or wide tokens).
    fn own_first_hash(&self, ev: &Event<'_>) -> bool {
        let plain = ev.extra_keys.summary(ev.lora_name);
        let namespaced = plain.salt.is_some() || ev.cache_salt.is_some_and(|s| !s.is_empty());
        if plain.unsupported || namespaced || ev.lora_name.is_some_and(|l| !l.is_empty()) {
            return true;
        }
        if !ev.tokens_fit_u32 || ev.has_lookahead {
            return true;
        }
        let (Some(&engine), Some(first)) = (
            ev.block_hashes.first(),
            ev.token_ids.get(..self.config.block_size),
        ) else {
            return true;
        };
        let mut own = None;
        let hashed = self
            .hasher
            .hash_each(first, &ChainState::Root, &[], |value, _| {
                own.get_or_insert(value);
            });
        hashed.is_err() || own.is_none_or(|h| h == engine)
    }

    /// The (salt, LoRA name) a rehashed store's chain starts in: the salt only for a root store
    /// (`None` on a child). `None` (outer) when the router cannot rehash the store: tokens wider
    /// than 32 bits, lookahead tokens, multimodal or embedding extra keys, a salt on a child.
    pub(super) fn rehash_namespace<'e>(
        &self,
        ev: &Event<'e>,
    ) -> Option<(Option<&'e str>, Option<&'e str>)> {
        if !ev.tokens_fit_u32 || ev.has_lookahead {
            return None;
        }
        let extra = ev.extra_keys.summary(ev.lora_name);
        let salt = match ev.parent {
            // SGLang names the salt on every event of a salted request; it only seeds the root.
            None => extra.salt.or(ev.cache_salt),
            Some(_) => extra.salt,
        };
        if extra.unsupported || (ev.parent.is_some() && salt.is_some()) {
            return None;
        }
        let salt = salt.filter(|s| !s.is_empty());
        Some((salt, ev.lora_name.filter(|s| !s.is_empty())))
    }

    fn store_rehash(&mut self, ev: &Event<'_>, tier: usize, per_block: usize) {
        let Some((salt, lora)) = self.rehash_namespace(ev) else {
            self.state.counters.skipped_unsupported += 1;
            return;
        };
        let digest_chain = self.config.profile.chains_on_digest();
        let (parent, start) = match ev.parent {
            None => (None, ChainState::Root),
            Some(p) => {
                let tier_state = self.state.tiers.get(tier);
                let link = tier_state.and_then(|t| t.links.get(&p)).copied();
                let state = if digest_chain {
                    tier_state
                        .and_then(|t| t.digests.get(&p))
                        .map(|d| ChainState::Digest(*d))
                } else {
                    link.map(ChainState::Native)
                };
                match (link, state) {
                    (Some(last), Some(state)) => (Some(last), state),
                    _ => {
                        self.state.counters.skipped_unknown_parent += 1;
                        return;
                    }
                }
            }
        };
        let n = ev.block_hashes.len();
        let mut scratch = std::mem::take(self.scratch);
        scratch.own.clear();
        scratch.ends.clear();
        let hashed = match self.hasher(salt, lora) {
            Ok(hasher) => {
                let (own, ends) = (&mut scratch.own, &mut scratch.ends);
                let mut i = 0usize;
                hasher.hash_each(ev.token_ids, &start, &[], |value, state| {
                    own.push(value);
                    if digest_chain {
                        i += 1;
                        if let (0, ChainState::Digest(d)) = (i % per_block, state) {
                            ends.push(*d);
                        }
                    }
                })
            }
            Err(e) => Err(e),
        };
        let complete =
            scratch.own.len() == n * per_block && (!digest_chain || scratch.ends.len() == n);
        if hashed.is_err() || !complete {
            self.state.counters.skipped_unsupported += 1;
            *self.scratch = scratch;
            return;
        }
        let stored = match (self.state.tiers.get_mut(tier), self.indexes.get(tier)) {
            (Some(state), Some((_, index))) => {
                let mut index = index.write();
                ensure_id(&mut index, state, self.name)
                    .and_then(|id| index.store_id(id, &scratch.own, parent))
            }
            _ => value_err!("tier {tier} is missing"),
        };
        let counters = &mut self.state.counters;
        match stored {
            Ok(()) => {
                counters.blocks_stored += n as u64;
                if let Some(state) = self.state.tiers.get_mut(tier) {
                    state.links.reserve(n);
                    let blocks = scratch.own.chunks_exact(per_block);
                    for (&engine, own) in ev.block_hashes.iter().zip(blocks) {
                        if let (Some(&first), Some(&last)) = (own.first(), own.last()) {
                            state.links.insert(engine, last);
                            if per_block > 1 {
                                state.firsts.insert(engine, first);
                            } else if !state.firsts.is_empty() {
                                state.firsts.remove(&engine);
                            }
                        }
                    }
                    if digest_chain {
                        state.digests.reserve(n);
                        for (&engine, &end) in ev.block_hashes.iter().zip(&scratch.ends) {
                            state.digests.insert(engine, end);
                        }
                    }
                }
            }
            Err(_) => counters.index_rejected += 1,
        }
        *self.scratch = scratch;
    }

    fn remove(&mut self, ev: &Event<'_>) {
        let counters = &mut self.state.counters;
        counters.removed_events += 1;
        if ev.group_idx != self.config.group_idx {
            counters.skipped_other_group += 1;
            return;
        }
        counters.blocks_removed += ev.block_hashes.len() as u64;
        let Some(tier) = self.tier(ev.medium, false) else {
            return; // a tier never stored into holds nothing to remove
        };
        if self.pending_tier.is_some_and(|t| t != tier) {
            self.flush_removals();
        }
        if self.state.tiers.len() > tier && !ev.block_hashes.is_empty() {
            self.scratch.pending.extend_from_slice(ev.block_hashes);
            self.pending_tier = Some(tier);
        }
    }

    /// Applies the removals gathered from consecutive `BlockRemoved` events of one tier (vLLM
    /// sends one event per evicted block): their engine hashes are translated in one pass over
    /// the maps (independent lookups the processor overlaps) and removed in one index call.
    /// Called before any other event, when the tier changes, and at the end of the batch, so
    /// the order of operations is unchanged.
    fn flush_removals(&mut self) {
        let Some(tier) = self.pending_tier.take() else {
            return;
        };
        let Scratch {
            pending, removed, ..
        } = &mut *self.scratch;
        if let Some(state) = self.state.tiers.get_mut(tier) {
            match self.config.mode {
                Mode::Direct => std::mem::swap(pending, removed),
                Mode::Rehash => {
                    for h in pending.iter() {
                        if let Some(last) = state.links.remove(h) {
                            let first = match state.firsts.is_empty() {
                                true => None,
                                false => state.firsts.remove(h),
                            };
                            removed.push(first.unwrap_or(last));
                        } else if !state.pages.is_empty() {
                            // A page inside a router block: its block, if completed, went with
                            // the later page that completed it (engines evict leaf first).
                            state.pages.remove(*h);
                        }
                        if !state.digests.is_empty() {
                            state.digests.remove(h);
                        }
                    }
                }
            }
        }
        if let (Some(state), Some((_, index))) =
            (self.state.tiers.get(tier), self.indexes.get(tier))
        {
            if !removed.is_empty() {
                let mut index = index.write();
                if let Some(id) = valid_id(&index, state) {
                    let r = index.remove_id(id, removed);
                    debug_assert!(r.is_ok(), "valid_id checked the id under this lock: {r:?}");
                }
            }
        }
        pending.clear();
        removed.clear();
    }

    fn clear(&mut self) {
        for (state, (_, index)) in self.state.tiers.iter_mut().zip(self.indexes.iter()) {
            state.forget();
            let mut index = index.write();
            if let Some(id) = valid_id(&index, state) {
                let r = index.clear_id(id);
                debug_assert!(r.is_ok(), "valid_id checked the id under this lock: {r:?}");
            }
        }
    }
}

/// A test-only reader of the per-worker maps (`tests_state.rs`).
#[cfg(test)]
#[path = "tests_state.rs"]
pub(super) mod state;
