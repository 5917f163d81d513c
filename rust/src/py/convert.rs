//! Conversions between Python objects and core types, and the error mapping.
//!
//! Guarantees: every conversion either succeeds or raises `TypeError`/`ValueError` naming the bad
//! value; NumPy arrays of the exact dtype and C-contiguous layout are borrowed, never copied.
//! Optional arguments arrive as `Option<&Bound<PyAny>>`, where PyO3 already maps an explicit
//! `None` to `None`.

use std::fmt::Display;
use std::time::Instant;

use numpy::npyffi::objects::_PyArray_GET_ITEM_DATA;
use numpy::{
    Element, PyArray1, PyArrayDescr, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1,
    PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyKeyError, PyMemoryError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::type_object::PyTypeCheck;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyInt, PyList, PyMapping, PyMemoryView, PyString, PyTuple,
};

use super::in_place::str_utf8;
use crate::error::Error;

pyo3::create_exception!(
    kvroute._core,
    NoWorkerError,
    pyo3::exceptions::PyValueError,
    "No worker can take the request: none is healthy, in the endpoint's pool and not excluded."
);

pyo3::create_exception!(
    kvroute._core,
    ReadOnlyError,
    pyo3::exceptions::PyRuntimeError,
    "A write to an object that another one owns and writes (the router's approx-mode index)."
);

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::Value(m) => PyValueError::new_err(m),
            Error::Type(m) => PyTypeError::new_err(m),
            Error::Key(m) => PyKeyError::new_err(m),
            Error::NoWorker(m) => NoWorkerError::new_err(m),
        }
    }
}

/// The UTF-8 bytes of a Python `str`, borrowed from the string object (CPython caches them):
/// read in place where they already lie ([`str_utf8`]), else through `PyUnicode_AsUTF8AndSize`.
pub fn str_bytes<'a>(s: &'a Bound<'_, PyString>) -> PyResult<&'a [u8]> {
    // SAFETY: a live `str` (bound: the GIL is held); the slice borrows `s`, which holds it.
    if let Some(bytes) = unsafe { str_utf8(s.as_ptr()) } {
        return Ok(bytes);
    }
    Ok(s.to_str()?.as_bytes())
}

/// A `str` argument that names something — a node, a worker, an endpoint, a partition, a salt —
/// borrowed from the Python string. Anything else raises `TypeError` naming the value's type and
/// repr (PyO3 adds the argument's name as a note). Dereferences to `&str`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Name<'a>(&'a str);

impl<'a, 'py> FromPyObject<'a, 'py> for Name<'a> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if !obj.is_instance_of::<PyString>() {
            return Err(type_error(&obj, "a name must be a str"));
        }
        <&'a str as FromPyObject<'a, 'py>>::extract(obj).map(Name)
    }
}

impl std::ops::Deref for Name<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        self.0
    }
}

impl<'a> Name<'a> {
    /// The name as an owned `String`.
    pub fn to_owned_string(self) -> String {
        self.0.to_owned()
    }
}

/// An element of a collection of names (a list item, a dict key) as an owned `String`; `what`
/// names the element in the `TypeError` ("worker", "partition name", ...).
pub fn name_item(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    match obj.cast::<PyString>() {
        Ok(s) => Ok(s.to_str()?.to_owned()),
        Err(_) => Err(type_error(obj, format_args!("{what} must be a str"))),
    }
}

/// A short, safe rendering of a Python object for error messages.
pub fn describe(obj: &Bound<'_, PyAny>) -> String {
    let text = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".to_owned());
    if text.chars().count() > 60 {
        let short: String = text.chars().take(57).collect();
        format!("{short}...")
    } else {
        text
    }
}

/// Name of the object's Python type, for `TypeError` messages.
pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_owned())
}

/// The `TypeError` for `obj` where `expected` was wanted: "{expected}, got {type} {repr}".
pub fn type_error(obj: &Bound<'_, PyAny>, expected: impl Display) -> PyErr {
    PyTypeError::new_err(format!(
        "{expected}, got {} {}",
        type_name(obj),
        describe(obj)
    ))
}

/// `f(obj)` for an optional argument that was given; `None` when it was omitted or `None`.
pub fn optional<'py, T>(
    obj: Option<&Bound<'py, PyAny>>,
    f: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
) -> PyResult<Option<T>> {
    obj.map(f).transpose()
}

