//! Module functions CPython calls directly (`METH_FASTCALL | METH_KEYWORDS`), for per-call hot
//! paths where PyO3's calling machinery is most of the cost.
//!
//! A `#[pyfunction]` goes through PyO3's trampoline (GIL-count bookkeeping in thread-local
//! storage, the reference pool, a panic guard) and its generic argument binder: about 140 of the
//! ~320 instructions of a `jump_hash(key, n)` call (callgrind). A direct function handles the
//! common call — exact positional arguments of the expected types and values — itself, and
//! forwards every other call, unchanged, to the PyO3 function it stands for, which binds keywords
//! and raises the precise errors. So the direct function adds a fast path and nothing else: its
//! signature, errors and results are the PyO3 function's.
//!
//! Guarantees: the fast paths run no Python code and cannot panic; a panic on the forwarding path
//! is caught and raised as `RuntimeError` instead of unwinding into CPython.

use std::ffi::CStr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};

/// The C signature of a `METH_FASTCALL | METH_KEYWORDS` function: positional arguments, then the
/// values of the keywords named in the `kwnames` tuple (or NULL).
pub type FastCFunction = unsafe extern "C" fn(
    *mut ffi::PyObject,
    *const *mut ffi::PyObject,
    ffi::Py_ssize_t,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;

/// Adds `direct` to module `m` as the builtin `name`, standing for the PyO3 function `full`
/// (stored in `slot` for [`forward`]). `doc` starts with the text signature
/// (`"name($module, a, b)\n--\n\n..."`) that `inspect.signature` reads.
pub fn add_function(
    m: &Bound<'_, PyModule>,
    name: &'static CStr,
    doc: &'static CStr,
    direct: FastCFunction,
    full: Bound<'_, PyAny>,
    slot: &'static PyOnceLock<Py<PyAny>>,
) -> PyResult<()> {
    let py = m.py();
    let _ = slot.set(py, full.unbind()); // a second module initialisation keeps the first
                                         // SAFETY: C extensions store METH_FASTCALL functions in the `PyCFunction` slot, cast; CPython
                                         // reads `ml_flags` and calls the pointer back with the `FastCFunction` signature.
    let meth = unsafe { std::mem::transmute::<FastCFunction, ffi::PyCFunction>(direct) };
    // The definition must outlive every function object made from it: created once per module
    // initialisation and never freed.
    let def: &'static mut ffi::PyMethodDef = Box::leak(Box::new(ffi::PyMethodDef {
        ml_name: name.as_ptr(),
        ml_meth: ffi::PyMethodDefPointer { PyCFunction: meth },
        ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
        ml_doc: doc.as_ptr(),
    }));
    let module_name = m.name()?;
    // SAFETY: `def` is valid forever; `m` and `module_name` are live objects; the GIL is held.
    let func = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            ffi::PyCFunction_NewEx(def, m.as_ptr(), module_name.as_ptr()),
        )?
    };
    m.add(name.to_string_lossy().as_ref(), func)
}

/// Calls the PyO3 function in `slot` with a direct function's arguments, exactly as CPython
/// passed them, and returns its result (NULL with the exception set on error).
///
/// # Safety
/// Call only from a direct function CPython invoked, with its `args`, `nargs` and `kwnames`
/// unchanged: the GIL is held, `args` points to `nargs` positional values followed by one value
/// per name in the `kwnames` tuple (or `kwnames` is NULL).
#[cold]
#[inline(never)]
pub unsafe fn forward(
    slot: &PyOnceLock<Py<PyAny>>,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: CPython holds the GIL (attached thread state) while calling a builtin.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: `kwnames` is NULL or a live tuple of str owned by the caller for the call.
    let kwnames = unsafe { Borrowed::from_ptr_or_opt(py, kwnames) };
    let positional = usize::try_from(nargs).unwrap_or(0);
    let call = || -> PyResult<Bound<'_, PyAny>> {
        let full = slot
            .get(py)
            .ok_or_else(|| PyRuntimeError::new_err("internal error: function not registered"))?;
        let names = match kwnames {
            Some(k) => Some(k.cast::<PyTuple>().map_err(PyErr::from)?.to_owned()),
            None => None,
        };
        let count = positional + names.as_ref().map_or(0, |n| n.len());
        let values: &[*mut ffi::PyObject] = if count > 0 && !args.is_null() {
            // SAFETY: CPython passes `nargs` positional values followed by one per keyword name.
            unsafe { std::slice::from_raw_parts(args, count) }
        } else {
            &[]
        };
        // SAFETY: every pointer in `values` is a live object borrowed for the call.
        let value = |p: *mut ffi::PyObject| unsafe { Borrowed::from_ptr_or_opt(py, p) };
        let mut items = Vec::with_capacity(positional);
        for &p in values.iter().take(positional) {
            items.push(value(p).ok_or_else(|| PyTypeError::new_err("NULL argument"))?);
        }
        let kwargs = match names {
            Some(names) => {
                let dict = PyDict::new(py);
                for (name, &p) in names.iter().zip(values.iter().skip(positional)) {
                    if let Some(v) = value(p) {
                        dict.set_item(name, v)?;
                    }
                }
                Some(dict)
            }
            None => None,
        };
        full.bind(py)
            .call(PyTuple::new(py, items)?, kwargs.as_ref())
    };
    match catch_unwind(AssertUnwindSafe(call)) {
        Ok(Ok(obj)) => obj.into_ptr(),
        Ok(Err(err)) => {
            err.restore(py);
            ptr::null_mut()
        }
        Err(_) => {
            PyRuntimeError::new_err("internal error: panic in kvroute").restore(py);
            ptr::null_mut()
        }
    }
}
