//! The `Router` constructor's keyword conversions and `Router.config`, keyed alike.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{PyRouter, APPROX_INDEX_OWNED};
use crate::py::convert::{name_item, type_error, MonotonicClock};
use crate::py::events::PyKvEventApplier;
use crate::py::index::PyPrefixIndex;
use crate::router::{Config, IndexMode, Role, Router};

/// `roles={name: role}`.
pub(super) fn roles_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Vec<(String, Role)>> {
    let dict = obj
        .cast::<PyDict>()
        .map_err(|_| type_error(obj, "roles must be a dict of worker name to role"))?;
    let mut out = Vec::with_capacity(dict.len());
    for (name, role) in dict.iter() {
        let name = name_item(&name, "worker name in roles")?;
        let role: String = role.extract()?;
        out.push((name, role.parse::<Role>()?));
    }
    Ok(out)
}

/// `tier_weights={tier: weight}`.
pub(super) fn tier_weights_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Vec<(String, f64)>> {
    let dict = obj
        .cast::<PyDict>()
        .map_err(|_| type_error(obj, "tier_weights must be a dict of tier name to weight"))?;
    let mut out = Vec::with_capacity(dict.len());
    for (tier, w) in dict.iter() {
        let tier = name_item(&tier, "tier name")?;
        let w: f64 = w.extract()?;
        out.push((tier, w));
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
