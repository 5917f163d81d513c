//! Bindings for `crate::hashing`: `hash_key`, `jump_hash`, `jump_hash_many` and the hasher
//! classes `HashRing`, `Maglev`, `Rendezvous` and `JumpHash`, which share one Python face.
//!
//! Each class keeps its core hasher in a [`Published`]: a change (`add`, `remove`) makes a new
//! hasher with the GIL released and publishes it whole. `get` reads the hasher in place with the
//! GIL held, taking no lock; other lookups take its read lock, with the GIL held for fewer than
//! [`DETACH_MIN_KEYS`] keys when the lock is free, else with the GIL released. Results come back
//! as node ids plus the node names they refer to, and are turned into Python `str` objects from a
//! per-object cache that creates each node's `str` once.
//!
//! `HashRing.get_many` on an exact list or tuple reads each key where it lies, hashes it and looks
//! it up with the GIL held (released between chunks, see [`Seq::lookup_keys`]), all against one
//! snapshot of the ring ([`Published::snapshot`]): the keys are never copied.

use std::sync::Arc;

use hashbrown::HashMap;
use numpy::{PyArray1, PyUntypedArray};
use parking_lot::Mutex;
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyInt, PyList, PyMapping, PyString};

use super::convert::{
    as_int, describe, int_to_u64, name_item, optional, type_error, u64_from_int, u64_slice,
    weight_from_py, weighted_names, Name, Negative,
};
use super::direct_call;
use super::gil::Published;
use super::in_place::{set_new_list_item, Seq};
use super::keys::{with_key, KeyBatch};
use super::names::NameCache;
use crate::hashing::{self, ConsistentHash, Key, NodeId, RingBatch, RingHash, SeenNodes};

/// Batches at least this long are hashed and looked up with the GIL released (but for a ring's
/// list or tuple, whose keys are read, hashed and looked up in chunks with the GIL held: see
/// [`Seq::lookup_keys`]).
const DETACH_MIN_KEYS: usize = 64;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(hash_key, m)?)?;
    direct_call::add_function(
        m,
        c"jump_hash",
        JUMP_HASH_DOC,
        jump_hash_direct,
        wrap_pyfunction!(jump_hash, m)?.into_any(),
        &JUMP_HASH,
    )?;
    m.add_function(wrap_pyfunction!(jump_hash_many, m)?)?;
    m.add_class::<HashRing>()?;
    direct_call::add_method(
        &m.py().get_type::<HashRing>(),
        c"get",
        ring_get_direct,
        &RING_GET,
    )?;
    m.add_class::<Maglev>()?;
    m.add_class::<Rendezvous>()?;
    m.add_class::<JumpHash>()?;
    Ok(())
}

/// The `num_buckets` argument: an integer in 1..2**31-1.
fn num_buckets_u32(num_buckets: &Bound<'_, PyAny>) -> PyResult<u32> {
    let n = int_arg(num_buckets, "num_buckets", "in 1..2**31-1", |n| {
        (1..=i64::from(i32::MAX)).contains(&n)
    })?;
    Ok(n as u32)
}

/// Stable 64-bit hash of a key: XXH3-64, seed 0, over a str's UTF-8 bytes, bytes as given, or an
/// int's 8 little-endian bytes.
#[pyfunction]
fn hash_key(key: &Bound<'_, PyAny>) -> PyResult<u64> {
    with_key(key, |k| k.hash64())
}

/// Lamping-Veach jump consistent hash of the 64-bit int ``key`` into ``0..num_buckets``.
#[pyfunction]
fn jump_hash(key: &Bound<'_, PyAny>, num_buckets: &Bound<'_, PyAny>) -> PyResult<u32> {
    jump_hash_of(key, num_buckets)
}

/// The PyO3 `jump_hash`, which the direct function forwards to off its fast path.
static JUMP_HASH: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

const JUMP_HASH_DOC: &std::ffi::CStr = c"jump_hash($module, key, num_buckets)
--

Lamping-Veach jump consistent hash of the 64-bit int ``key`` into ``0..num_buckets``.";

