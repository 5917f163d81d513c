//! `kvroute.Decision` and `kvroute.PdDecision`: read-only views of the core's decisions.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::router::{Decision, PdDecision, PdReason};

/// A routing decision: `worker`, `cached_blocks` / `cached_tokens` (expected cached prefix on
/// it, per the index), `inflight_blocks` (events mode: the prefix requests in flight there hold), `prompt_blocks` / `prompt_tokens`, `scores` (per worker, the value the policy compared:
/// the `kv_aware` cost, a load, …), `policy`, `reason`, `endpoint`, `id`, `stage`. Pass it to
/// the router's `begin`, `prefilled`, `finish` and `observe`.
#[pyclass(frozen, module = "kvroute._core", name = "Decision")]
pub struct PyDecision {
    pub(super) inner: Decision,
}

#[pymethods]
impl PyDecision {
    /// The chosen worker.
    #[getter]
    fn worker(&self) -> &str {
        &self.inner.worker
    }

    /// Leading prompt blocks the worker holds, per the router's index.
    #[getter]
    fn cached_blocks(&self) -> usize {
        self.inner.cached_blocks
    }

    /// Events mode: leading prompt blocks held by the requests in flight on the worker when
    /// routed (0 in approx mode).
    #[getter]
    fn inflight_blocks(&self) -> usize {
        self.inner.inflight_blocks
    }

    /// `cached_blocks * block_size`.
    #[getter]
    fn cached_tokens(&self) -> usize {
        self.inner.cached_tokens()
    }

    /// Full blocks of the prompt.
    #[getter]
    fn prompt_blocks(&self) -> usize {
        self.inner.prompt_blocks
    }

    /// The prompt's tokens (blocks × block size when block hashes were given).
    #[getter]
    fn prompt_tokens(&self) -> usize {
        self.inner.prompt_tokens
    }

    /// `{worker: value}`: what the policy compared (built on access).
    #[getter]
    fn scores<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, value) in self.inner.scores() {
            d.set_item(&**name, value)?;
        }
        Ok(d)
    }

    /// The policy that chose.
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy.name()
    }

    /// Why: "prefix" / "load" (kv_aware), "hash" / "hash_bounded", or the policy's name.
    #[getter]
    fn reason(&self) -> &'static str {
        self.inner.reason.name()
    }

    /// The endpoint routed for, or None.
    #[getter]
    fn endpoint(&self) -> Option<&str> {
        self.inner.endpoint.as_deref()
    }

    /// The scheduling priority to ask the engine for: the endpoint's, 0 without one (higher is
    /// served first).
    #[getter]
    fn priority(&self) -> i32 {
        self.inner.priority
    }

    /// Unique per router (1, 2, …).
    #[getter]
    fn id(&self) -> u64 {
        self.inner.id
    }

    /// "routed", "active" or "finished".
    #[getter]
    fn stage(&self) -> &'static str {
        self.inner.stage().name()
    }

    /// The part of the request: "whole", "prefill" or "decode" (halves of a `route_pd` pair).
    #[getter]
    fn half(&self) -> &'static str {
        self.inner.half.name()
    }

    fn __repr__(&self) -> String {
        format!(
            "Decision(id={}, worker={:?}, cached_tokens={}, prompt_tokens={}, policy={:?}, \
             reason={:?})",
            self.inner.id,
            &*self.inner.worker,
            self.inner.cached_tokens(),
            self.inner.prompt_tokens,
            self.inner.policy.name(),
            self.inner.reason.name()
        )
    }
}

/// A prefill/decode pair from `Router.route_pd`: `prefill` and `decode` are `Decision`s (the
/// same object when `disaggregate` is False: the whole request runs on the decode worker),
/// `reason` says why ("remote", "short", "saturated", "same_worker", "no_prefill"). Begin,
/// finish and observe each half with the router (once when they are the same).
#[pyclass(frozen, module = "kvroute._core", name = "PdDecision")]
pub struct PyPdDecision {
    prefill: Py<PyDecision>,
    decode: Py<PyDecision>,
    reason: PdReason,
}

impl PyPdDecision {
    /// The Python pair of `pair`: one `Decision` object for both halves when not disaggregated.
    pub(super) fn from_core(py: Python<'_>, pair: PdDecision) -> PyResult<Self> {
        let decode = Py::new(py, PyDecision { inner: pair.decode })?;
        let prefill = match pair.prefill {
            Some(d) => Py::new(py, PyDecision { inner: d })?,
            None => decode.clone_ref(py),
        };
        Ok(PyPdDecision {
            prefill,
            decode,
            reason: pair.reason,
        })
    }
}

#[pymethods]
impl PyPdDecision {
    /// The prefill half (the decode `Decision` itself when not disaggregated).
    #[getter]
    fn prefill(&self, py: Python<'_>) -> Py<PyDecision> {
        self.prefill.clone_ref(py)
    }

    /// The decode half (the whole request when not disaggregated).
    #[getter]
    fn decode(&self, py: Python<'_>) -> Py<PyDecision> {
        self.decode.clone_ref(py)
    }

    /// True when the prefill runs on another worker than the decode.
    #[getter]
    fn disaggregate(&self) -> bool {
        !self.prefill.is(&self.decode)
    }

    /// Why the pair is (or is not) disaggregated.
    #[getter]
    fn reason(&self) -> &'static str {
        self.reason.name()
    }

    fn __repr__(&self) -> String {
        let (p, d) = (self.prefill.get(), self.decode.get());
        format!(
            "PdDecision(prefill={:?}, decode={:?}, disaggregate={}, reason={:?})",
            &*p.inner.worker,
            &*d.inner.worker,
            if self.disaggregate() { "True" } else { "False" },
            self.reason.name()
        )
    }
}