/// At most this many items are reserved up front from the length an iterable claims (`len()`);
/// past it the buffer grows as items arrive, fallibly.
const PRESIZE_MAX: usize = 1 << 16;

/// The `MemoryError` raised when the `n` items of `obj` (the argument `what`) cannot be held.
pub fn memory_error(obj: &Bound<'_, PyAny>, what: &str, n: usize) -> PyErr {
    PyMemoryError::new_err(format!(
        "{what}: cannot allocate memory for {n} items of {}",
        describe(obj)
    ))
}

/// `buf` (cleared) with room for the items of the iterable `obj`, from the length it claims.
/// `len()` is a claim, not data: one no allocation could meet raises `MemoryError` at once, as
/// `list(obj)` does (rather than after reading items for minutes); any other is trusted only up
/// to [`PRESIZE_MAX`] items, so a length that lies costs nothing. No `len()`: nothing reserved.
pub(super) fn presized<T>(obj: &Bound<'_, PyAny>, what: &str, mut buf: Vec<T>) -> PyResult<Vec<T>> {
    buf.clear();
    let Ok(claimed) = obj.len() else {
        return Ok(buf);
    };
    // The probe's allocation, if it succeeds, is only address space, released at once.
    if Vec::<T>::new().try_reserve_exact(claimed).is_err() {
        return Err(PyMemoryError::new_err(format!(
            "{what}: len() of {} claims {claimed} items, more than memory can hold",
            describe(obj)
        )));
    }
    buf.try_reserve(claimed.min(PRESIZE_MAX))
        .map_err(|_| memory_error(obj, what, claimed))?;
    Ok(buf)
}

/// The value of the Python `int` `obj` when it is in `0..2**64`; `None` (the exception cleared)
/// when it is negative or larger.
///
/// `PyLong_AsUnsignedLongLong` converts every value of two 30-bit digits or more (>= 2**30, so
/// nearly every hash) through `_PyLong_AsByteArray`, ~180 instructions; `PyLong_AsUnsignedLong`
/// checks and assembles the digits in a short loop, and is the same conversion where C's
/// `unsigned long` has 64 bits (every LP64 platform).
///
/// # Safety
/// `obj` is a live `int` (or subclass) object and the GIL is held.
#[inline]
pub unsafe fn int_to_u64(obj: *mut pyo3::ffi::PyObject) -> Option<u64> {
    // SAFETY: the caller's contract; both functions accept any int object.
    let v = unsafe {
        if std::mem::size_of::<std::os::raw::c_ulong>() == 8 {
            pyo3::ffi::PyLong_AsUnsignedLong(obj) as u64
        } else {
            pyo3::ffi::PyLong_AsUnsignedLongLong(obj)
        }
    };
    // SAFETY: the GIL is held.
    if v == u64::MAX && unsafe { !pyo3::ffi::PyErr_Occurred().is_null() } {
        // SAFETY: the GIL is held; the error is the conversion's own (negative or too large).
        unsafe { pyo3::ffi::PyErr_Clear() };
        return None;
    }
    Some(v)
}

/// `obj` as a Python `int`: itself, or through `__index__` (NumPy integer scalars, any value);
/// `bool` (Python's, and NumPy's, whose `__index__` refuses) and anything else raise `TypeError`
/// naming `name()` and the value.
pub fn as_int<'py>(
    obj: &Bound<'py, PyAny>,
    name: &dyn Fn() -> String,
) -> PyResult<Bound<'py, PyInt>> {
    let refused = || type_error(obj, format_args!("{} must be an int", name()));
    if obj.is_instance_of::<PyBool>() {
        return Err(refused());
    }
    if let Ok(int) = obj.cast::<PyInt>() {
        return Ok(int.clone());
    }
    if !is_integer(obj) {
        return Err(refused());
    }
    // SAFETY: as above; `PyNumber_Index` returns a new reference to an int, or NULL with the
    // error set.
    let int =
        unsafe { Bound::from_owned_ptr_or_err(obj.py(), pyo3::ffi::PyNumber_Index(obj.as_ptr())) };
    match int {
        Ok(int) => int.cast_into::<PyInt>().map_err(|_| refused()),
        Err(e) if e.is_instance_of::<PyTypeError>(obj.py()) => Err(refused()),
        Err(e) => Err(e),
    }
}