/// `jump_hash` as CPython calls it (see [`direct_call`]): two positional exact ints in range
/// are hashed here; any other call goes to the PyO3 function.
unsafe extern "C" fn jump_hash_direct(
    _module: *mut pyo3::ffi::PyObject,
    args: *const *mut pyo3::ffi::PyObject,
    nargs: pyo3::ffi::Py_ssize_t,
    kwnames: *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject {
    use pyo3::ffi;
    if nargs == 2 && kwnames.is_null() {
        // SAFETY: CPython passes `nargs` live positional arguments; the GIL is held.
        unsafe {
            let (key, n) = (*args, *args.add(1));
            let int = std::ptr::addr_of_mut!(ffi::PyLong_Type);
            if ffi::Py_TYPE(key) == int && ffi::Py_TYPE(n) == int {
                return jump_hash_ints(key, n, args);
            }
        }
    }
    // SAFETY: called by CPython with these arguments unchanged.
    unsafe { direct_call::forward(&JUMP_HASH, args, nargs, kwnames) }
}

/// The fast path of [`jump_hash_direct`] for two exact ints (a function of its own, so that the
/// type checks before it save no registers): hashed here when both are in range, else forwarded
/// as the two positional arguments they are.
///
/// # Safety
/// `key` and `n` are live exact ints, `args` CPython's two positional arguments; GIL held.
#[inline(never)]
unsafe fn jump_hash_ints(
    key: *mut pyo3::ffi::PyObject,
    n: *mut pyo3::ffi::PyObject,
    args: *const *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject {
    // SAFETY: the caller's contract; a failed conversion clears its error (`int_to_u64`).
    unsafe {
        if let Some(k) = int_to_u64(key) {
            if let Some(n @ 1..=0x7fff_ffff) = int_to_u64(n) {
                let bucket = hashing::jump_hash(k, n as u32);
                return pyo3::ffi::PyLong_FromUnsignedLong(std::os::raw::c_ulong::from(bucket));
            }
        }
        direct_call::forward(&JUMP_HASH, args, 2, std::ptr::null_mut())
    }
}

/// The PyO3 `HashRing.get`, which the direct method forwards to off its fast path.
static RING_GET: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// `HashRing.get` as CPython calls it (see [`direct_call`]): one positional argument on a
/// `HashRing` is looked up here, by the code the PyO3 method runs (so with its errors); any other
/// call goes to the PyO3 method. Skips PyO3's trampoline and argument binder: about half the
/// instructions of a call on the XXH3 ring.
unsafe extern "C" fn ring_get_direct(
    slf: *mut pyo3::ffi::PyObject,
    args: *const *mut pyo3::ffi::PyObject,
    nargs: pyo3::ffi::Py_ssize_t,
    kwnames: *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject {
    if nargs == 1 && kwnames.is_null() {
        // SAFETY: CPython calls a method with the GIL held, `self` and the `nargs` positional
        // arguments live for the call.
        let (py, slf, key) = unsafe {
            let py = Python::assume_attached();
            let (slf, key) = (
                Borrowed::from_ptr_or_opt(py, slf),
                Borrowed::from_ptr_or_opt(py, *args),
            );
            (py, slf, key)
        };
        if let (Some(slf), Some(key)) = (slf, key) {
            if let Ok(ring) = slf.cast_exact::<HashRing>() {
                return direct_call::returned(py, || ring.get().inner.get(py, &key));
            }
        }
    }
    // SAFETY: called by CPython with these arguments unchanged.
    unsafe { direct_call::forward_method(&RING_GET, slf, args, nargs, kwnames) }
}

/// Jump hash of a Python `key` into `num_buckets`, validating both.
fn jump_hash_of(key: &Bound<'_, PyAny>, num_buckets: &Bound<'_, PyAny>) -> PyResult<u32> {
    // Fast path: both arguments exact ints in range (a type comparison and one conversion each).
    if key.is_exact_instance_of::<PyInt>() && num_buckets.is_exact_instance_of::<PyInt>() {
        // SAFETY: both objects are live `int`s and the GIL is held.
        let (k, n) = unsafe { (int_to_u64(key.as_ptr()), int_to_u64(num_buckets.as_ptr())) };
        // Out of range: the slow path below raises the precise error.
        if let (Some(k), Some(n @ 1..=0x7fff_ffff)) = (k, n) {
            return Ok(hashing::jump_hash(k, n as u32));
        }
    }
    let n = num_buckets_u32(num_buckets)?;
    let k = u64_from_int(key, "key", None)?;
    Ok(hashing::jump_hash(k, n))
}

/// Jump consistent hash of every key of a uint64 array (or sequence of ints); returns int64 buckets.
#[pyfunction]
fn jump_hash_many<'py>(
    py: Python<'py>,
    keys: &Bound<'py, PyAny>,
    num_buckets: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let n = num_buckets_u32(num_buckets)?;
    let keys = u64_slice(keys, "keys", Negative::Reject)?;
    let slice = keys.as_slice();
    let mut out: Vec<i64> = Vec::new();
    if slice.len() >= DETACH_MIN_KEYS {
        py.detach(|| hashing::jump_hash_many_into(slice, n, &mut out));
    } else {
        hashing::jump_hash_many_into(slice, n, &mut out);
    }
    Ok(PyArray1::from_vec(py, out))
}

/// An integer argument (see `as_int`: `bool` refused with `TypeError`) as `i64`, saturated
/// beyond its range, when `ok` accepts it; else `ValueError` "{what} must be {expected}, got
/// {the value given}" (never the saturated one).
fn int_arg(
    obj: &Bound<'_, PyAny>,
    what: &str,
    expected: &str,
    ok: impl Fn(i64) -> bool,
) -> PyResult<i64> {
    let int = as_int(obj, &|| what.to_owned())?;
    // Beyond i64 the extraction fails: saturated, so that `ok` still decides (a count can
    // be "as many as there are"); comparing an int with 0 cannot fail.
    let v = int.extract::<i64>().unwrap_or_else(|_| {
        if int.lt(0i64).unwrap_or(false) {
            i64::MIN
        } else {
            i64::MAX
        }
    });
    if ok(v) {
        return Ok(v);
    }
    Err(PyValueError::new_err(format!(
        "{what} must be {expected}, got {}",
        describe(obj)
    )))
}

/// `(name, weight)` pairs from `nodes` (an iterable of str, or a `{node: weight}` mapping) and an
/// optional `weights` (a `{node: weight}` mapping or a sequence parallel to `nodes`).
fn node_pairs(
    nodes: &Bound<'_, PyAny>,
    weights: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<(String, f64)>> {
    if weights.is_some() && nodes.cast::<PyMapping>().is_ok() {
        return Err(PyValueError::new_err(
            "give weights in the nodes mapping or as weights=, not both",
        ));
    }
    let mut pairs = weighted_names(nodes, "nodes", "node")?;
    let Some(weights) = weights else {
        return Ok(pairs);
    };
    if let Ok(map) = weights.cast::<PyMapping>() {
        let at: HashMap<String, usize> = pairs
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.clone(), i))
            .collect();
        for item in map.items()?.iter() {
            let (name, weight): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
            let name = name_item(&name, "weights key")?;
            let i = at.get(&*name).copied().ok_or_else(|| {
                PyKeyError::new_err(format!("weights name unknown node {name:?}"))
            })?;
            let weight = weight_from_py(&weight, "node", &name)?;
            if let Some(pair) = pairs.get_mut(i) {
                pair.1 = weight;
            }
        }
        return Ok(pairs);
    }
    let values: Vec<Bound<'_, PyAny>> = weights
        .try_iter()
        .map_err(|_| type_error(weights, "weights must be a sequence or a mapping"))?
        .collect::<PyResult<_>>()?;
    if values.len() != pairs.len() {
        return Err(PyValueError::new_err(format!(
            "{} weights given for {} nodes",
            values.len(),
            pairs.len()
        )));
    }
    for (pair, w) in pairs.iter_mut().zip(&values) {
        pair.1 = weight_from_py(w, "node", &pair.0)?;
    }
    Ok(pairs)
}

/// The distinct ids of `ids` with their names (every node's when `ids` is longer than the node
/// list: cheaper than finding the distinct ones, and [`Shared::list`] fails on an id left
/// without a name); fails if an id has no node (an internal error).
fn names_of<H: ConsistentHash>(h: &H, ids: &[NodeId]) -> crate::Result<Names> {
    if ids.len() > h.len() {
        return Ok(all_names(h));
    }
    let mut seen = SeenNodes::new(h.len());
    ids.iter()
        .filter(|&&id| seen.insert(id) || id as usize >= h.len())
        .map(|&id| {
            h.name(id)
                .map(|n| (id, Arc::clone(n)))
                .ok_or_else(|| crate::Error::Value(format!("internal error: no node {id}")))
        })
        .collect()
}

/// Node ids with their names.
type Names = Vec<(NodeId, Arc<str>)>;

/// Every node with its name, in insertion order (the order of `nodes`).
fn all_names<H: ConsistentHash>(h: &H) -> Names {
    let set = h.node_set();
    set.in_order()
        .filter_map(|id| set.name(id).map(|n| (id, Arc::clone(n))))
        .collect()
}

/// The nodes in insertion order (the order of `nodes`), and the position there of each id of
/// `ids`; fails if an id has no node (an internal error).
fn positions_of<H: ConsistentHash>(h: &H, ids: &[NodeId]) -> crate::Result<(Names, Vec<u32>)> {
    let order = all_names(h);
    let slots = order.iter().map(|(id, _)| *id as usize + 1).max();
    let mut position = vec![u32::MAX; slots.unwrap_or(0)];
    for (at, (id, _)) in (0u32..).zip(&order) {
        if let Some(slot) = position.get_mut(*id as usize) {
            *slot = at;
        }
    }
    let at = ids
        .iter()
        .map(|&id| {
            position
                .get(id as usize)
                .copied()
                .filter(|&at| at != u32::MAX)
                .ok_or_else(|| crate::Error::Value(format!("internal error: no node {id}")))
        })
        .collect::<crate::Result<Vec<u32>>>()?;
    Ok((order, at))
}

/// Buffers reused across batch calls on one object (avoids re-faulting fresh pages per call).
#[derive(Default)]
struct Scratch {
    keys: KeyBatch,
    ids: Vec<NodeId>,
}

impl Scratch {
    /// Buffers above this size are dropped after use rather than kept.
    const KEEP_BYTES: usize = 64 << 20;

    fn trim(&mut self) {
        let bytes = self.keys.capacity_bytes();
        if bytes + self.ids.capacity() * 4 > Self::KEEP_BYTES {
            *self = Self::default();
        }
    }
}

/// The ring a hasher is, for batches looked up as their keys are read (see [`Seq::lookup_keys`]).
trait AsRing {
    fn as_ring(&self) -> Option<&hashing::HashRing> {
        None
    }
}

impl AsRing for hashing::HashRing {
    fn as_ring(&self) -> Option<&hashing::HashRing> {
        Some(self)
    }
}

impl AsRing for hashing::Maglev {}
impl AsRing for hashing::Rendezvous {}
impl AsRing for hashing::JumpHash {}

/// A core hasher shared between Python threads, with its name cache.
struct Shared<H> {
    core: Published<H>,
    names: NameCache,
    /// Taken with `try_lock` only: a concurrent batch uses fresh buffers instead of waiting.
    scratch: Mutex<Scratch>,
}

impl<H: ConsistentHash + AsRing + Clone + Send + Sync> Shared<H> {
    fn new(core: H) -> Self {
        Self {
            core: Published::new(core),
            names: NameCache::default(),
            scratch: Mutex::new(Scratch::default()),
        }
    }

    /// Runs read-only work on `keys` keys (lookups on one key last well under a microsecond).
    fn read<R: Send>(&self, py: Python<'_>, keys: usize, f: impl FnOnce(&H) -> R + Send) -> R {
        self.core.read(py, keys < DETACH_MIN_KEYS, f)
    }

    /// Replaces the hasher with `f(hasher)` when it succeeds.
    fn replace(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&H) -> crate::Result<H> + Send,
    ) -> crate::Result<()> {
        self.core.replace(py, f)
    }

    /// A list of the `str` of every id in `ids`; `names` holds the name of each distinct id
    /// (see [`names_of`]). Fails (an internal error) on an id with no name there.
    fn list<'py>(
        &self,
        py: Python<'py>,
        ids: &[NodeId],
        names: &[(NodeId, Arc<str>)],
    ) -> PyResult<Bound<'py, PyList>> {
        let len = names
            .iter()
            .map(|(id, _)| *id as usize + 1)
            .max()
            .unwrap_or(0);
        let mut strs: Vec<Option<Bound<'py, PyString>>> = vec![None; len];
        let mut cache = self.names.view(py);
        for (id, name) in names {
            if let Some(dest) = strs.get_mut(*id as usize) {
                *dest = Some(cache.get(py, *id, name));
            }
        }
        drop(cache);
        // Sized once. Appending (one C-API call per item where this makes two) grows the list by
        // reallocation, which copies the array whenever it cannot grow in place; alone it was
        // ~0.5 ns per key faster, inside pytest-benchmark no difference rose above the noise.
        let n = pyo3::ffi::Py_ssize_t::try_from(ids.len())
            .map_err(|_| PyValueError::new_err("too many keys"))?;
        // SAFETY: the GIL is held and no Python code runs below. The new list is ours alone
        // until returned (or dropped on error, its unset slots NULL, which dealloc skips); each
        // slot is set once, to a live `str` given the new reference the list takes.
        let list = unsafe { Bound::from_owned_ptr_or_err(py, pyo3::ffi::PyList_New(n))? };
        for (i, &id) in (0..n).zip(ids) {
            let s = strs
                .get(id as usize)
                .and_then(Option::as_ref)
                .ok_or_else(|| PyRuntimeError::new_err(format!("internal error: no node {id}")))?;
            // SAFETY: as above.
            unsafe { set_new_list_item(list.as_ptr(), i, s.clone().into_ptr()) };
        }
        // SAFETY: made by `PyList_New`.
        Ok(unsafe { list.cast_into_unchecked::<PyList>() })
    }

    /// Inlined into its two callers (the direct method and the PyO3 one): returned from a call,
    /// the `PyResult` came back through memory, read wider than it was written (a store-forwarding
    /// stall per call). Takes no lock (see [`Published`], [`NameCache`]).
    #[inline(always)]
    fn get<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
        with_key(key, |k| {
            // SAFETY: the lookup is Rust; then at most a `str` is made and one replaced in the
            // cache (no Python code runs, the GIL is kept).
            unsafe {
                self.core.attached(py, |h| {
                    let id = h.get(k)?;
                    let name = h.name(id).ok_or_else(|| {
                        PyRuntimeError::new_err(format!("internal error: no node {id}"))
                    })?;
                    Ok(self.names.view(py).get(py, id, name))
                })
            }
        })?
    }

    fn get_many<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        as_index: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut guard = self.scratch.try_lock();
        let mut own = Scratch::default();
        let scratch: &mut Scratch = guard.as_deref_mut().unwrap_or(&mut own);
        let Scratch { keys: batch, ids } = scratch;
        // The names of the ids (a list), or each id's position among the nodes and the nodes in
        // that order (`as_index`), read from the version of the hasher the lookups ran on.
        let finish = |h: &H, ids: &[NodeId]| match as_index {
            false => names_of(h, ids).map(|names| (names, None)),
            true => positions_of(h, ids).map(|(order, at)| (order, Some(at))),
        };
        // A list or tuple first: asking whether an object is a NumPy array imports NumPy (~45 ms
        // on a process's first batch).
        let seq = Seq::of(keys);
        let (names, positions) = if let Some((seq, h)) = self.ring_seq(py, seq) {
            // One ring for the whole batch, though the GIL is released between chunks of keys.
            let ring = h.as_ring().ok_or_else(|| {
                crate::Error::Value("internal error: the hasher is no ring".to_owned())
            })?;
            ids.clear();
            seq.lookup_keys(&mut RingBatch::new(ring)?, ids)?;
            finish(&h, ids)
        } else if seq.is_none() && keys.cast::<PyUntypedArray>().is_ok() {
            let values = u64_slice(keys, "keys", Negative::Reject)?;
            let values = values.as_slice();
            self.read(py, values.len(), |h| {
                h.get_many_into(values.iter().map(|&k| Key::Int(k)), ids)?;
                finish(h, ids)
            })
        } else {
            batch.refill(keys)?;
            let batch = &*batch;
            self.read(py, batch.len(), |h| {
                h.get_many_into(batch.iter(), ids)?;
                finish(h, ids)
            })
        }?;
        let out = match positions {
            None => self.list(py, ids, &names).map(Bound::into_any),
            Some(at) => {
                let order: Vec<NodeId> = names.iter().map(|(id, _)| *id).collect();
                let nodes = self.list(py, &order, &names)?;
                (PyArray1::from_vec(py, at), nodes)
                    .into_pyobject(py)
                    .map(Bound::into_any)
            }
        };
        scratch.trim();
        out
    }

    /// `seq` with a snapshot of this hasher, when there is one (`keys` is an exact list or tuple)
    /// and the hasher is a ring (looked up as its keys are read: see [`Seq::lookup_keys`]).
    fn ring_seq<'a, 'py>(
        &self,
        py: Python<'py>,
        seq: Option<Seq<'a, 'py>>,
    ) -> Option<(Seq<'a, 'py>, Arc<H>)> {
        let seq = seq?;
        let h = self.core.snapshot(py);
        h.as_ring().is_some().then_some((seq, h))
    }

    fn preference<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        n: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = int_arg(n, "n", ">= 1", |n| n >= 1)?;
        // A count above the address space asks for every node, as usize::MAX does.
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        let mut ids: Vec<NodeId> = Vec::new();
        let names = with_key(key, |k| {
            self.read(py, 1, |h| {
                h.preference_into(k, n, &mut ids)?;
                names_of(h, &ids)
            })
        })??;
        self.list(py, &ids, &names)
    }

    fn add(
        &self,
        py: Python<'_>,
        node: Name<'_>,
        weight: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let name = node.to_owned_string();
        let weight = optional(weight, |w| weight_from_py(w, "node", &name))?.unwrap_or(1.0);
        Ok(self.replace(py, |h| h.with_added(&name, weight))?)
    }

    fn remove(&self, py: Python<'_>, node: Name<'_>) -> PyResult<()> {
        let name = node.to_owned_string();
        Ok(self.replace(py, |h| h.with_removed(&name))?)
    }

    fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let names: Vec<(NodeId, Arc<str>)> = self.read(py, 1, |h| {
            let set = h.node_set();
            set.in_order()
                .filter_map(|id| set.name(id).map(|n| (id, Arc::clone(n))))
                .collect()
        });
        let ids: Vec<NodeId> = names.iter().map(|(id, _)| *id).collect();
        self.list(py, &ids, &names)
    }

    fn len(&self, py: Python<'_>) -> usize {
        self.read(py, 1, |h| h.len())
    }

    fn contains(&self, py: Python<'_>, node: &Bound<'_, PyAny>) -> PyResult<bool> {
        match node.cast::<PyString>() {
            Ok(s) => {
                let name = s.to_cow()?;
                Ok(self.read(py, 1, |h| h.contains(&name)))
            }
            Err(_) => Ok(false),
        }
    }
}

