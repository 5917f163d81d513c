//! Bindings for `crate::index` (`kvroute.PrefixIndex`).

use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyString};

use super::convert::{
    block_hash_from_py, describe, name_from_py, type_name, u64_from_int, u64_slice, Negative,
};
use crate::index::{PrefixIndex, SharedPrefixIndex};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrefixIndex>()
}

/// Which worker holds which chained KV blocks; `match` gives, per worker, how many leading blocks
/// of a request it already holds.
///
/// Block hashes are chained (a block's hash identifies its whole prefix). A worker's blocks are
/// prefix-closed: `store(worker, hashes, parent)` needs the worker to hold `parent` (else
/// `KeyError`); a hash already stored after a different parent, or repeated, raises
/// `ValueError`; both leave the index unchanged. `remove` drops each listed block and every block
/// after it that the worker holds; unknown blocks are ignored. `len()` counts distinct blocks;
/// `num_blocks(worker)` counts one worker's blocks. `match` omits workers with 0 blocks.
/// Block hashes: NumPy uint64 arrays (borrowed, no copy), int64 arrays or ints (negative values
/// taken as their two's-complement bits), or sequences of ints.
/// `max_bytes` is a hard budget on `memory_bytes()`: least recently stored/matched leaves are
/// dropped first, and answers stay sound (never claim a block a worker does not hold).
/// `dump()` / `PrefixIndex.load(data)` copy the state as a versioned, checksummed image.
/// Safe to share between threads; the GIL is released while it works.
/// A worker's name in the core and the Python `str` made from it.
type CachedName = (Arc<str>, Py<PyString>);

#[pyclass(frozen, module = "kvroute._core", name = "PrefixIndex")]
pub struct PyPrefixIndex {
    core: SharedPrefixIndex,
    /// Python `str` of each worker name by worker id, reused by `match` (an entry is valid while
    /// its `Arc<str>` is the one the core holds for that id; ids are reused after removal).
    names: Mutex<Vec<Option<CachedName>>>,
}

impl PyPrefixIndex {
    /// A Python face for an index shared with Rust code (e.g. the router's own index).
    pub(crate) fn from_shared(core: SharedPrefixIndex) -> Self {
        PyPrefixIndex {
            core,
            names: Mutex::new(Vec::new()),
        }
    }

    /// The shared core, for Rust code that feeds or reads the same index (e.g. the event applier).
    pub(crate) fn shared(&self) -> &SharedPrefixIndex {
        &self.core
    }
}

fn budget(max_bytes: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    match max_bytes {
        None => Ok(None),
        Some(obj) if obj.is_none() => Ok(None),
        Some(obj) => {
            let v = u64_from_int(obj, "max_bytes", None)?;
            Ok(Some(usize::try_from(v).unwrap_or(usize::MAX)))
        }
    }
}