/// Whether `obj` is an integer [`as_int`] may take: an `int` or an object with `__index__` (NumPy's
/// `bool_` too, which it then refuses), not a `bool`.
pub(super) fn is_integer(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: `obj` is live and the GIL is held (`obj` is bound).
    !obj.is_instance_of::<PyBool>()
        && (obj.is_instance_of::<PyInt>() || unsafe { pyo3::ffi::PyIndex_Check(obj.as_ptr()) } != 0)
}

/// An unsigned 64-bit integer from a Python `int` or an integer with `__index__` (see
/// [`as_int`]; `bool` is refused), naming `what` (and the position `at`, for an element of a
/// sequence) on error.
pub fn u64_from_int(obj: &Bound<'_, PyAny>, what: &str, at: Option<usize>) -> PyResult<u64> {
    let name = || match at {
        Some(i) => format!("{what}[{i}]"),
        None => what.to_owned(),
    };
    let int = as_int(obj, &name)?;
    // SAFETY: `int` is an int and the GIL is held (`int` is bound).
    if let Some(v) = unsafe { int_to_u64(int.as_ptr()) } {
        return Ok(v);
    }
    let why = if int.lt(0).unwrap_or(false) {
        "is negative"
    } else {
        "is outside 0..2**64-1"
    };
    Err(PyValueError::new_err(format!(
        "{} = {} {why}",
        name(),
        describe(obj)
    )))
}

/// A signed 32-bit integer from an integer (see [`as_int`]; `bool` is refused), naming `what` on
/// error.
pub fn i32_from_int(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i32> {
    as_int(obj, &|| what.to_owned())?
        .extract::<i32>()
        .map_err(|_| {
            PyValueError::new_err(format!(
                "{what} = {} is outside -2**31..2**31-1",
                describe(obj)
            ))
        })
}

/// A count or size from a Python `int` in `0..2**64` (see [`u64_from_int`]), saturating at
/// `usize::MAX` (the core refuses what it cannot hold).
pub fn usize_from_int(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    Ok(usize::try_from(u64_from_int(obj, what, None)?).unwrap_or(usize::MAX))
}

/// Arrays of at most this many values may be copied rather than borrowed (see [`ArraySlice`]).
pub const INLINE_VALUES: usize = 16;

/// A read-only 1-D NumPy array's values: borrowed when C-contiguous, else copied once.
pub enum ArraySlice<'py, T: Element> {
    /// A C-contiguous array, borrowed without copying.
    Borrowed(PyReadonlyArray1<'py, T>),
    /// A short C-contiguous array (at most [`INLINE_VALUES`] values) copied under the GIL: for
    /// per-call hot paths, where registering a NumPy borrow costs more than the copy.
    Inline([T; INLINE_VALUES], usize),
    /// Converted from a list, another dtype, or a non-contiguous array.
    Owned(Vec<T>),
}

impl<T: Element + Copy> ArraySlice<'_, T> {
    /// The values as a slice.
    pub fn as_slice(&self) -> &[T] {
        match self {
            // A borrowed array is only constructed after checking contiguity, so `as_slice` succeeds.
            ArraySlice::Borrowed(a) => a.as_slice().unwrap_or_default(),
            ArraySlice::Inline(values, len) => values.get(..*len).unwrap_or_default(),
            ArraySlice::Owned(v) => v,
        }
    }
}

/// NumPy's canonical `uint64` descriptor, looked up once: arrays made with `dtype=np.uint64`
/// share it, so one pointer comparison usually settles the dtype.
static UINT64_DESCR: PyOnceLock<Py<PyArrayDescr>> = PyOnceLock::new();

