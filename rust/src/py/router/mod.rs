//! Bindings for `crate::router`: `kvroute.Router`, `kvroute.Decision` and `kvroute.PdDecision`.
//!
//! The router's core sits behind a `parking_lot::Mutex`. `route` converts its arguments under the
//! GIL, then hashes the tokens (the hasher is an `Arc` taken under the lock, so threads hash in
//! parallel) and routes with the lock held; for prompts of at least [`DETACH_MIN_TOKENS`] tokens
//! or [`DETACH_MIN_BLOCKS`] blocks (or when the lock is busy) that work runs with the GIL
//! released. `d.scores` is built only when read.
//!
//! Files: this one holds the `Router` class (every method converts its arguments and forwards
//! to the core); `request.rs` the arguments `route` and `route_pd` share, `config.rs` the
//! constructor's keywords and `Router.config`, `decision.rs` the decision classes.

mod config;
mod decision;
mod request;

use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::convert::{
    i32_from_int, optional, u64_array, u64_from_int, u64_slice, usize_from_int, weight_arg,
    weighted_names, with_bytes, MonotonicClock, Name, Negative, NoWorkerError,
};
use super::events::PyKvEventApplier;
use super::index::PyPrefixIndex;
use super::{with_mutex, with_mutex_unless, DETACH_MIN_TOKENS};
use crate::blocks::Options;
use crate::router::{Config, CostWeights, EndpointSpec, PdConfig, Phase, Role, Router};
use config::{config_dict, roles_from_py, tier_weights_from_py};
use decision::{PyDecision, PyPdDecision};

/// The `ReadOnlyError` message of a write to `router.index` in approx mode.
const APPROX_INDEX_OWNED: &str = "router.index is read-only with index=\"approx\": the router \
     writes it as it routes (its model of each worker's cache); correct the model with \
     router.observe(...), or build the Router with index=\"events\" to feed the index yourself";

/// Work over at least this many blocks (routing given block hashes, salting them, finishing or
/// observing a decision's prompt) runs with the GIL released: it costs per block, whatever the
/// router's block size (32 blocks are 512 tokens at vLLM's default of 16 tokens a block).
const DETACH_MIN_BLOCKS: usize = 32;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRouter>()?;
    m.add_class::<PyDecision>()?;
    m.add_class::<PyPdDecision>()?;
    m.add("NoWorkerError", m.py().get_type::<NoWorkerError>())?;
    Ok(())
}

/// `None`, or the value parsed from `s` (its `FromStr` error names the bad value).
fn optional_parse<T: std::str::FromStr<Err = crate::Error>>(
    s: Option<&str>,
) -> PyResult<Option<T>> {
    Ok(s.map(str::parse).transpose()?)
}

