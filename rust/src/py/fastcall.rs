//! Module functions with CPython's `METH_FASTCALL` calling convention, for per-call hot paths.
//!
//! pyo3 gives functions of an abi3-py39 module the tuple convention (`METH_FASTCALL` joined the
//! limited API only in 3.10): every call builds an argument tuple and parses it, which costs about
//! 60 ns on top of the work. CPython calls a `METH_FASTCALL` builtin as `f(module, args, nargs)`
//! since 3.7, with the same ABI in every later 3.x, so a hand-made `PyMethodDef` with that flag
//! works in every interpreter this wheel loads in.
//!
//! Guarantees: the functions take positional arguments only (CPython itself rejects keywords with
//! `TypeError`); errors become Python exceptions; a panic in a body is caught and raised as
//! `RuntimeError` instead of unwinding into CPython.

use std::ffi::CStr;
use std::os::raw::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;

/// `METH_FASTCALL` (CPython `methodobject.h`; hidden by pyo3-ffi for abi3 builds before 3.10).
const METH_FASTCALL: c_int = 0x0080;

/// The C signature CPython uses to call a `METH_FASTCALL` function.
pub type FastCFunction = unsafe extern "C" fn(
    *mut ffi::PyObject,
    *const *mut ffi::PyObject,
    ffi::Py_ssize_t,
) -> *mut ffi::PyObject;

/// Adds `f` to module `m` as a `METH_FASTCALL` builtin called `name`. `doc` may start with a
/// text signature (`"name($module, a, b, /)\n--\n\n..."`), which `inspect.signature` reads.
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
        ml_flags: METH_FASTCALL,
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

/// Runs the body of a `METH_FASTCALL` function: attaches the Python token, views the arguments,
/// and turns an error or a panic into a raised exception (returning NULL).
///
/// # Safety
/// Call only from a function CPython invoked through [`add_function`]'s definition, passing its
/// `args` and `nargs` unchanged: the GIL is held and `args` points to `nargs` live objects.
pub unsafe fn run<F>(
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    body: F,
) -> *mut ffi::PyObject
where
    F: for<'py> FnOnce(Python<'py>, &[*mut ffi::PyObject]) -> PyResult<Bound<'py, PyAny>>,
{
    // SAFETY: CPython holds the GIL (attached thread state) while calling a builtin.
    let py = unsafe { Python::assume_attached() };
    let args: &[*mut ffi::PyObject] = match usize::try_from(nargs) {
        // SAFETY: CPython passes `nargs` valid, non-null argument pointers.
        Ok(n) if n > 0 && !args.is_null() => unsafe { std::slice::from_raw_parts(args, n) },
        _ => &[],
    };
    match catch_unwind(AssertUnwindSafe(|| body(py, args))) {
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

/// A borrowed view of argument `i` of a fastcall body, or `None` past the end.
pub fn arg<'a, 'py>(
    py: Python<'py>,
    args: &'a [*mut ffi::PyObject],
    i: usize,
) -> Option<Borrowed<'a, 'py, PyAny>> {
    // SAFETY: `args` comes from `run`, so every pointer is a live object borrowed for the call.
    args.get(i)
        .and_then(|&p| unsafe { Borrowed::from_ptr_or_opt(py, p) })
}