/// Copies a 1-D, C-contiguous, aligned, native-endian 8-byte unsigned array of at most
/// [`INLINE_VALUES`] values; `None` for anything else.
fn inline_u64s<'py>(obj: &Bound<'py, PyAny>) -> Option<ArraySlice<'py, u64>> {
    let arr = obj.cast::<PyUntypedArray>().ok()?;
    // SAFETY: `arr` is a live ndarray and the GIL is held; these are `PyArray_NDIM`,
    // `PyArray_FLAGS`, `PyArray_DESCR`, `PyArray_DIMS` and `PyArray_DATA`.
    let fields = unsafe { &*_PyArray_GET_ITEM_DATA(arr.as_array_ptr()) };
    let flags = numpy::npyffi::NPY_ARRAY_C_CONTIGUOUS | numpy::npyffi::NPY_ARRAY_ALIGNED;
    if fields.nd != 1 || fields.flags & flags != flags {
        return None;
    }
    let py = obj.py();
    let canonical = UINT64_DESCR.get_or_init(py, || numpy::dtype::<u64>(py).unbind());
    if fields.descr.cast::<pyo3::ffi::PyObject>() != canonical.as_ptr() {
        let dtype = arr.dtype();
        let native = dtype.is_native_byteorder() != Some(false);
        if dtype.kind() != b'u' || dtype.itemsize() != 8 || !native {
            return None;
        }
    }
    // SAFETY: `nd == 1`, so `dimensions` points to one length.
    let len = usize::try_from(unsafe { *fields.dimensions }).ok()?;
    if len > INLINE_VALUES {
        return None;
    }
    let mut values = [0u64; INLINE_VALUES];
    // SAFETY: the array is 1-D with `len <= INLINE_VALUES` aligned, contiguous, native 8-byte
    // unsigned elements starting at `data` (checked above). The GIL is held for the whole copy,
    // so no Python code can write to the buffer meanwhile.
    unsafe {
        let data = fields.data.cast::<u64>().cast_const();
        std::ptr::copy_nonoverlapping(data, values.as_mut_ptr(), len);
    }
    Some(ArraySlice::Inline(values, len))
}

/// A read-only `u64` sequence from Python: a borrowed NumPy buffer or an owned copy.
pub type U64Slice<'py> = ArraySlice<'py, u64>;

/// A 1-D NumPy array of one of the integer dtypes the core reads directly.
pub enum IntArray<'py> {
    U32(ArraySlice<'py, u32>),
    I32(ArraySlice<'py, i32>),
    U64(ArraySlice<'py, u64>),
    I64(ArraySlice<'py, i64>),
}

fn array_slice<'py, T: Element + Copy>(
    arr: &Bound<'py, PyArray1<T>>,
    what: &str,
) -> PyResult<ArraySlice<'py, T>> {
    let ro = arr
        .try_readonly()
        .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))?;
    if ro.as_slice().is_ok() {
        return Ok(ArraySlice::Borrowed(ro));
    }
    let values = ro.as_array();
    let mut owned = Vec::new();
    owned
        .try_reserve_exact(values.len())
        .map_err(|_| memory_error(arr.as_any(), what, values.len()))?;
    owned.extend(values.iter().copied());
    Ok(ArraySlice::Owned(owned))
}

/// `Some` for a 1-D NumPy array of dtype uint32, int32, uint64 or int64 (borrowed when
/// C-contiguous), `None` for any other object. `what` names it in errors.
pub fn int_array<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Option<IntArray<'py>>> {
    if let Ok(arr) = obj.cast::<PyArray1<u64>>() {
        return Ok(Some(IntArray::U64(array_slice(arr, what)?)));
    }
    if let Ok(arr) = obj.cast::<PyArray1<i64>>() {
        return Ok(Some(IntArray::I64(array_slice(arr, what)?)));
    }
    if let Ok(arr) = obj.cast::<PyArray1<u32>>() {
        return Ok(Some(IntArray::U32(array_slice(arr, what)?)));
    }
    if let Ok(arr) = obj.cast::<PyArray1<i32>>() {
        return Ok(Some(IntArray::I32(array_slice(arr, what)?)));
    }
    Ok(None)
}

/// Calls `$body` with `$s` bound to the typed slice inside a [`Tokens`].
macro_rules! typed {
    ($tokens:expr, |$s:ident| $body:expr) => {
        match $tokens {
            Tokens::U32($s) => $body,
            Tokens::I32($s) => $body,
            Tokens::U64($s) => $body,
            Tokens::I64($s) => $body,
        }
    };
}
pub(super) use typed;

/// Token ids: a 1-D NumPy array of a supported integer dtype (borrowed), or a sequence of ints.
pub fn tokens_from_py<'py>(obj: &Bound<'py, PyAny>) -> PyResult<IntArray<'py>> {
    match int_array(obj, "tokens")? {
        Some(array) => Ok(array),
        None => Ok(IntArray::U64(u64_slice(obj, "tokens", Negative::Reject)?)),
    }
}