/// The methods every hasher class shares, plus the class's own (`$extra`), in one `#[pymethods]`.
macro_rules! hasher_class {
    ($class:ident { $($extra:tt)* }) => {
        #[pymethods]
        impl $class {
            $($extra)*

            /// The node ``key`` maps to. ``key`` is a str (hashed as UTF-8), bytes, or an int in
            /// ``0..2**64-1``. Raises ValueError when there is no node.
            fn get<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
                self.inner.get(py, key)
            }

            /// ``[get(k) for k in keys]``, computed in Rust with the GIL released. ``keys`` is a
            /// list (or any iterable) of str/bytes/int, or a NumPy integer array.
            ///
            /// ``as_index=True`` returns ``(positions, nodes)`` instead: a uint32 array giving each
            /// key's node as a position in ``nodes``, the node list as of the lookup (``nodes[p]``
            /// for ``p`` in ``positions`` is ``get_many(keys)``), with no per-key Python object.
            #[pyo3(signature = (keys, *, as_index = false))]
            fn get_many<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>, as_index: bool) -> PyResult<Bound<'py, PyAny>> {
                self.inner.get_many(py, keys, as_index)
            }

            /// ``n`` distinct nodes in this hasher's fallback order for ``key``, starting with
            /// ``get(key)``. ``n`` larger than the number of nodes returns every node; ``n < 1``
            /// raises ValueError.
            fn preference<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>, n: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
                self.inner.preference(py, key, n)
            }

            /// Adds ``node`` with ``weight`` (default 1). Raises ValueError for a node already
            /// present or a weight this hasher cannot use; nothing changes then.
            #[pyo3(signature = (node, weight = None), text_signature = "($self, node, weight=1)")]
            fn add(&self, py: Python<'_>, node: Name<'_>, weight: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
                self.inner.add(py, node, weight)
            }

            /// Removes ``node``; raises KeyError when it is unknown.
            fn remove(&self, py: Python<'_>, node: Name<'_>) -> PyResult<()> {
                self.inner.remove(py, node)
            }

            /// Node names, in the order they were added.
            #[getter]
            fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
                self.inner.nodes(py)
            }

            fn __len__(&self, py: Python<'_>) -> usize {
                self.inner.len(py)
            }

            fn __contains__(&self, py: Python<'_>, node: &Bound<'_, PyAny>) -> PyResult<bool> {
                self.inner.contains(py, node)
            }
        }
    };
}

