//! The `Router` constructor's keyword conversions and `Router.config`, keyed alike.

use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyMapping};

use super::{PyRouter, APPROX_INDEX_OWNED};
use crate::py::convert::{name_item, type_error, weight_from_py, MonotonicClock};
use crate::py::events::PyKvEventApplier;
use crate::py::index::PyPrefixIndex;
use crate::router::{Config, IndexMode, Role, Router};

/// `roles={name: role}`.
pub(super) fn roles_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Vec<(String, Role)>> {
    let expected = "roles must be a mapping of worker name to role";
    named_mapping(obj, expected, "worker name in roles", |name, role| {
        let role = name_item(role, &format!("role of worker {name:?}"))?;
        role.parse::<Role>()
            .map_err(|e| PyValueError::new_err(format!("worker {name:?}: {e}")))
    })
}

/// `tier_weights={tier: weight}`.
pub(super) fn tier_weights_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Vec<(String, f64)>> {
    let expected = "tier_weights must be a mapping of tier name to weight";
    named_mapping(obj, expected, "tier name", |name, w| {
        weight_from_py(w, "tier", name)
    })
}

/// The `(name, value)` pairs of a mapping keyed by names (`key` names a key in errors,
/// `expected` says what the argument must be; `value(name, v)` converts the value of `name`).
fn named_mapping<T>(
    obj: &Bound<'_, PyAny>,
    expected: &str,
    key: &str,
    value: impl Fn(&str, &Bound<'_, PyAny>) -> PyResult<T>,
) -> PyResult<Vec<(String, T)>> {
    let map = obj
        .cast::<PyMapping>()
        .map_err(|_| type_error(obj, expected))?;
    // Keys, then each value: `items()` would build a list presized from `len()`, a claim.
    let mut out = Vec::new();
    for k in map.try_iter()? {
        let k = k?;
        let name = name_item(&k, key)?;
        let v = value(&name, &map.get_item(&k)?)?;
        out.push((name, v));
    }
    Ok(out)
}

/// `Router.config`: the configuration in effect, keyed like the constructor's keywords.
pub(super) fn config_dict<'py>(py: Python<'py>, c: &Config) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("policy", c.policy.name())?;
    d.set_item("block_size", c.block_size)?;
    d.set_item("hash_profile", c.profile.name())?;
    d.set_item("index", c.mode.name())?;
    d.set_item("capacity_blocks", c.capacity_blocks)?;
    d.set_item("ttl", c.ttl)?;
    d.set_item("queue_weight", c.weights.queue)?;
    d.set_item("decode_weight", c.weights.decode)?;
    d.set_item("load_bound", c.bound_c)?;
    d.set_item("seed", c.seed)?;
    d.set_item("stale_half_life", c.stale_half_life)?;
    let tiers = PyDict::new(py);
    for (tier, w) in &c.tier_weights {
        tiers.set_item(tier, w)?;
    }
    d.set_item("tier_weights", tiers)?;
    d.set_item("salt", c.hash_options.salt.as_deref())?;
    d.set_item("hash_seed", c.hash_options.seed.as_deref())?;
    d.set_item("event_mode", c.event_mode.name())?;
    d.set_item("updates", c.updates)?;
    let flavor = c.profile.vllm_flavor();
    d.set_item("hash_algo", flavor.map(|f| f.algo.name()))?;
    d.set_item("vllm_version", flavor.map(|f| f.version.to_string()))?;
    d.set_item("pd_threshold", c.pd.threshold)?;
    d.set_item("pd_saturation", c.pd.saturation)?;
    d.set_item("pd_local_prefill", c.pd.local_prefill)?;
    Ok(d)
}

impl PyRouter {
    /// The Python router around `core`: its index (read-only from Python in approx mode) and,
    /// in events mode, its event applier.
    pub(super) fn from_core(py: Python<'_>, mut core: Router) -> PyResult<Self> {
        let shared = core.index().clone();
        let index = Py::new(
            py,
            match core.config().mode {
                IndexMode::Events => PyPrefixIndex::from_shared(shared),
                IndexMode::Approx => PyPrefixIndex::owned_by(shared, APPROX_INDEX_OWNED),
            },
        )?;
        let applier = if core.config().mode == IndexMode::Events {
            let applier = core.new_event_applier()?;
            Some(Py::new(
                py,
                PyKvEventApplier::from_core(applier, index.clone_ref(py)),
            )?)
        } else {
            None
        };
        Ok(PyRouter {
            core: Mutex::new(core),
            index,
            applier,
            clock: MonotonicClock::new(py)?,
        })
    }
}