/// The token slice of one call, in whichever dtype it arrived.
#[derive(Clone, Copy)]
pub enum Tokens<'a> {
    U32(&'a [u32]),
    I32(&'a [i32]),
    U64(&'a [u64]),
    I64(&'a [i64]),
}

impl<'a> Tokens<'a> {
    pub fn of(array: &'a IntArray<'_>) -> Self {
        match array {
            IntArray::U32(a) => Tokens::U32(a.as_slice()),
            IntArray::I32(a) => Tokens::I32(a.as_slice()),
            IntArray::U64(a) => Tokens::U64(a.as_slice()),
            IntArray::I64(a) => Tokens::I64(a.as_slice()),
        }
    }

    pub fn len(self) -> usize {
        typed!(self, |s| s.len())
    }
}

/// How negative values are treated by [`u64_slice`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Negative {
    /// Refuse them with `ValueError` (keys, counts).
    Reject,
    /// Keep their two's-complement bits (block hashes published as signed int64, e.g. SGLang's).
    Reinterpret,
}

/// A sequence of unsigned 64-bit values: a 1-D NumPy integer array (borrowed when it is a
/// C-contiguous `uint64` array, copied when it is also short) or any iterable of Python ints. `what` names it in errors.
pub fn u64_slice<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    negative: Negative,
) -> PyResult<U64Slice<'py>> {
    let item_u64 = |item: &Bound<'_, PyAny>, i: usize| -> PyResult<u64> {
        match negative {
            Negative::Reject => u64_from_int(item, what, Some(i)),
            Negative::Reinterpret => block_hash(item, &|| format!("{what}[{i}]")),
        }
    };
    // Lists and tuples first: a type comparison, where the array checks below call into NumPy
    // and the duck-typing check raises and clears an AttributeError.
    if let Some((n, get_item)) = list_or_tuple(obj) {
        return fast_seq_to_u64(obj, n, get_item, what, item_u64).map(U64Slice::Owned);
    }
    if let Some(short) = inline_u64s(obj) {
        return Ok(short);
    }
    if let Some(arr) = int_array(obj, what)? {
        return match arr {
            IntArray::U64(s) => Ok(s),
            IntArray::I64(s) => {
                signed_to_u64(s.as_slice().iter().copied(), what, negative).map(U64Slice::Owned)
            }
            IntArray::U32(s) => Ok(U64Slice::Owned(
                s.as_slice().iter().map(|&v| u64::from(v)).collect(),
            )),
            IntArray::I32(s) => {
                signed_to_u64(s.as_slice().iter().map(|&v| i64::from(v)), what, negative)
                    .map(U64Slice::Owned)
            }
        };
    }
    if obj.hasattr("dtype")? && obj.hasattr("ndim")? {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a 1-D integer array, got a {}-D array of dtype {}",
            obj.getattr("ndim")?,
            obj.getattr("dtype")?
        )));
    }
    // Iterable as ints, but text or bytes: taken for tokens, a mistake.
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
    {
        return Err(type_error(
            obj,
            format_args!("{what} must be a sequence of ints"),
        ));
    }
    let iter = obj.try_iter().map_err(|_| {
        type_error(
            obj,
            format_args!("{what} must be a sequence of ints or a NumPy integer array"),
        )
    })?;
    let mut out = presized(obj, what, Vec::new())?;
    for (i, item) in iter.enumerate() {
        let value = item_u64(&item?, i)?;
        out.try_reserve(1)
            .map_err(|_| memory_error(obj, what, i + 1))?;
        out.push(value);
    }
    Ok(U64Slice::Owned(out))
}

/// `PyList_GetItem` or `PyTuple_GetItem`: a borrowed item, or NULL with `IndexError`.
type GetItem = unsafe extern "C" fn(
    *mut pyo3::ffi::PyObject,
    pyo3::ffi::Py_ssize_t,
) -> *mut pyo3::ffi::PyObject;

/// `(length, item getter)` when `obj` is exactly a list or a tuple.
pub(super) fn list_or_tuple(obj: &Bound<'_, PyAny>) -> Option<(usize, GetItem)> {
    if let Ok(list) = obj.cast_exact::<PyList>() {
        return Some((list.len(), pyo3::ffi::PyList_GetItem));
    }
    if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
        return Some((tuple.len(), pyo3::ffi::PyTuple_GetItem));
    }
    None
}