fn optional_hash(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<u64>> {
    match obj {
        Some(o) if !o.is_none() => block_hash_from_py(o, what).map(Some),
        _ => Ok(None),
    }
}

#[pymethods]
impl PyPrefixIndex {
    #[new]
    #[pyo3(signature = (*, max_bytes = None))]
    fn new(max_bytes: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let core = PrefixIndex::new(budget(max_bytes)?)?;
        Ok(PyPrefixIndex::from_shared(Arc::new(RwLock::new(core))))
    }

    /// Worker `worker` now holds the chain `block_hashes`, continuing from block `parent`.
    #[pyo3(signature = (worker, block_hashes, parent = None))]
    fn store(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let name = name_from_py(worker, "worker")?;
        let hashes = u64_slice(block_hashes, "block_hashes", Negative::Reinterpret)?;
        let parent = optional_hash(parent, "parent")?;
        let (name, slice) = (&*name, hashes.as_slice());
        py.detach(|| self.core.write().store(name, slice, parent))?;
        Ok(())
    }

    /// Worker `worker` dropped `block_hashes` (and the blocks after each); returns the number of
    /// blocks it dropped.
    fn remove(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let name = name_from_py(worker, "worker")?;
        let hashes = u64_slice(block_hashes, "block_hashes", Negative::Reinterpret)?;
        let (name, slice) = (&*name, hashes.as_slice());
        Ok(py.detach(|| self.core.write().remove(name, slice))?)
    }

    /// Worker `worker` dropped all its blocks (it stays known); returns how many.
    fn clear(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<u64> {
        let name = name_from_py(worker, "worker")?;
        let name = &*name;
        Ok(py.detach(|| self.core.write().clear(name))?)
    }

    /// Forgets worker `worker` and its blocks; returns how many blocks it held.
    fn remove_worker(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<u64> {
        let name = name_from_py(worker, "worker")?;
        let name = &*name;
        Ok(py.detach(|| self.core.write().remove_worker(name))?)
    }

    /// Per worker, how many leading blocks of `block_hashes` it holds (workers with 0 omitted).
    #[pyo3(name = "match")]
    fn match_<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let hashes = u64_slice(block_hashes, "block_hashes", Negative::Reinterpret)?;
        let slice = hashes.as_slice();
        let found = py.detach(|| {
            let core = self.core.read();
            let mut ids = Vec::new();
            core.match_into(slice, &mut ids);
            ids.into_iter()
                .filter_map(|(w, n)| core.worker_name_arc(w).map(|name| (w, name, n)))
                .collect::<Vec<_>>()
        });
        let out = PyDict::new(py);
        let mut cache = self.names.lock();
        for (id, name, blocks) in found {
            let slot = id as usize;
            if cache.len() <= slot {
                cache.resize_with(slot + 1, || None);
            }
            let Some(entry) = cache.get_mut(slot) else {
                continue;
            };
            let key = match entry {
                Some((cached, obj)) if Arc::ptr_eq(cached, &name) => obj.bind(py).clone(),
                _ => {
                    let obj = PyString::intern(py, &name);
                    *entry = Some((name, obj.clone().unbind()));
                    obj
                }
            };
            out.set_item(key, blocks)?;
        }
        Ok(out)
    }

    /// Names of the known workers, sorted.
    #[getter]
    fn workers(&self) -> Vec<String> {
        self.core
            .read()
            .workers()
            .iter()
            .map(|n| n.to_string())
            .collect()
    }

    /// Number of blocks `worker` holds (`KeyError` if unknown).
    fn num_blocks(&self, worker: &Bound<'_, PyAny>) -> PyResult<u64> {
        let name = name_from_py(worker, "worker")?;
        Ok(self.core.read().num_blocks(&name)?)
    }

    /// Number of distinct blocks held by at least one worker.
    fn __len__(&self) -> usize {
        self.core.read().len()
    }

    /// True when some worker holds block `block_hash`.
    fn __contains__(&self, block_hash: &Bound<'_, PyAny>) -> PyResult<bool> {
        let h = block_hash_from_py(block_hash, "block_hash")?;
        Ok(self.core.read().contains(h))
    }

    /// Heap bytes of the whole structure (what `max_bytes` bounds).
    fn memory_bytes(&self) -> usize {
        self.core.read().memory_bytes()
    }

    /// The memory budget given at construction, or None.
    #[getter]
    fn max_bytes(&self) -> Option<usize> {
        self.core.read().max_bytes()
    }

    /// Number of radix-tree nodes (runs of blocks with the same workers); a function of the
    /// stored state alone, since nodes merge back when a split stops being needed.
    fn num_nodes(&self) -> usize {
        self.core.read().num_nodes()
    }

    /// The index as a versioned, checksummed binary image.
    fn dump<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let image = py.detach(|| self.core.read().dump());
        PyBytes::new(py, &image)
    }

    /// An index rebuilt from `dump()` output; `ValueError` for a bad image.
    #[staticmethod]
    #[pyo3(signature = (data, *, max_bytes = None))]
    fn load(
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        max_bytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let max_bytes = budget(max_bytes)?;
        let core = if let Ok(b) = data.cast::<PyBytes>() {
            let bytes = b.as_bytes();
            py.detach(|| PrefixIndex::load(bytes, max_bytes))?
        } else if let Ok(b) = data.cast::<PyByteArray>() {
            let bytes = b.to_vec();
            py.detach(|| PrefixIndex::load(&bytes, max_bytes))?
        } else {
            return Err(PyTypeError::new_err(format!(
                "data must be bytes, got {} {}",
                type_name(data),
                describe(data)
            )));
        };
        Ok(PyPrefixIndex::from_shared(Arc::new(RwLock::new(core))))
    }

    /// Raises ValueError if an internal invariant is broken (for tests).
    fn _check_invariants(&self) -> PyResult<()> {
        self.core
            .read()
            .check_invariants()
            .map_err(PyValueError::new_err)
    }

    fn __repr__(&self) -> String {
        let core = self.core.read();
        format!(
            "PrefixIndex(workers={}, blocks={}, nodes={}, memory_bytes={})",
            core.num_workers(),
            core.len(),
            core.num_nodes(),
            core.memory_bytes()
        )
    }
}
