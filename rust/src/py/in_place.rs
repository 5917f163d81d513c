//! Reading keys out of Python lists and tuples, and filling new lists, with as few C-API calls as
//! the ABI allows.
//!
//! Two builds, one behaviour. The version-specific build (cfg `cpython_in_place`, set by build.rs
//! for CPython with the GIL, not abi3, before 3.14, whose `str` layout PyO3 does not describe)
//! reads list and tuple items from the object's array, a compact `str`'s UTF-8 bytes where they
//! lie (the characters themselves for an ASCII string, the cached UTF-8 copy for any other), and
//! sets a new list's items directly; the abi3 build does the same through the stable API's calls.
//!
//! Guarantees:
//! - The bytes of a key are exactly those [`super::keys::with_key`] gives: a `str`'s UTF-8
//!   encoding, a `bytes`' contents, an `int`'s value. Anything [`str_utf8`] cannot read in place
//!   goes through the stable API (`PyUnicode_AsUTF8AndSize`, which also caches the UTF-8 copy).
//! - Python objects are read only with the GIL held. [`Seq::lookup_keys`] holds it for at most
//!   [`GIL_CHUNK`] keys at a time and lets other threads run between chunks; a list another thread
//!   changes meanwhile is read as `[f(k) for k in keys]` would read it: each position as it is when
//!   reached, to the list's length at the time (a list that shrinks ends the read early).
//! - No item is read past the list's current length: the length is read again after anything
//!   that may run Python code (the GIL released, a conversion that raises).

use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

use super::convert::memory_error;
use super::keys::with_key_at;
use crate::hashing::{Key, NodeId, RingBatch};

/// Keys looked up per hold of the GIL by [`Seq::lookup_keys`] (~0.1 ms of ketama `get_many`).
pub const GIL_CHUNK: usize = 8192;

/// Keys read ahead of the one hashed, on the build that reads them in place (see
/// [`Seq::lookup_keys`]).
#[cfg(cpython_in_place)]
const AHEAD: usize = 8;

/// The UTF-8 bytes of the `str` `op` (any subclass) where they already lie: a compact ASCII
/// string's characters, or a compact string's cached UTF-8 copy. `None` when there are none yet
/// (a non-ASCII string never encoded, a legacy or subclass string) or on the abi3 build.
///
/// # Safety
/// `op` is a live `str` object, the GIL is held, and the slice is used only while `op` lives.
#[inline(always)]
pub unsafe fn str_utf8<'a>(op: *mut pyo3::ffi::PyObject) -> Option<&'a [u8]> {
    #[cfg(cpython_in_place)]
    // SAFETY: the caller's contract. A compact string is one allocation: the header, then
    // (ASCII) the characters, whose UTF-8 encoding they are, or (other) the UTF-8 copy's pointer
    // and length, set once by CPython and freed with the string.
    unsafe {
        use pyo3::ffi;
        if ffi::PyUnicode_IS_COMPACT(op) == 0 {
            return None;
        }
        let (data, len) = if ffi::PyUnicode_IS_ASCII(op) != 0 {
            let ascii = op.cast::<ffi::PyASCIIObject>();
            (ascii.add(1).cast::<u8>().cast_const(), (*ascii).length)
        } else {
            let compact = op.cast::<ffi::PyCompactUnicodeObject>();
            (
                (*compact).utf8.cast::<u8>().cast_const(),
                (*compact).utf8_length,
            )
        };
        if data.is_null() {
            return None;
        }
        Some(std::slice::from_raw_parts(data, usize::try_from(len).ok()?))
    }
    #[cfg(not(cpython_in_place))]
    {
        let _ = op;
        None
    }
}

/// A sequence whose items are read by index: an exact `list` (which other threads may change
/// whenever the GIL is released) or an exact `tuple`.
#[derive(Clone, Copy)]
pub enum Seq<'a, 'py> {
    List(&'a Bound<'py, PyList>),
    Tuple(&'a Bound<'py, PyTuple>),
}

