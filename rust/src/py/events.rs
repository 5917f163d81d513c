//! Bindings for `crate::events`: `kvroute.KvEventApplier` and `kvroute.decode_kv_events`.
//!
//! The applier's state sits behind a `parking_lot::Mutex`; `apply` copies nothing from a `bytes`
//! payload, releases the GIL, then takes the applier lock (and, per event, the index lock).
//! Reads of the applier's state take its lock with the GIL held only when it is free.

use parking_lot::Mutex;
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use super::convert::{as_int, describe, name_item, usize_from_int, with_bytes, Name};
use super::index::PyPrefixIndex;
use super::with_mutex;
use crate::blocks::Profile;
use crate::events::{Applier, Batch, Config, Decoder, EventKind, Mode, WorkerCounters};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvEventApplier>()?;
    m.add_function(wrap_pyfunction!(decode_kv_events, m)?)?;
    Ok(())
}

fn counters_dict<'py>(py: Python<'py>, c: &WorkerCounters) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let WorkerCounters {
        batches,
        malformed,
        events,
        stored_events,
        removed_events,
        cleared_events,
        blocks_stored,
        blocks_removed,
        skipped_unknown_parent,
        skipped_partial,
        skipped_block_size,
        skipped_unsupported,
        skipped_other_group,
        skipped_unknown_type,
        index_rejected,
        resets,
        foreign_hashes,
        engine_block_size,
    } = *c;
    for (k, v) in [
        ("batches", batches),
        ("malformed", malformed),
        ("events", events),
        ("stored_events", stored_events),
        ("removed_events", removed_events),
        ("cleared_events", cleared_events),
        ("blocks_stored", blocks_stored),
        ("blocks_removed", blocks_removed),
        ("skipped_unknown_parent", skipped_unknown_parent),
        ("skipped_partial", skipped_partial),
        ("skipped_block_size", skipped_block_size),
        ("skipped_unsupported", skipped_unsupported),
        ("skipped_other_group", skipped_other_group),
        ("skipped_unknown_type", skipped_unknown_type),
        ("index_rejected", index_rejected),
        ("resets", resets),
        ("foreign_hashes", foreign_hashes),
        ("engine_block_size", engine_block_size),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// Applies engine KV-event payloads (vLLM / SGLang msgpack), per worker, to a `PrefixIndex`.
///
/// `mode="rehash"` (default) recomputes the router's own block hashes from each event's tokens
/// with a `BlockHasher(block_size, profile=hash_profile, seed=seed, hash_algo=hash_algo,
/// vllm_version=vllm_version)`, chained from the parent's
/// state, and keeps an engine-hash → own-hash map per worker for removals; `mode="direct"` stores
/// the engine's hashes as they are. Events on a `medium` other than the GPU go to a separate
/// index per tier (`tier_index(medium)`). Only KV-cache group `group_idx` is followed.
/// `apply` raises `ValueError` for a malformed payload, which then changes nothing (it is
/// counted as `malformed`); events that cannot be placed exactly are skipped and counted.
/// An index that is read-only from Python (the router's approx model) raises `ReadOnlyError`.
#[pyclass(frozen, module = "kvroute._core", name = "KvEventApplier")]
pub struct PyKvEventApplier {
    core: Mutex<Applier>,
    index: Py<PyPrefixIndex>,
}

impl PyKvEventApplier {
    /// A Python face for an applier built in Rust (the router's own, over its index).
    pub(crate) fn from_core(core: Applier, index: Py<PyPrefixIndex>) -> Self {
        PyKvEventApplier {
            core: Mutex::new(core),
            index,
        }
    }

    /// Runs `f` on the applier: with the GIL held when `short` and the lock is free, else with
    /// the GIL released.
    fn run<R: Send>(
        &self,
        py: Python<'_>,
        short: bool,
        f: impl FnOnce(&mut Applier) -> R + Send,
    ) -> R {
        with_mutex(py, &self.core, short, f)
    }
}

/// The `block_size` argument (a count: see `usize_from_int`).
fn block_size_arg(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    usize_from_int(obj, "block_size")
}

/// The `group_idx` argument: an integer (see `as_int`) in -2**63..2**63-1.
fn group_idx_arg(obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    as_int(obj, &|| "group_idx".to_owned())?
        .extract::<i64>()
        .map_err(|_| {
            PyValueError::new_err(format!(
                "group_idx = {} is outside -2**63..2**63-1",
                describe(obj)
            ))
        })
}

#[pymethods]
impl PyKvEventApplier {
    #[new]
    #[pyo3(signature = (index, *, mode = "rehash", block_size = 16, hash_profile = "native", seed = None, group_idx = 0, hash_algo = None, vllm_version = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        index: Bound<'_, PyPrefixIndex>,
        mode: &str,
        #[pyo3(from_py_with = block_size_arg)] block_size: usize,
        hash_profile: &str,
        seed: Option<String>,
        #[pyo3(from_py_with = group_idx_arg)] group_idx: i64,
        hash_algo: Option<Name<'_>>,
        vllm_version: Option<Name<'_>>,
    ) -> PyResult<Self> {
        // An applier writes its index: one another object owns (the router's approx model) is
        // refused as any write from Python is, before anything is built.
        index.get().writable()?;
        let config = Config {
            mode: mode.parse::<Mode>()?,
            block_size,
            profile: hash_profile
                .parse::<Profile>()?
                .with_vllm(hash_algo.as_deref(), vllm_version.as_deref())?,
            seed,
            group_idx,
        };
        let core = Applier::new(index.get().shared().clone(), config)?;
        Ok(PyKvEventApplier::from_core(core, index.unbind()))
    }

    /// Decodes `payload` (one msgpack event batch from `worker`) and applies it; returns the
    /// number of events. `ValueError` for a malformed payload (nothing changes).
    fn apply(
        &self,
        py: Python<'_>,
        worker: Name<'_>,
        payload: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let name = &*worker;
        let out = with_bytes(payload, "payload", |bytes| {
            self.run(py, false, |a| a.apply(name, bytes))
        })??;
        Ok(out.events)
    }

    /// Forgets every block of `worker` in every tier (after an unrecoverable sequence gap or an
    /// engine restart); counted as a reset.
    fn clear(&self, py: Python<'_>, worker: Name<'_>) -> PyResult<()> {
        let name = &*worker;
        self.run(py, false, |a| a.clear_worker(name));
        Ok(())
    }

    /// Clears `worker`, drops it from the tier indexes and forgets its counters (it stays in the
    /// main index, whose owner decides membership). Returns whether it was known.
    fn remove_worker(&self, py: Python<'_>, worker: Name<'_>) -> PyResult<bool> {
        let name = &*worker;
        Ok(self.run(py, false, |a| a.remove_worker(name)))
    }

    /// Counters of `worker` (a dict of ints), or of every worker (a dict of such dicts).
    /// `KeyError` for an unknown worker.
    #[pyo3(signature = (worker = None))]
    fn stats<'py>(
        &self,
        py: Python<'py>,
        worker: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        match worker {
            Some(w) => {
                let name = name_item(w, "worker")?;
                let name = &*name;
                match self.run(py, true, |a| a.counters(name)) {
                    Some(c) => counters_dict(py, &c),
                    None => Err(PyKeyError::new_err(format!("unknown worker {name:?}"))),
                }
            }
            None => {
                let all: Vec<(String, WorkerCounters)> = self.run(py, true, |a| {
                    a.workers()
                        .into_iter()
                        .filter_map(|w| a.counters(w).map(|c| (w.to_owned(), c)))
                        .collect()
                });
                let out = PyDict::new(py);
                for (name, c) in all {
                    out.set_item(name, counters_dict(py, &c)?)?;
                }
                Ok(out)
            }
        }
    }

    /// Workers that sent at least one payload, sorted.
    #[getter]
    fn workers(&self, py: Python<'_>) -> Vec<String> {
        self.run(py, true, |a| {
            a.workers().into_iter().map(str::to_owned).collect()
        })
    }

    /// The main (GPU) index.
    #[getter]
    fn index(&self, py: Python<'_>) -> Py<PyPrefixIndex> {
        self.index.clone_ref(py)
    }

    /// The index of tier `medium` (e.g. "CPU"); "GPU" gives the main index; None if never seen.
    fn tier_index(&self, py: Python<'_>, medium: &str) -> PyResult<Option<Py<PyPrefixIndex>>> {
        if medium == crate::events::GPU {
            return Ok(Some(self.index.clone_ref(py)));
        }
        let shared = self.run(py, true, |a| a.tier_index(medium));
        shared
            .map(|s| Py::new(py, PyPrefixIndex::from_shared(s)))
            .transpose()
    }

    /// Names of the non-GPU tiers seen so far, in order of appearance.
    #[getter]
    fn tiers(&self, py: Python<'_>) -> Vec<String> {
        self.run(py, true, |a| {
            a.tiers().iter().map(|t| t.to_string()).collect()
        })
    }

    /// "rehash" or "direct".
    #[getter]
    fn mode(&self, py: Python<'_>) -> &'static str {
        self.run(py, true, |a| a.config().mode.name())
    }

    /// The router's block size in tokens.
    #[getter]
    fn block_size(&self, py: Python<'_>) -> usize {
        self.run(py, true, |a| a.config().block_size)
    }

    /// The router's hash profile.
    #[getter]
    fn hash_profile(&self, py: Python<'_>) -> &'static str {
        self.run(py, true, |a| a.config().profile.name())
    }

    /// The KV-cache group followed.
    #[getter]
    fn group_idx(&self, py: Python<'_>) -> i64 {
        self.run(py, true, |a| a.config().group_idx)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        self.run(py, true, |a| {
            let c = a.config();
            format!(
                "KvEventApplier(mode={:?}, block_size={}, hash_profile={:?}, workers={})",
                c.mode.name(),
                c.block_size,
                c.profile.name(),
                a.workers().len()
            )
        })
    }
}

/// Decodes one KV-event payload into Python objects (for inspection and tests):
/// `(ts, events, data_parallel_rank)`, each event a dict with every field the decoder reads.
/// `ValueError` for a malformed payload.
#[pyfunction]
fn decode_kv_events<'py>(
    py: Python<'py>,
    payload: &Bound<'py, PyAny>,
) -> PyResult<(f64, Bound<'py, PyList>, Option<i64>)> {
    with_bytes(payload, "payload", |bytes| {
        let mut batch = Batch::default();
        Decoder::new().decode(bytes, &mut batch)?;
        let events = PyList::empty(py);
        for e in batch.events(bytes) {
            let d = PyDict::new(py);
            d.set_item("type", e.type_name)?;
            let known = matches!(e.kind, EventKind::Stored | EventKind::Removed);
            if known {
                d.set_item("block_hashes", e.block_hashes.to_vec())?;
                d.set_item("medium", e.medium)?;
                d.set_item("group_idx", e.group_idx)?;
            }
            if e.kind == EventKind::Stored {
                d.set_item("parent_block_hash", e.parent)?;
                d.set_item("token_ids", e.token_ids.to_vec())?;
                d.set_item("tokens_fit_u32", e.tokens_fit_u32)?;
                d.set_item("block_size", e.block_size)?;
                d.set_item("lora_id", e.lora_id)?;
                d.set_item("lora_name", e.lora_name)?;
                d.set_item("cache_salt", e.cache_salt)?;
                let extra = e.extra_keys.raw().map(|b| PyBytes::new(py, b));
                d.set_item("extra_keys", extra)?;
                let summary = e.extra_keys.summary(e.lora_name);
                d.set_item("extra_salt", summary.salt)?;
                d.set_item("extra_unsupported", summary.unsupported)?;
                d.set_item("has_lookahead", e.has_lookahead)?;
            }
            events.append(d)?;
        }
        Ok((batch.ts, events, batch.dp_rank))
    })?
}