/// Consistent-hash ring. ``hash="ketama"`` places str keys as libketama and
/// ``uhashring.HashRing(nodes, hash_fn="ketama")`` do; ``vnodes`` here is 4 x uhashring's (the
/// default 160 is libketama's 40 digests x 4 points) and must be a multiple of 4. Weights must then
/// be whole numbers; a node gets ``4 * ((vnodes // 4) * n * w // sum(w))`` points, exactly as
/// uhashring computes them. libketama computes that count through a float32 share and can get
/// one digest fewer when the exact count is an integer (weights 1, 18, 21: 62 instead of 63
/// digests for the third server); kvroute follows the exact formula. bytes keys hash as raw bytes
/// (libketama; uhashring would hash ``str(b"...")``); int keys as ``str(key)`` (uhashring). Where
/// libketama and uhashring disagree, kvroute follows libketama: a key hashing exactly onto a point
/// goes to that point's node (uhashring takes the next point), and a point owned by two nodes goes
/// to the name that sorts first (uhashring: the node added last). Both need a 32-bit collision
/// (about points/2**32 per key).
///
/// ``hash="xxh3"``: node ``name`` of weight ``w`` owns ``max(1, round(vnodes * w))`` points at
/// ``XXH3-64(name, seed=j)``; keys of every type hash with ``hash_key``. Adding or removing a node
/// moves only the keys to or from it. In both modes ``preference`` walks the ring clockwise from
/// the key.
#[pyclass(frozen, module = "kvroute._core")]
pub struct HashRing {
    inner: Shared<hashing::HashRing>,
}

