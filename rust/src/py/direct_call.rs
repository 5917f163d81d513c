//! Module functions and methods CPython calls directly (`METH_FASTCALL | METH_KEYWORDS`), for
//! per-call hot paths where PyO3's calling machinery is most of the cost.
//!
//! A `#[pyfunction]` goes through PyO3's trampoline (GIL-count bookkeeping in thread-local
//! storage, the reference pool, a panic guard) and its generic argument binder: about 140 of the
//! ~320 instructions of a `jump_hash(key, n)` call (callgrind). A direct function handles the
//! common call — exact positional arguments of the expected types and values — itself, and
//! forwards every other call, unchanged, to the PyO3 function it stands for, which binds keywords
//! and raises the precise errors. So the direct function adds a fast path and nothing else: its
//! signature, errors and results are the PyO3 function's. A direct method ([`add_method`])
//! replaces a PyO3 method of a class the same way (CPython checks `self`'s type before the call).
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
use pyo3::types::{PyDict, PyTuple, PyType};

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
    // A second module initialisation keeps the first.
    let _ = slot.set(py, full.unbind());
    let def = method_def(name, doc, direct);
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

/// The `METH_FASTCALL | METH_KEYWORDS` definition of `direct`. It must outlive every function
/// or descriptor made from it: made once per module initialisation and never freed.
fn method_def(
    name: &'static CStr,
    doc: &'static CStr,
    direct: FastCFunction,
) -> *mut ffi::PyMethodDef {
    // SAFETY: C extensions store METH_FASTCALL functions in the `PyCFunction` slot, cast; CPython
    // reads `ml_flags` and calls the pointer back with the `FastCFunction` signature.
    let meth = unsafe { std::mem::transmute::<FastCFunction, ffi::PyCFunction>(direct) };
    Box::into_raw(Box::new(ffi::PyMethodDef {
        ml_name: name.as_ptr(),
        ml_meth: ffi::PyMethodDefPointer { PyCFunction: meth },
        ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
        ml_doc: doc.as_ptr(),
    }))
}

/// Makes `direct` the method `name` of class `ty` (a method descriptor, as a C extension's
/// method is), standing for the PyO3 method of that name, which is kept in `slot` for
/// [`forward_method`]. The docstring and text signature are the PyO3 method's.
pub fn add_method(
    ty: &Bound<'_, PyType>,
    name: &'static CStr,
    direct: FastCFunction,
    slot: &'static PyOnceLock<Py<PyAny>>,
) -> PyResult<()> {
    let py = ty.py();
    let key = name.to_string_lossy();
    let full = ty.getattr(key.as_ref())?;
    let text = |attr: &str| -> PyResult<Option<String>> {
        let value = full.getattr(attr)?;
        Ok(if value.is_none() {
            None
        } else {
            Some(value.extract()?)
        })
    };
    // CPython's docstring format: the text signature line, "--", a blank line, the text.
    let doc = match (text("__text_signature__")?, text("__doc__")?) {
        (Some(sig), doc) => format!("{key}{sig}\n--\n\n{}", doc.unwrap_or_default()),
        (None, doc) => doc.unwrap_or_default(),
    };
    let doc = std::ffi::CString::new(doc)
        .map_err(|_| PyRuntimeError::new_err("internal error: NUL in a docstring"))?;
    // A second module initialisation keeps the first.
    let _ = slot.set(py, full.unbind());
    // Never freed, as the definition that points to it.
    let def = method_def(name, Box::leak(doc.into_boxed_c_str()), direct);
    // SAFETY: `def` is valid forever; `ty` is a live type object; the GIL is held.
    let descr = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            ffi::PyDescr_NewMethod(ty.as_ptr().cast::<ffi::PyTypeObject>(), def),
        )?
    };
    ty.setattr(key.as_ref(), descr)
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
    // SAFETY: the caller's contract.
    unsafe { forward_call(slot, ptr::null_mut(), args, nargs, kwnames) }
}

/// [`forward`] for a direct method: calls the PyO3 method in `slot` with `slf` and the
/// arguments CPython passed.
///
/// # Safety
/// As [`forward`]; `slf` is the `self` CPython passed.
#[cold]
#[inline(never)]
pub unsafe fn forward_method(
    slot: &PyOnceLock<Py<PyAny>>,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: the caller's contract; a NULL `self` is refused below.
    unsafe {
        if slf.is_null() {
            let py = Python::assume_attached();
            PyTypeError::new_err("NULL self").restore(py);
            return ptr::null_mut();
        }
        forward_call(slot, slf, args, nargs, kwnames)
    }
}

/// Calls the callable in `slot` with `first` (unless NULL) and then the arguments as CPython
/// passed them.
///
/// # Safety
/// As [`forward`]; `first` is NULL or a live object.
unsafe fn forward_call(
    slot: &PyOnceLock<Py<PyAny>>,
    first: *mut ffi::PyObject,
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
        let mut items = Vec::with_capacity(positional + 1);
        // SAFETY: `first` is NULL or live, borrowed for the call.
        items.extend(unsafe { Borrowed::from_ptr_or_opt(py, first) });
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
    returned(py, call)
}

/// The result of `call` as a C function returns it: a new reference, or NULL with the error set
/// (a panic is caught and raised as `RuntimeError`, never unwinds into CPython).
#[inline(always)]
pub fn returned<'py, T>(
    py: Python<'py>,
    call: impl FnOnce() -> PyResult<Bound<'py, T>>,
) -> *mut ffi::PyObject {
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