impl<'a, 'py> Seq<'a, 'py> {
    /// `obj` when it is an exact `list` or `tuple`.
    pub fn of(obj: &'a Bound<'py, PyAny>) -> Option<Self> {
        if let Ok(list) = obj.cast_exact::<PyList>() {
            Some(Seq::List(list))
        } else if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
            Some(Seq::Tuple(tuple))
        } else {
            None
        }
    }

    fn py(&self) -> Python<'py> {
        match self {
            Seq::List(l) => l.py(),
            Seq::Tuple(t) => t.py(),
        }
    }

    fn as_any(&self) -> &Bound<'py, PyAny> {
        match self {
            Seq::List(l) => l.as_any(),
            Seq::Tuple(t) => t.as_any(),
        }
    }

    /// The current length.
    #[inline(always)]
    fn len(&self) -> usize {
        #[cfg(cpython_in_place)]
        // SAFETY: live objects of these exact types; the GIL is held (they are bound).
        let n = unsafe {
            match self {
                Seq::List(l) => pyo3::ffi::PyList_GET_SIZE(l.as_ptr()),
                Seq::Tuple(t) => pyo3::ffi::PyTuple_GET_SIZE(t.as_ptr()),
            }
        };
        #[cfg(not(cpython_in_place))]
        // SAFETY: as above; neither call can fail on an object of its type.
        let n = unsafe {
            match self {
                Seq::List(l) => pyo3::ffi::PyList_Size(l.as_ptr()),
                Seq::Tuple(t) => pyo3::ffi::PyTuple_Size(t.as_ptr()),
            }
        };
        usize::try_from(n).unwrap_or(0)
    }

    /// Item `i`, a borrowed reference: valid while no Python code runs.
    ///
    /// # Safety
    /// `i` is below [`Seq::len`] read since Python code last ran; the GIL is held.
    #[inline(always)]
    unsafe fn item(&self, i: usize) -> *mut pyo3::ffi::PyObject {
        // `i` is below a length that fits in `Py_ssize_t`.
        let i = i as pyo3::ffi::Py_ssize_t;
        #[cfg(cpython_in_place)]
        // SAFETY: the caller's contract: `i` is in bounds.
        unsafe {
            match self {
                Seq::List(l) => pyo3::ffi::PyList_GET_ITEM(l.as_ptr(), i),
                Seq::Tuple(t) => pyo3::ffi::PyTuple_GET_ITEM(t.as_ptr(), i),
            }
        }
        #[cfg(not(cpython_in_place))]
        // SAFETY: the caller's contract (in bounds, so neither call fails).
        unsafe {
            match self {
                Seq::List(l) => pyo3::ffi::PyList_GetItem(l.as_ptr(), i),
                Seq::Tuple(t) => pyo3::ffi::PyTuple_GetItem(t.as_ptr(), i),
            }
        }
    }

    /// Pushes every key to `batch`, the owners going to `out` (see [`RingBatch`]). Keys are
    /// `str`, `bytes` or `int`, as [`super::keys::with_key`] takes them; the first other raises
    /// `TypeError` or `ValueError` naming its position. The GIL is released between chunks of
    /// [`GIL_CHUNK`] keys (see the module guarantees for a list changed meanwhile).
    pub fn lookup_keys(&self, batch: &mut RingBatch<'_>, out: &mut Vec<NodeId>) -> PyResult<()> {
        let py = self.py();
        let mut i: usize = 0;
        loop {
            let mut end = self.len().min(i.saturating_add(GIL_CHUNK));
            if i >= end {
                break;
            }
            out.try_reserve(end - i)
                .map_err(|_| memory_error(self.as_any(), "keys", self.len()))?;
            while i < end {
                #[cfg(cpython_in_place)]
                if i + AHEAD < end {
                    // SAFETY: `i + AHEAD < end <= len`, as for `i` below. The two cache lines a
                    // short key's object spans (header, then its characters) are fetched ahead:
                    // reading them is most of the cost of reading a key of a list built over
                    // time, whose objects lie scattered.
                    let ahead = unsafe { self.item(i + AHEAD) }.cast::<u8>().cast_const();
                    crate::mem::prefetch_addr(ahead);
                    crate::mem::prefetch_addr(ahead.wrapping_add(64));
                }
                // SAFETY: `i < end <= len`, the length read since Python code last ran; the GIL
                // is held. The item is borrowed from the sequence, which holds it while no Python
                // code runs: reading an exact `str` runs none.
                let item = unsafe { Borrowed::from_ptr_or_err(py, self.item(i))? };
                match item.cast_exact::<PyString>() {
                    Ok(s) => {
                        // SAFETY: a live `str`, the GIL held; the bytes are hashed before the
                        // next item is read.
                        let bytes = match unsafe { str_utf8(s.as_ptr()) } {
                            Some(bytes) => bytes,
                            None => s.to_str()?.as_bytes(),
                        };
                        batch.push(Key::Bytes(bytes), out);
                    }
                    Err(_) => {
                        // Through a strong reference: a conversion that fails runs Python code
                        // (the error message's `repr`), which may change the list.
                        with_key_at(&item.to_owned(), Some(i), |k| batch.push(k, out))?;
                        end = end.min(self.len());
                    }
                }
                i += 1;
            }
            if i < self.len() {
                // Other threads may run (and change the list) before the next chunk.
                py.detach(|| ());
            }
        }
        batch.finish(out);
        Ok(())
    }
}

/// Sets item `i` of `list`, a new list of at least `i + 1` slots that no other code has seen, to
/// `item`, whose reference it takes.
///
/// # Safety
/// As stated: `list` is new and ours alone, `i` in range, slot `i` not set before; GIL held.
#[inline(always)]
pub unsafe fn set_new_list_item(
    list: *mut pyo3::ffi::PyObject,
    i: pyo3::ffi::Py_ssize_t,
    item: *mut pyo3::ffi::PyObject,
) {
    #[cfg(cpython_in_place)]
    // SAFETY: the caller's contract (the macro of new lists: no check, no old item to release).
    unsafe {
        pyo3::ffi::PyList_SET_ITEM(list, i, item)
    };
    #[cfg(not(cpython_in_place))]
    // SAFETY: the caller's contract; it cannot fail on an exact list and an index in range.
    unsafe {
        pyo3::ffi::PyList_SetItem(list, i, item)
    };
}