hasher_class!(HashRing {
    #[new]
    #[pyo3(
        signature = (nodes, *, vnodes = None, hash = "ketama"),
        text_signature = "(nodes, *, vnodes=160, hash=\"ketama\")"
    )]
    fn new(py: Python<'_>, nodes: &Bound<'_, PyAny>, vnodes: Option<&Bound<'_, PyAny>>, hash: &str) -> PyResult<Self> {
        let kind = match hash {
            "ketama" => RingHash::Ketama,
            "xxh3" => RingHash::Xxh3,
            other => {
                return Err(PyValueError::new_err(format!(
                    "hash must be \"ketama\" or \"xxh3\", got {other:?}"
                )))
            }
        };
        let vnodes = vnodes.map_or(Ok(i64::from(hashing::DEFAULT_VNODES)), |v| {
            int_arg(v, "vnodes", "in 1..2**32-1", |v| (1..=i64::from(u32::MAX)).contains(&v))
        })? as u32;
        let pairs = node_pairs(nodes, None)?;
        let core = py.detach(|| hashing::HashRing::new(pairs, vnodes, kind))?;
        Ok(Self { inner: Shared::new(core) })
    }

    /// Points per unit of weight.
    #[getter]
    fn vnodes(&self, py: Python<'_>) -> u32 {
        self.inner.read(py, 1, |h| h.vnodes())
    }

    /// ``"ketama"`` or ``"xxh3"``.
    #[getter]
    fn hash(&self, py: Python<'_>) -> &'static str {
        match self.inner.read(py, 1, |h| h.hash_kind()) {
            RingHash::Ketama => "ketama",
            RingHash::Xxh3 => "xxh3",
        }
    }

    /// The ring's points in ascending order as ``(position, node)`` (positions are 32-bit in
    /// ketama mode, where they equal ``uhashring``'s ``get_points()``).
    #[getter]
    fn points<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let (points, names) = self.inner.read(py, 1, |h| {
            let points: Vec<(u64, NodeId)> = h.points().collect();
            let ids: Vec<NodeId> = points.iter().map(|p| p.1).collect();
            (points, names_of(h, &ids))
        });
        let ids: Vec<NodeId> = points.iter().map(|p| p.1).collect();
        let owners = self.inner.list(py, &ids, &names?)?;
        let pairs = points
            .iter()
            .zip(owners.iter())
            .map(|(&(p, _), owner)| (p, owner).into_pyobject(py))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, pairs)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (n, v, k) = self.inner.read(py, 1, |h| (h.len(), h.vnodes(), h.hash_kind()));
        let k = if k == RingHash::Ketama { "ketama" } else { "xxh3" };
        format!("HashRing(<{n} nodes>, vnodes={v}, hash={k:?})")
    }
});