/// Calls `visit(item, index)` on each of the `n` items of a list or tuple, read with `get_item`
/// (`PyList_GetItem`/`PyTuple_GetItem`) as borrowed pointers: no iterator, no refcounting. An
/// item stays valid while `visit` runs no Python code; `visit` must take a strong reference
/// (`Bound::from_borrowed_ptr`) before anything that might.
pub(super) fn for_each_item(
    seq: &Bound<'_, impl PyTypeCheck>,
    n: usize,
    get_item: GetItem,
    mut visit: impl FnMut(*mut pyo3::ffi::PyObject, usize) -> PyResult<()>,
) -> PyResult<()> {
    for i in 0..n {
        let index = pyo3::ffi::Py_ssize_t::try_from(i)
            .map_err(|_| PyValueError::new_err("sequence too long"))?;
        // SAFETY: `seq` is a live list/tuple matching `get_item`, and we hold the GIL.
        // `get_item` bounds-checks and returns a borrowed reference (NULL with IndexError if a
        // list shrank).
        let item = unsafe { get_item(seq.as_ptr(), index) };
        if item.is_null() {
            return Err(PyErr::fetch(seq.py()));
        }
        visit(item, i)?;
    }
    Ok(())
}

/// The `n` items of a list or tuple (see [`for_each_item`]) as `u64`: exact `int`s in range are
/// read directly (the common case, a few ns each); any other item goes through
/// `slow(item, index)`.
fn fast_seq_to_u64(
    seq: &Bound<'_, impl PyTypeCheck>,
    n: usize,
    get_item: GetItem,
    what: &str,
    slow: impl Fn(&Bound<'_, PyAny>, usize) -> PyResult<u64>,
) -> PyResult<Vec<u64>> {
    let py = seq.py();
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| memory_error(seq.as_any(), what, n))?;
    for_each_item(seq, n, get_item, |item, i| {
        // SAFETY: `item` is a live borrowed reference; the fast path runs no Python code (the
        // type is exactly `int`, so no `__index__`), and the slow path takes its own reference
        // first.
        unsafe {
            if pyo3::ffi::Py_TYPE(item) == std::ptr::addr_of_mut!(pyo3::ffi::PyLong_Type) {
                // Negative or too large: the slow path names it.
                if let Some(v) = int_to_u64(item) {
                    out.push(v);
                    return Ok(());
                }
            }
            let item = Bound::from_borrowed_ptr(py, item);
            out.push(slow(&item, i)?);
        }
        Ok(())
    })?;
    Ok(out)
}

fn signed_to_u64(
    values: impl Iterator<Item = i64>,
    what: &str,
    negative: Negative,
) -> PyResult<Vec<u64>> {
    values
        .enumerate()
        .map(|(i, v)| match (v < 0, negative) {
            (true, Negative::Reject) => Err(PyValueError::new_err(format!(
                "{what}[{i}] = {v} is negative"
            ))),
            _ => Ok(v as u64),
        })
        .collect()
}

/// A `uint64` NumPy array that takes ownership of `values` (no copy).
pub fn u64_array(py: Python<'_>, values: Vec<u64>) -> Bound<'_, PyArray1<u64>> {
    PyArray1::from_vec(py, values)
}

/// The names of an iterable of `str` (a bare `str`, itself iterable, is refused). `what` names
/// the collection in errors, `item` each element.
pub fn names_from_py(obj: &Bound<'_, PyAny>, what: &str, item: &str) -> PyResult<Vec<String>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(type_error(
            obj,
            format_args!("{what} must be a list of str"),
        ));
    }
    let items = obj
        .try_iter()
        .map_err(|_| type_error(obj, format_args!("{what} must be a list of str")))?;
    items.map(|name| name_item(&name?, item)).collect()
}

/// A weight: an `int` (exactly representable, |w| <= 2^53) or a `float`, for the `item` called
/// `name`. Whether it is in range (finite and positive, ...) is checked by the core.
pub fn weight_from_py(obj: &Bound<'_, PyAny>, item: &str, name: &str) -> PyResult<f64> {
    weight(obj, &format_args!("weight of {item} {name:?}"))
}

/// [`weight_from_py`] for a `weight` argument (the item it weighs is another argument).
pub fn weight_arg(obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    weight(obj, &"weight")
}

/// [`weight_from_py`], the errors naming the value `whose`.
fn weight(obj: &Bound<'_, PyAny>, whose: &dyn Display) -> PyResult<f64> {
    const EXACT: i64 = 1 << 53;
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{whose} must be a number, got bool"
        )));
    }
    if obj.is_instance_of::<PyInt>() {
        return match obj.extract::<i64>() {
            Ok(w) if (-EXACT..=EXACT).contains(&w) => Ok(w as f64),
            _ => Err(PyValueError::new_err(format!(
                "{whose} is too large: {}",
                describe(obj)
            ))),
        };
    }
    obj.extract::<f64>()
        .map_err(|_| type_error(obj, format_args!("{whose} must be a number")))
}