/// Which worker gets a request, why, and how much of the prompt is expected cached there.
///
/// `Router(workers, *, policy, block_size, hash_profile, index, capacity_blocks, ttl,
/// queue_weight, decode_weight, load_bound, seed, stale_half_life, tier_weights, salt, hash_seed,
/// event_mode)`: `workers` is a list of names or a `{name: weight}` dict (weight = relative
/// capacity); every keyword left out (or None) takes the core's default (`Router.config` shows
/// the values in effect).
///
/// `route(tokens=None, *, block_hashes=None, key=None, endpoint=None, exclude=None, now=None)`
/// returns a `Decision`. Pass at most one of `tokens` (hashed with the router's `BlockHasher`, or
/// the endpoint's salted one) and `block_hashes`; with neither, the request has no prefix to
/// match (route by `key`, endpoint or load). Policies: `random`, `round_robin`,
/// `least_loaded`, `power_of_two`, `hash` (rendezvous hash of `key`, else the endpoint, else the
/// first block, with bounded loads `load_bound`), `kv_aware` (minimum of `(queue_weight *
/// prefill_blocks + (1 + delayed) * (prompt_blocks - credit) + decode_weight * written_blocks) /
/// weight`, in blocks, where `credit` counts the prefix cached there or held by requests in
/// flight there and `delayed` is 1 + the fewest requests queued at a candidate; ties by
/// rendezvous hash of the first block). Only healthy workers are chosen; with `endpoint`, only
/// members of its pool; never one in `exclude`. No candidate raises `NoWorkerError` (a
/// `ValueError`).
///
/// `index="approx"`: the router models each worker's cache (a `BlockCache` of `capacity_blocks`,
/// blocks idle over `ttl` seconds gone) from where it routed; `observe` corrects the model.
/// `index="events"`: `router.index` is fed from outside (`router.event_applier`, engine KV
/// events); `mark_stale`/`mark_fresh` decay a worker's overlap credit (half-life
/// `stale_half_life` seconds); tier overlap counts at `tier_weights`. `now` defaults to
/// `time.monotonic()`: pass it on every call (virtual time) or on none.
///
/// Load: `begin(d)`, `prefilled(d)`, `finish(d)`; `load(worker)` gives `active`, `queued`
/// (not yet prefilled), `prefill_blocks` (left to prefill after hits), `decode_blocks` (prompt
/// blocks of running requests) and `written_blocks` (blocks they add to the worker's cache). Unknown names raise
/// `KeyError`; bad values `ValueError`; errors change nothing. Safe to share between threads.
#[pyclass(frozen, module = "kvroute._core", name = "Router")]
pub struct PyRouter {
    core: Mutex<Router>,
    index: Py<PyPrefixIndex>,
    applier: Option<Py<PyKvEventApplier>>,
    clock: MonotonicClock,
}

impl PyRouter {
    /// Runs `f` on the core: with the GIL held when `light` and the lock is free, else with the
    /// GIL released.
    fn run<R: Send>(
        &self,
        py: Python<'_>,
        light: bool,
        f: impl FnOnce(&mut Router) -> R + Send,
    ) -> R {
        with_mutex(py, &self.core, light, f)
    }

    /// [`Self::run`] for a route at `now`: inline (when `light`) only if no idle blocks are due
    /// to leave the model first (as long as the blocks), else with the GIL released.
    fn run_at<R: Send>(
        &self,
        py: Python<'_>,
        light: bool,
        now: f64,
        f: impl FnOnce(&mut Router) -> R + Send,
    ) -> R {
        with_mutex_unless(py, &self.core, light, |r| r.expiry_due(now), f)
    }
}