/// Maglev hashing with Envoy's table construction: nodes sorted by name, offset
/// ``XXH64(name, 0) % M``, skip ``XXH64(name, 1) % (M-1) + 1``, Envoy's weighted fill.
/// ``table_size`` M must be prime. ``get(int)`` is ``table[key % M]``: int keys are taken as
/// already-hashed 64-bit values (as Envoy's request hash); str/bytes keys go through ``hash_key``.
/// ``preference`` follows Envoy's retry hashing (attempt a looks up ``key ^ (2**64 - a)``).
#[pyclass(frozen, module = "kvroute._core")]
pub struct Maglev {
    inner: Shared<hashing::Maglev>,
}

hasher_class!(Maglev {
    #[new]
    #[pyo3(
        signature = (nodes, *, weights = None, table_size = None),
        text_signature = "(nodes, *, weights=None, table_size=65537)"
    )]
    fn new(py: Python<'_>, nodes: &Bound<'_, PyAny>, weights: Option<&Bound<'_, PyAny>>, table_size: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        // In range here; the core checks that it is a prime, naming the value.
        let expected = format!("a prime in 2..={}", hashing::MAX_TABLE_SIZE);
        let m = table_size.map_or(Ok(hashing::DEFAULT_TABLE_SIZE as i64), |m| {
            int_arg(m, "table_size", &expected, |m| (2..=hashing::MAX_TABLE_SIZE as i64).contains(&m))
        })? as u64;
        let pairs = node_pairs(nodes, weights)?;
        let core = py.detach(|| hashing::Maglev::new(pairs, m))?;
        Ok(Self { inner: Shared::new(core) })
    }

    /// The node of every slot: ``table[k % table_size]`` is ``get(k)`` for an int ``k``.
    #[getter]
    fn table<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let (slots, names) = self.inner.read(py, 1, |h| (h.table().to_vec(), names_of(h, h.table())));
        self.inner.list(py, &slots, &names?)
    }

    /// The number of slots M.
    #[getter]
    fn table_size(&self, py: Python<'_>) -> u64 {
        self.inner.read(py, 1, |h| h.table_size())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (n, m) = self.inner.read(py, 1, |h| (h.len(), h.table_size()));
        format!("Maglev(<{n} nodes>, table_size={m})")
    }
});