/// `(name, weight)` pairs from a `{name: weight}` mapping or a list of names (weight 1). `what`
/// names the argument in errors, `item` an element ("node", "worker").
pub fn weighted_names(
    obj: &Bound<'_, PyAny>,
    what: &str,
    item: &str,
) -> PyResult<Vec<(String, f64)>> {
    let Ok(map) = obj.cast::<PyMapping>() else {
        let expected = format!("{what} must be a list of str or a {{{item}: weight}} mapping");
        if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
            return Err(type_error(obj, expected));
        }
        let items = obj.try_iter().map_err(|_| type_error(obj, &expected))?;
        return items
            .map(|name| Ok((name_item(&name?, item)?, 1.0)))
            .collect();
    };
    // Keys, then each value: `items()` would build a list presized from `len()`, a claim.
    let mut pairs = Vec::new();
    for key in map.try_iter()? {
        let key = key?;
        let name = name_item(&key, item)?;
        let weight = weight_from_py(&map.get_item(&key)?, item, &name)?;
        pairs.push((name, weight));
    }
    Ok(pairs)
}

/// Calls `f` with the bytes of `obj`: borrowed from `bytes`, copied from a `bytearray` or a
/// contiguous `memoryview`. `what` names the argument in errors.
pub fn with_bytes<R>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    f: impl FnOnce(&[u8]) -> R,
) -> PyResult<R> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(f(b.as_bytes()));
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return Ok(f(&b.to_vec()));
    }
    if obj.is_instance_of::<PyMemoryView>() {
        let bytes: Vec<u8> = obj.call_method0("tobytes")?.extract()?;
        return Ok(f(&bytes));
    }
    Err(type_error(
        obj,
        format_args!("{what} must be bytes, bytearray or memoryview"),
    ))
}

/// The default `now` of calls that take one: `time.monotonic()` read once, then advanced by a
/// Rust clock, so that no call reaches into Python for the time.
pub struct MonotonicClock {
    zero: f64,
    started: Instant,
}

impl MonotonicClock {
    /// A clock reading `time.monotonic()` now.
    pub fn new(py: Python<'_>) -> PyResult<Self> {
        let zero: f64 = py.import("time")?.call_method0("monotonic")?.extract()?;
        Ok(MonotonicClock {
            zero,
            started: Instant::now(),
        })
    }

    /// `given`, or the current `time.monotonic()` value.
    pub fn now(&self, given: Option<f64>) -> f64 {
        given.unwrap_or_else(|| self.zero + self.started.elapsed().as_secs_f64())
    }
}

/// A block hash from an integer (a Python int, a NumPy integer scalar: see [`as_int`]): a value
/// in 0..2^64, or a negative int64 taken as its two's-complement bits (SGLang publishes signed
/// hashes). `bool` is refused.
pub fn block_hash_from_py(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    block_hash(obj, &|| what.to_owned())
}

/// `obj` as the block hash a membership test (`h in cache`, `h in index`) looks for: `None` for
/// an int no block hash can equal (outside -2**63..2**64-1, or a `bool`), which no container
/// holds; anything else that is no block hash raises as [`block_hash_from_py`] does.
pub fn block_hash_to_find(obj: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    match block_hash_from_py(obj, "block_hash") {
        Ok(h) => Ok(Some(h)),
        Err(_) if obj.is_instance_of::<PyInt>() => Ok(None),
        Err(e) => Err(e),
    }
}

/// [`block_hash_from_py`] naming the value `name()` on error.
fn block_hash(obj: &Bound<'_, PyAny>, name: &dyn Fn() -> String) -> PyResult<u64> {
    let int = as_int(obj, name)?;
    // SAFETY: `int` is an int and the GIL is held.
    if let Some(v) = unsafe { int_to_u64(int.as_ptr()) } {
        return Ok(v);
    }
    int.extract::<i64>().map(|v| v as u64).map_err(|_| {
        PyValueError::new_err(format!(
            "{} = {} is outside -2**63..2**64-1",
            name(),
            describe(obj)
        ))
    })
}