#[pymethods]
impl PyRouter {
    #[new]
    #[pyo3(signature = (
        workers, *, policy = None, block_size = None, hash_profile = None, index = None,
        capacity_blocks = None, ttl = None, queue_weight = None, decode_weight = None,
        load_bound = None, seed = None, stale_half_life = None, tier_weights = None, salt = None,
        hash_seed = None, event_mode = None, hash_algo = None, vllm_version = None,
        updates = None, roles = None, pd_threshold = None, pd_saturation = None,
        pd_local_prefill = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        workers: &Bound<'_, PyAny>,
        policy: Option<&str>,
        block_size: Option<&Bound<'_, PyAny>>,
        hash_profile: Option<&str>,
        index: Option<&str>,
        capacity_blocks: Option<&Bound<'_, PyAny>>,
        ttl: Option<f64>,
        queue_weight: Option<f64>,
        decode_weight: Option<f64>,
        load_bound: Option<f64>,
        seed: Option<&Bound<'_, PyAny>>,
        stale_half_life: Option<f64>,
        tier_weights: Option<&Bound<'_, PyAny>>,
        salt: Option<Name<'_>>,
        hash_seed: Option<Name<'_>>,
        event_mode: Option<&str>,
        hash_algo: Option<Name<'_>>,
        vllm_version: Option<Name<'_>>,
        updates: Option<bool>,
        roles: Option<&Bound<'_, PyAny>>,
        pd_threshold: Option<&Bound<'_, PyAny>>,
        pd_saturation: Option<f64>,
        pd_local_prefill: Option<bool>,
    ) -> PyResult<Self> {
        let workers = weighted_names(workers, "workers", "worker")?;
        let roles = optional(roles, roles_from_py)?.unwrap_or_default();
        // Every argument not given keeps the core's default.
        let d = Config::default();
        let mut config = Config {
            policy: optional_parse(policy)?.unwrap_or(d.policy),
            block_size: optional(block_size, |b| usize_from_int(b, "block_size"))?
                .unwrap_or(d.block_size),
            profile: optional_parse(hash_profile)?
                .unwrap_or(d.profile)
                .with_vllm(hash_algo.as_deref(), vllm_version.as_deref())?,
            hash_options: Options {
                salt: salt
                    .map(Name::to_owned_string)
                    .or(d.hash_options.salt.clone()),
                seed: hash_seed
                    .map(Name::to_owned_string)
                    .or(d.hash_options.seed.clone()),
                ..d.hash_options.clone()
            },
            mode: optional_parse(index)?.unwrap_or(d.mode),
            capacity_blocks: optional(capacity_blocks, |c| usize_from_int(c, "capacity_blocks"))?
                .unwrap_or(d.capacity_blocks),
            ttl: ttl.or(d.ttl),
            weights: CostWeights {
                queue: queue_weight.unwrap_or(d.weights.queue),
                decode: decode_weight.unwrap_or(d.weights.decode),
            },
            bound_c: load_bound.unwrap_or(d.bound_c),
            seed: optional(seed, |s| u64_from_int(s, "seed", None))?.unwrap_or(d.seed),
            stale_half_life: stale_half_life.unwrap_or(d.stale_half_life),
            event_mode: optional_parse(event_mode)?.unwrap_or(d.event_mode),
            updates: updates.unwrap_or(d.updates),
            pd: PdConfig {
                threshold: optional(pd_threshold, |t| usize_from_int(t, "pd_threshold"))?
                    .unwrap_or(d.pd.threshold),
                saturation: pd_saturation.or(d.pd.saturation),
                local_prefill: pd_local_prefill.unwrap_or(d.pd.local_prefill),
            },
            ..d
        };
        if let Some(obj) = tier_weights {
            config.tier_weights = tier_weights_from_py(obj)?;
        }
        let mut core = Router::new(workers.iter().map(|(n, w)| (n.as_str(), *w)), config)?;
        for (name, role) in &roles {
            core.set_role(name, *role)?;
        }
        PyRouter::from_core(py, core)
    }

    /// Routes one request; returns a `Decision`. In approx mode the prompt is recorded on the
    /// chosen worker. Without `tokens` and `block_hashes` the request has no prefix to match.
    #[pyo3(signature = (tokens = None, *, block_hashes = None, key = None, endpoint = None, exclude = None, now = None))]
    #[allow(clippy::too_many_arguments)]
    fn route(
        &self,
        py: Python<'_>,
        tokens: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        key: Option<&Bound<'_, PyAny>>,
        endpoint: Option<Name<'_>>,
        exclude: Option<&Bound<'_, PyAny>>,
        now: Option<f64>,
    ) -> PyResult<PyDecision> {
        let args = (tokens, block_hashes, key, endpoint, exclude, now);
        let decision = self.routed(py, args, |r, req| r.route(req))?;
        Ok(PyDecision { inner: decision })
    }

    /// Routes one request as a prefill/decode pair; returns a `PdDecision`. Arguments as for
    /// `route` (`exclude` applies to both halves).
    #[pyo3(signature = (tokens = None, *, block_hashes = None, key = None, endpoint = None, exclude = None, now = None))]
    #[allow(clippy::too_many_arguments)]
    fn route_pd(
        &self,
        py: Python<'_>,
        tokens: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        key: Option<&Bound<'_, PyAny>>,
        endpoint: Option<Name<'_>>,
        exclude: Option<&Bound<'_, PyAny>>,
        now: Option<f64>,
    ) -> PyResult<PyPdDecision> {
        let args = (tokens, block_hashes, key, endpoint, exclude, now);
        let pair = self.routed(py, args, |r, req| r.route_pd(req))?;
        PyPdDecision::from_core(py, pair)
    }

    /// The request of `decision` starts: counted in its worker's load. Returns the blocks this
    /// router's requests had left to prefill on the worker just before it (`load(worker)
    /// ["prefill_blocks"]` before the call: the queue ahead of the request), so a caller timing
    /// the prefill needs no `load` call. `ValueError` if it was already begun or comes from
    /// another router; `KeyError` if its worker was removed.
    fn begin(&self, py: Python<'_>, decision: &Bound<'_, PyDecision>) -> PyResult<u64> {
        let d = &decision.get().inner;
        Ok(self.run(py, true, |r| r.begin(d))?)
    }

    /// The request's prefill is done (first token): its blocks leave the worker's prefill queue.
    fn prefilled(&self, py: Python<'_>, decision: &Bound<'_, PyDecision>) -> PyResult<()> {
        let d = &decision.get().inner;
        Ok(self.run(py, true, |r| r.prefilled(d))?)
    }

    /// The request ended: taken off its worker's load (approx mode: its blocks are refreshed).
    /// `ValueError` if it was not begun, already finished, or comes from another router.
    #[pyo3(signature = (decision, *, now = None))]
    fn finish(
        &self,
        py: Python<'_>,
        decision: &Bound<'_, PyDecision>,
        now: Option<f64>,
    ) -> PyResult<()> {
        let d = &decision.get().inner;
        let now = self.clock.now(now);
        let light = d.prompt_blocks < DETACH_MIN_BLOCKS;
        Ok(self.run(py, light, |r| r.finish(d, now))?)
    }

    /// Takes back `decision`, whose request never ran on its worker (shed after routing, or
    /// served elsewhere): a begun one leaves the worker's load; approx mode: the blocks only its
    /// route recorded leave the model. `False` if it was already withdrawn; `ValueError` if it ran
    /// (prefilled, observed, finished) or comes from another router.
    fn withdraw(&self, py: Python<'_>, decision: &Bound<'_, PyDecision>) -> PyResult<bool> {
        let d = &decision.get().inner;
        let light = d.prompt_blocks < DETACH_MIN_BLOCKS;
        Ok(self.run(py, light, |r| r.withdraw(d))?)
    }

    /// Feeds back the cached tokens the engine reported for `decision` (OpenAI
    /// `usage.prompt_tokens_details.cached_tokens`). Approx mode: fewer than predicted drops the
    /// worker's blocks from there on; then the prompt is recorded. Once per decision.
    #[pyo3(signature = (decision, cached_tokens, *, now = None))]
    fn observe(
        &self,
        py: Python<'_>,
        decision: &Bound<'_, PyDecision>,
        cached_tokens: &Bound<'_, PyAny>,
        now: Option<f64>,
    ) -> PyResult<()> {
        let d = &decision.get().inner;
        let cached = usize_from_int(cached_tokens, "cached_tokens")?;
        let now = self.clock.now(now);
        let light = d.prompt_blocks < DETACH_MIN_BLOCKS;
        Ok(self.run(py, light, |r| r.observe(d, cached, now))?)
    }

    /// Adds worker `name` with relative capacity `weight` and `role` ("prefill", "decode" or
    /// "both"; default: both).
    #[pyo3(signature = (name, weight = 1.0, *, role = None))]
    fn add_worker(
        &self,
        py: Python<'_>,
        name: Name<'_>,
        #[pyo3(from_py_with = weight_arg)] weight: f64,
        role: Option<&str>,
    ) -> PyResult<()> {
        let name = &*name;
        let role = optional_parse::<Role>(role)?.unwrap_or_default();
        Ok(self.run(py, false, |r| r.add_worker_as(name, weight, role))?)
    }

    /// Gives worker `name` the role `role` ("prefill", "decode" or "both"): endpoint pools
    /// follow; its load and cached blocks stay.
    fn set_role(&self, py: Python<'_>, name: Name<'_>, role: &str) -> PyResult<()> {
        let (name, role) = (&*name, role.parse::<Role>()?);
        Ok(self.run(py, false, |r| r.set_role(name, role))?)
    }

    /// Worker `name`'s role: "prefill", "decode" or "both".
    fn role(&self, py: Python<'_>, name: Name<'_>) -> PyResult<&'static str> {
        let name = &*name;
        Ok(self.run(py, true, |r| r.role(name).map(Role::name))?)
    }

    /// `{worker: role}` of every worker.
    #[getter]
    fn roles<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let roles: Vec<(String, &'static str)> = self.run(py, true, |r| {
            r.workers()
                .iter()
                .map(|w| (w.name.to_string(), w.role.name()))
                .collect()
        });
        let d = PyDict::new(py);
        for (name, role) in roles {
            d.set_item(name, role)?;
        }
        Ok(d)
    }

    /// Removes worker `name` (its load, its blocks in the index, its pool places).
    fn remove_worker(&self, py: Python<'_>, name: Name<'_>) -> PyResult<()> {
        let name = &*name;
        Ok(self.run(py, false, |r| r.remove_worker(name))?)
    }

    /// Marks worker `name` healthy (`ok=True`) or not; unhealthy workers are never chosen and
    /// are replaced in endpoint pools until they come back.
    fn set_healthy(&self, py: Python<'_>, name: Name<'_>, ok: bool) -> PyResult<()> {
        let name = &*name;
        Ok(self.run(py, true, |r| r.set_healthy(name, ok))?)
    }

    /// Whether worker `name` is healthy.
    fn is_healthy(&self, py: Python<'_>, name: Name<'_>) -> PyResult<bool> {
        let name = &*name;
        Ok(self.run(py, true, |r| r.workers().named(name).map(|w| w.healthy))?)
    }

    /// Worker `name`'s load: `{"active", "queued", "prefill_blocks", "decode_blocks",
    /// "written_blocks", "weight"}` (this router's own requests) and `"others"`: the same five
    /// counters for requests it did not begin (other replicas' as they announce them, and the
    /// engine's figures at the last `set_load`).
    fn load<'py>(&self, py: Python<'py>, name: Name<'_>) -> PyResult<Bound<'py, PyDict>> {
        let name = &*name;
        let (active, queued, prefill, decode, written, weight, others) =
            self.run(py, true, |r| {
                let w = r.workers().named(name)?;
                Ok::<_, crate::Error>((
                    w.active,
                    w.queued,
                    w.prefill_blocks,
                    w.decode_blocks,
                    w.written_blocks,
                    w.weight,
                    w.others,
                ))
            })?;
        let d = PyDict::new(py);
        d.set_item("active", active)?;
        d.set_item("queued", queued)?;
        d.set_item("prefill_blocks", prefill)?;
        d.set_item("decode_blocks", decode)?;
        d.set_item("written_blocks", written)?;
        d.set_item("weight", weight)?;
        let o = PyDict::new(py);
        o.set_item("active", others.active)?;
        o.set_item("queued", others.queued)?;
        o.set_item("prefill_blocks", others.prefill_blocks)?;
        o.set_item("decode_blocks", others.decode_blocks)?;
        o.set_item("written_blocks", others.written_blocks)?;
        d.set_item("others", o)?;
        Ok(d)
    }

    /// The engine's own load figures for worker `worker` (e.g. scraped from its `/metrics`),
    /// this router's requests included: what this router does not account for itself now is
    /// kept as the others' load until the next report. A figure left None keeps its baseline.
    #[pyo3(signature = (
        worker, *, active = None, queued = None, prefill_blocks = None, decode_blocks = None
    ))]
    fn set_load(
        &self,
        py: Python<'_>,
        worker: Name<'_>,
        active: Option<&Bound<'_, PyAny>>,
        queued: Option<&Bound<'_, PyAny>>,
        prefill_blocks: Option<&Bound<'_, PyAny>>,
        decode_blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let count =
            |o: Option<&Bound<'_, PyAny>>, what: &str| optional(o, |v| u64_from_int(v, what, None));
        let active = count(active, "active")?;
        let queued = count(queued, "queued")?;
        let prefill = count(prefill_blocks, "prefill_blocks")?;
        let decode = count(decode_blocks, "decode_blocks")?;
        let name = &*worker;
        Ok(self.run(py, true, |r| {
            r.set_load(name, active, queued, prefill, decode)
        })?)
    }

    /// Worker `worker`'s engine caches blocks of `tokens` tokens: its matches count whole
    /// engine blocks only (an event applier of this router sets it from the engine's stores).
    fn set_engine_block_size(
        &self,
        py: Python<'_>,
        worker: Name<'_>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let tokens = u64_from_int(tokens, "tokens", None)?;
        let name = &*worker;
        Ok(self.run(py, true, |r| r.set_engine_block_size(name, tokens))?)
    }

    /// Worker `worker`'s engine block size (tokens), or None while unknown.
    fn engine_block_size(&self, py: Python<'_>, worker: Name<'_>) -> PyResult<Option<u32>> {
        let name = &*worker;
        Ok(self.run(py, true, |r| r.engine_block_size(name))?)
    }

    /// With `updates=True`: the updates made since the last call — load changes (`begin`,
    /// `prefilled`, `finish`) and, in approx mode, model changes (`route`, `finish`,
    /// `observe`) — as one batch for other replicas' `apply_updates` (`b""` when there is none).
    #[pyo3(signature = (max_bytes = None))]
    fn take_updates<'py>(
        &self,
        py: Python<'py>,
        max_bytes: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let max = optional(max_bytes, |m| usize_from_int(m, "max_bytes"))?;
        // Taking the whole outbox moves it; a cut at `max_bytes` copies what stays behind.
        let batch = self.run(py, max.is_none(), |r| r.take_updates(max));
        Ok(PyBytes::new(py, &batch))
    }

    /// Applies another replica's batch of updates (`take_updates`) to this router's model at
    /// `now`; returns counts: `records`, `forgets`, `loads`, `unanchored` (the anchor block is not held
    /// here: skipped), `unknown_workers`, `inconsistent`. A malformed batch raises ValueError
    /// and changes nothing. `loads=False` skips load updates (re-applying this router's own
    /// batch to a model just loaded from a snapshot).
    #[pyo3(signature = (data, *, now = None, loads = true))]
    fn apply_updates<'py>(
        &self,
        py: Python<'py>,
        data: &Bound<'py, PyAny>,
        now: Option<f64>,
        loads: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let now = self.clock.now(now);
        let stats = with_bytes(data, "data", |b| {
            self.run(py, b.len() < 4096, |r| r.apply_updates(b, now, loads))
        })??;
        let d = PyDict::new(py);
        d.set_item("records", stats.records)?;
        d.set_item("loads", stats.loads)?;
        d.set_item("forgets", stats.forgets)?;
        d.set_item("unanchored", stats.unanchored)?;
        d.set_item("unknown_workers", stats.unknown_workers)?;
        d.set_item("inconsistent", stats.inconsistent)?;
        Ok(d)
    }

    /// Approx mode: the model (every worker's modelled cache, in recency order) as a snapshot
    /// for `load_model`.
    fn dump_model<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let image = self.run(py, false, |r| r.dump_model())?;
        Ok(PyBytes::new(py, &image))
    }

    /// Approx mode: replaces the model with a snapshot from `dump_model` (workers matched by
    /// name; the eviction order is reproduced). A bad snapshot raises ValueError and changes
    /// nothing.
    #[pyo3(signature = (data, *, now = None))]
    fn load_model(
        &self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        now: Option<f64>,
    ) -> PyResult<()> {
        let now = self.clock.now(now);
        with_bytes(data, "data", |b| {
            self.run(py, false, |r| r.load_model(b, now))
        })??;
        Ok(())
    }

    /// Adds a dedicated endpoint: a pool of `pool_size` workers chosen by rendezvous hashing of
    /// `endpoint_id` over the healthy workers. Its requests are salted with `salt` (default: the
    /// endpoint id; never empty; `isolate=False`: not salted, and no salt may be given).
    /// `reserved_blocks` (approx mode) reserves that
    /// many blocks for it in each member's modelled cache. `priority` (default 0; higher is
    /// served first) goes on its decisions, for a gateway to pass to the engine.
    #[pyo3(signature = (
        endpoint_id, *, pool_size, reserved_blocks = None, salt = None, isolate = None,
        priority = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_endpoint(
        &self,
        py: Python<'_>,
        endpoint_id: Name<'_>,
        pool_size: &Bound<'_, PyAny>,
        reserved_blocks: Option<&Bound<'_, PyAny>>,
        salt: Option<Name<'_>>,
        isolate: Option<bool>,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        // Every argument not given keeps the core's default.
        let d = EndpointSpec::default();
        let spec = EndpointSpec {
            pool_size: usize_from_int(pool_size, "pool_size")?,
            reserved_blocks: optional(reserved_blocks, |o| usize_from_int(o, "reserved_blocks"))?,
            salt: salt.as_deref(),
            isolate: isolate.unwrap_or(d.isolate),
            priority: optional(priority, |o| i32_from_int(o, "priority"))?.unwrap_or(d.priority),
        };
        let id = &*endpoint_id;
        Ok(self.run(py, false, |r| r.add_endpoint(id, spec))?)
    }

    /// The scheduling priority of endpoint `endpoint_id`'s requests (higher first).
    fn endpoint_priority(&self, py: Python<'_>, endpoint_id: Name<'_>) -> PyResult<i32> {
        let id = &*endpoint_id;
        Ok(self.run(py, true, |r| r.endpoint(id).map(|e| e.priority))?)
    }

    /// Removes endpoint `endpoint_id`.
    fn remove_endpoint(&self, py: Python<'_>, endpoint_id: Name<'_>) -> PyResult<()> {
        let id = &*endpoint_id;
        Ok(self.run(py, false, |r| r.remove_endpoint(id))?)
    }

    /// The workers of endpoint `endpoint_id`'s pool (in the order workers were added): those of
    /// `phase` ("prefill" or "decode"), or of either.
    #[pyo3(signature = (endpoint_id, *, phase = None))]
    fn endpoint_pool(
        &self,
        py: Python<'_>,
        endpoint_id: Name<'_>,
        phase: Option<&str>,
    ) -> PyResult<Vec<String>> {
        let id = &*endpoint_id;
        let phase = optional_parse::<Phase>(phase)?;
        let pool = self.run(py, true, |r| r.endpoint_pool(id, phase))?;
        Ok(pool.iter().map(|n| n.to_string()).collect())
    }

    /// The salt of endpoint `endpoint_id`'s blocks — the `cache_salt` a gateway sends upstream
    /// (vLLM, SGLang) so engine events land on the same hashes — or None if not isolated.
    fn endpoint_salt(&self, py: Python<'_>, endpoint_id: Name<'_>) -> PyResult<Option<String>> {
        let id = &*endpoint_id;
        Ok(self.run(py, true, |r| r.endpoint(id).map(|e| e.salt.clone()))?)
    }

    /// The hashes `route(block_hashes=..., endpoint=endpoint_id)` matches for `block_hashes`:
    /// salted by the endpoint when it is isolated, unchanged otherwise (a new uint64 array).
    /// What a simulator or test feeds an exact index with for the endpoint's blocks.
    fn salt_block_hashes<'py>(
        &self,
        py: Python<'py>,
        endpoint_id: Name<'_>,
        block_hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, numpy::PyArray1<u64>>> {
        let id = &*endpoint_id;
        let mut hashes = u64_slice(block_hashes, "block_hashes", Negative::Reinterpret)?
            .as_slice()
            .to_vec();
        let light = hashes.len() < DETACH_MIN_BLOCKS;
        self.run(py, light, |r| r.salt_block_hashes(Some(id), &mut hashes))?;
        Ok(u64_array(py, hashes))
    }

    /// Endpoint ids, sorted.
    #[getter]
    fn endpoints(&self, py: Python<'_>) -> Vec<String> {
        let mut ids: Vec<String> = self.run(py, true, |r| {
            r.endpoints().map(|e| e.id.to_string()).collect()
        });
        ids.sort();
        ids
    }

    /// Worker `worker`'s index stream is stale since `now`: its overlap credit decays by half
    /// every `stale_half_life` seconds until `mark_fresh`.
    #[pyo3(signature = (worker, now = None))]
    fn mark_stale(&self, py: Python<'_>, worker: Name<'_>, now: Option<f64>) -> PyResult<()> {
        let (name, now) = (&*worker, self.clock.now(now));
        Ok(self.run(py, true, |r| r.mark_stale(name, now))?)
    }

    /// Worker `worker`'s index stream is trusted again (freshness 1).
    fn mark_fresh(&self, py: Python<'_>, worker: Name<'_>) -> PyResult<()> {
        let name = &*worker;
        Ok(self.run(py, true, |r| r.mark_fresh(name))?)
    }

    /// Sets worker `worker`'s freshness to `value` in [0, 1] until the next mark.
    fn set_freshness(&self, py: Python<'_>, worker: Name<'_>, value: f64) -> PyResult<()> {
        let name = &*worker;
        Ok(self.run(py, true, |r| r.set_freshness(name, value))?)
    }

    /// Worker `worker`'s freshness (overlap credit factor) at `now`.
    #[pyo3(signature = (worker, now = None))]
    fn freshness(&self, py: Python<'_>, worker: Name<'_>, now: Option<f64>) -> PyResult<f64> {
        let (name, now) = (&*worker, self.clock.now(now));
        Ok(self.run(py, true, |r| r.freshness(name, now))?)
    }

    /// The router's `PrefixIndex` (shares the router's state: in approx mode its model, which
    /// Python may only read — writes raise `ReadOnlyError`; in events mode the index engine
    /// events feed).
    #[getter]
    fn index(&self, py: Python<'_>) -> Py<PyPrefixIndex> {
        self.index.clone_ref(py)
    }

    /// Events mode: the `KvEventApplier` feeding `index` (and its tier indexes) with the router's
    /// block size and hash profile; None in approx mode.
    #[getter]
    fn event_applier(&self, py: Python<'_>) -> Option<Py<PyKvEventApplier>> {
        self.applier.as_ref().map(|a| a.clone_ref(py))
    }

    /// Worker names, in the order they were added.
    #[getter]
    fn workers(&self, py: Python<'_>) -> Vec<String> {
        self.run(py, true, |r| {
            r.workers().iter().map(|w| w.name.to_string()).collect()
        })
    }

    /// The policy's name.
    #[getter]
    fn policy(&self, py: Python<'_>) -> &'static str {
        self.run(py, true, |r| r.config().policy.name())
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self, py: Python<'_>) -> usize {
        self.run(py, true, |r| r.config().block_size)
    }

    /// The block hash profile.
    #[getter]
    fn hash_profile(&self, py: Python<'_>) -> &'static str {
        self.run(py, true, |r| r.config().profile.name())
    }

    /// "approx" or "events".
    #[getter]
    fn mode(&self, py: Python<'_>) -> &'static str {
        self.run(py, true, |r| r.config().mode.name())
    }

    /// The configuration in effect, keyed like the constructor's keywords.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_dict(py, &self.run(py, true, |r| r.config().clone()))
    }

    /// Raises ValueError if the approx model's index and caches disagree (for tests).
    fn _check_model(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, false, |r| r.check_model())
            .map_err(PyValueError::new_err)
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.run(py, true, |r| r.workers().len())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        self.run(py, true, |r| {
            format!(
                "Router(workers={}, policy={:?}, index={:?}, block_size={}, hash_profile={:?})",
                r.workers().len(),
                r.config().policy.name(),
                r.config().mode.name(),
                r.config().block_size,
                r.config().profile.name()
            )
        })
    }
}
