//! Module functions with CPython's `METH_FASTCALL` calling convention, for per-call hot paths.
//!
//! pyo3 gives functions of an abi3-py39 module the tuple convention (`METH_FASTCALL` joined the
//! limited API only in 3.10): every call builds an argument tuple and parses it, which costs about
//! 60 ns on top of the work. CPython calls a `METH_FASTCALL | METH_KEYWORDS` builtin as
//! `f(module, args, nargs, kwnames)` since 3.7, with the same ABI in every later 3.x, so a
//! hand-made `PyMethodDef` with those flags works in every interpreter this wheel loads in.
//!
//! Guarantees: arguments bind by position or by keyword as in a Python `def` (unknown, repeated or
//! missing arguments raise `TypeError`); errors become Python exceptions; a panic in a body is
//! caught and raised as `RuntimeError` instead of unwinding into CPython.

use std::ffi::CStr;
use std::os::raw::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

/// `METH_FASTCALL` (CPython `methodobject.h`; hidden by pyo3-ffi for abi3 builds before 3.10).
const METH_FASTCALL: c_int = 0x0080;

/// The C signature CPython uses to call a `METH_FASTCALL | METH_KEYWORDS` function: positional
/// arguments, then the values of the keywords named in the `kwnames` tuple (or NULL).
pub type FastCFunction = unsafe extern "C" fn(
    *mut ffi::PyObject,
    *const *mut ffi::PyObject,
    ffi::Py_ssize_t,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;

/// Adds `f` to module `m` as a `METH_FASTCALL | METH_KEYWORDS` builtin called `name`. `doc` may
/// start with a text signature (`"name($module, a, b)\n--\n\n..."`), which `inspect.signature`
/// reads.
pub fn add_function(
    m: &Bound<'_, PyModule>,
    name: &'static CStr,
    doc: &'static CStr,
    f: FastCFunction,
) -> PyResult<()> {
    // SAFETY: C extensions store METH_FASTCALL functions in the `PyCFunction` slot, cast; CPython
    // looks at `ml_flags` and calls the pointer back with the `FastCFunction` signature.
    let meth = unsafe { std::mem::transmute::<FastCFunction, ffi::PyCFunction>(f) };
    // The definition must outlive every function object made from it: it is created once per
    // module initialisation and never freed.
    let def: &'static mut ffi::PyMethodDef = Box::leak(Box::new(ffi::PyMethodDef {
        ml_name: name.as_ptr(),
        ml_meth: ffi::PyMethodDefPointer { PyCFunction: meth },
        ml_flags: METH_FASTCALL | ffi::METH_KEYWORDS,
        ml_doc: doc.as_ptr(),
    }));
    let module_name = m.name()?;
    // SAFETY: `def` is valid forever; `m` and `module_name` are live objects; the GIL is held.
    let func = unsafe {
        Bound::from_owned_ptr_or_err(
            m.py(),
            ffi::PyCFunction_NewEx(def, m.as_ptr(), module_name.as_ptr()),
        )?
    };
    m.add(name.to_string_lossy().as_ref(), func)
}

/// Runs the body of a fastcall function: attaches the Python token, binds the arguments to the
/// parameters `names` (by position, then by keyword), and turns an error or a panic into a raised
/// exception (returning NULL). `body` receives one borrowed argument per name, all `Some`.
///
/// # Safety
/// Call only from a function CPython invoked through [`add_function`]'s definition, passing its
/// `args`, `nargs` and `kwnames` unchanged: the GIL is held, `args` points to `nargs` positional
/// values followed by one value per name in the `kwnames` tuple (or `kwnames` is NULL).
pub unsafe fn run<const N: usize, F>(
    name: &str,
    names: [&str; N],
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
    body: F,
) -> *mut ffi::PyObject
where
    F: for<'a, 'py> FnOnce(
        Python<'py>,
        [Option<Borrowed<'a, 'py, PyAny>>; N],
    ) -> PyResult<Bound<'py, PyAny>>,
{
    // SAFETY: CPython holds the GIL (attached thread state) while calling a builtin.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: `kwnames` is NULL or a live tuple of str owned by the caller for the call.
    let kwnames = unsafe { Borrowed::from_ptr_or_opt(py, kwnames) };
    let positional = usize::try_from(nargs).unwrap_or(0);
    let keywords = kwnames.as_ref().map_or(0, |k| k.len().unwrap_or(0));
    let values: &[*mut ffi::PyObject] = if positional + keywords > 0 && !args.is_null() {
        // SAFETY: CPython passes `nargs` positional values followed by one per keyword name.
        unsafe { std::slice::from_raw_parts(args, positional + keywords) }
    } else {
        &[]
    };
    let call = || -> PyResult<Bound<'_, PyAny>> {
        let bound = bind(py, name, &names, values, positional, kwnames)?;
        body(py, bound)
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

/// Binds `values` (`positional` of them by position, the rest named by `kwnames`) to `names`;
/// on success every slot is `Some`.
fn bind<'a, 'py, const N: usize>(
    py: Python<'py>,
    function: &str,
    names: &[&str; N],
    values: &'a [*mut ffi::PyObject],
    positional: usize,
    kwnames: Option<Borrowed<'a, 'py, PyAny>>,
) -> PyResult<[Option<Borrowed<'a, 'py, PyAny>>; N]> {
    let mut slots: [Option<Borrowed<'a, 'py, PyAny>>; N] = [None; N];
    if positional > N {
        return Err(PyTypeError::new_err(format!(
            "{function}() takes {N} arguments ({positional} given)"
        )));
    }
    // SAFETY: every pointer in `values` is a live object borrowed for the duration of the call.
    let value = |i: usize| {
        values
            .get(i)
            .and_then(|&p| unsafe { Borrowed::from_ptr_or_opt(py, p) })
    };
    for (i, slot) in slots.iter_mut().enumerate().take(positional) {
        *slot = value(i);
    }
    if let Some(kwnames) = kwnames {
        let kwnames = kwnames.cast::<PyTuple>()?;
        for (k, key) in kwnames.iter_borrowed().enumerate() {
            let key = key.cast::<PyString>()?;
            let key = key.to_cow()?;
            let Some(at) = names.iter().position(|n| *n == key) else {
                return Err(PyTypeError::new_err(format!(
                    "{function}() got an unexpected keyword argument {key:?}"
                )));
            };
            match slots.get_mut(at) {
                Some(Some(_)) => {
                    return Err(PyTypeError::new_err(format!(
                        "{function}() got multiple values for argument {key:?}"
                    )))
                }
                Some(slot) => *slot = value(positional + k),
                None => {}
            }
        }
    }
    if let Some(missing) = slots.iter().position(Option::is_none) {
        return Err(PyTypeError::new_err(format!(
            "{function}() missing required argument {:?}",
            names.get(missing).copied().unwrap_or("?")
        )));
    }
    Ok(slots)
}