/// Weighted rendezvous (highest-random-weight) hashing with the logarithmic method: node i scores
/// ``w_i / -ln(u_i)`` for a uniform draw ``u_i`` from ``(hash_key(key), XXH3(name_i))``, so each
/// node gets exactly its weight's share of keys. Keys of every type are hashed with ``hash_key``.
/// ``preference`` is the descending score order.
#[pyclass(frozen, module = "kvroute._core")]
pub struct Rendezvous {
    inner: Shared<hashing::Rendezvous>,
}

hasher_class!(Rendezvous {
    #[new]
    #[pyo3(signature = (nodes, *, weights = None))]
    fn new(py: Python<'_>, nodes: &Bound<'_, PyAny>, weights: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let pairs = node_pairs(nodes, weights)?;
        let core = py.detach(|| hashing::Rendezvous::new(pairs))?;
        Ok(Self { inner: Shared::new(core) })
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!("Rendezvous(<{} nodes>)", self.inner.len(py))
    }
});

/// Jump consistent hash over named nodes (MementoHash, Coluzzi et al. 2024), unweighted. With no
/// removal, ``get(k)`` for an int ``k`` is ``nodes[jump_hash(k, len(nodes))]``: int keys are taken
/// as already-hashed 64-bit values (as in the jump paper); str/bytes keys go through ``hash_key``.
/// Removing any node moves only that node's keys, spread evenly over the others; adding a node
/// after removals reuses the most recently freed bucket. ``preference(key, n)`` is the failover
/// order: its second entry is where ``key`` goes once its first node is removed.
#[pyclass(frozen, module = "kvroute._core")]
pub struct JumpHash {
    inner: Shared<hashing::JumpHash>,
}

hasher_class!(JumpHash {
    #[new]
    fn new(py: Python<'_>, nodes: &Bound<'_, PyAny>) -> PyResult<Self> {
        let pairs = node_pairs(nodes, None)?;
        let core = py.detach(|| -> crate::Result<hashing::JumpHash> {
            let mut h = hashing::JumpHash::default();
            for (name, weight) in &pairs {
                h.add(name, *weight)?;
            }
            Ok(h)
        })?;
        Ok(Self { inner: Shared::new(core) })
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!("JumpHash(<{} nodes>)", self.inner.len(py))
    }
});
