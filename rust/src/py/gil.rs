//! State shared by threads without a lock on the paths where the GIL already keeps them apart:
//! on the hot paths (`HashRing.get`: a 14-byte key in ~100 ns) an atomic read-modify-write per
//! lock and unlock was a tenth of the call.
//!
//! - [`Published`]: a value replaced whole (`replace`: the next value made from the current one
//!   with the GIL released, then swapped in). `attached` reads it in place with the GIL held and
//!   no lock; `read` under a read lock (with the GIL held when it is free at once, else released);
//!   `snapshot` takes a reference to the current value that outlives both (for work that releases
//!   the GIL between steps and must see one value throughout). Guarantees: a reader sees the
//!   value before or after a change, never part of one; a change that fails or panics publishes
//!   nothing; writers are serialised, so no change is lost; a replaced value is freed only once no
//!   reader or snapshot can hold it.
//! - [`GilCell`]: a value one thread holding the GIL at a time borrows mutably. A second borrow
//!   while the first lives (re-entry, or a borrow held across a GIL release) is refused (`None`),
//!   never granted.
//!
//! Both rely on the GIL being a mutual exclusion between the threads that touch them: CPython with
//! the GIL (PyO3 refuses sub-interpreters, which could each have their own). On a free-threaded
//! build (`Py_GIL_DISABLED`) they are ordinary locks instead: `attached` takes the read lock,
//! [`GilCell`] a mutex, and neither waits for its lock while attached (a wait there could hold up
//! a stop-the-world pause that the holder needs).

#[cfg(not(Py_GIL_DISABLED))]
use std::cell::UnsafeCell;
use std::marker::PhantomData;
#[cfg(not(Py_GIL_DISABLED))]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
#[cfg(Py_GIL_DISABLED)]
use parking_lot::{Mutex, MutexGuard};
use pyo3::prelude::*;

use super::{with_read, with_write};

/// A value read without a lock by threads holding the GIL; see the module docs.
pub struct Published<T> {
    /// Held by a writer from its read of the value to the publication of the next, and by
    /// readers that do not rely on the GIL while they read.
    lock: RwLock<()>,
    /// The current value, one strong count of an `Arc` (made by `Arc::into_raw`). Replaced only
    /// with the write lock and (but on a free-threaded build) the GIL held; the count it held on
    /// the value it replaced is dropped after.
    live: AtomicPtr<T>,
    /// `Send` and `Sync` as an `RwLock<T>` is.
    _value: PhantomData<RwLock<T>>,
}

impl<T> Drop for Published<T> {
    fn drop(&mut self) {
        // SAFETY: `live` holds a strong count from `Arc::into_raw` that only `self` owns.
        drop(unsafe { Arc::from_raw(*self.live.get_mut()) });
    }
}

impl<T: Send + Sync> Published<T> {
    pub fn new(value: T) -> Self {
        Self {
            lock: RwLock::new(()),
            live: AtomicPtr::new(Arc::into_raw(Arc::new(value)).cast_mut()),
            _value: PhantomData,
        }
    }

    /// The current value.
    ///
    /// # Safety
    /// The caller holds `lock` (either way) until it no longer uses the value, or — on a build
    /// with the GIL — holds the GIL and keeps it that long.
    #[inline(always)]
    unsafe fn current(&self) -> &T {
        // SAFETY: `live` is never null and its count is dropped only after being replaced, with
        // the write lock and the GIL held, which the caller's contract excludes during the borrow.
        unsafe { &*self.live.load(Ordering::Acquire) }
    }

    /// Runs `f` on the current value with the GIL held and no lock taken. (On a free-threaded
    /// build: under the read lock, waited for with this thread detached and holding nothing when
    /// it attaches again — PyO3 may run finalisers then — if a writer holds it.)
    ///
    /// # Safety
    /// `f` must not release the GIL: not detach, not run Python code, not drop a Python object
    /// other than a `str` (a finaliser is Python code, which may release it). Making a `str`, a
    /// new reference or an exception is fine.
    #[inline(always)]
    pub unsafe fn attached<R>(&self, py: Python<'_>, f: impl FnOnce(&T) -> R) -> R {
        #[cfg(not(Py_GIL_DISABLED))]
        {
            let _ = py;
            // SAFETY: this thread holds the GIL (`py`) and keeps it until `f` returns (the
            // caller's contract).
            f(unsafe { self.current() })
        }
        #[cfg(Py_GIL_DISABLED)]
        loop {
            if let Some(_held) = self.lock.try_read() {
                // SAFETY: the read lock is held until `f` returns.
                return f(unsafe { self.current() });
            }
            py.detach(|| drop(self.lock.read()));
        }
    }

    /// Runs `f` on the current value under the read lock: with the GIL held when `inline` (short
    /// work) and the lock is free at once, else with the GIL released ([`with_read`]).
    pub fn read<R: Send>(&self, py: Python<'_>, inline: bool, f: impl FnOnce(&T) -> R + Send) -> R {
        // SAFETY: the read lock is held while `f` runs.
        with_read(py, &self.lock, inline, |()| f(unsafe { self.current() }))
    }

    /// A strong reference to the current value: it stays alive (and unchanged) however long the
    /// caller keeps it, across GIL releases and later changes, which publish other values.
    pub fn snapshot(&self, py: Python<'_>) -> Arc<T> {
        // SAFETY: `attached` holds the GIL or the read lock while the closure runs, and the
        // closure runs no Python code. The value is the one `live` holds a strong count of (see
        // `current`), alive while that count stands; a count added here keeps it alive after.
        unsafe {
            self.attached(py, |value| {
                let at: *const T = value;
                Arc::increment_strong_count(at);
                Arc::from_raw(at)
            })
        }
    }

    /// Replaces the value with `f(value)`, made with the GIL released, when `f` succeeds; its
    /// error (or panic) leaves the value as it was. The GIL is taken for the swap alone, through
    /// the C API, which runs no Python code (PyO3's `attach` may run finalisers, which could
    /// call back into this value and wait for its write lock, held here).
    pub fn replace<E: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&T) -> Result<T, E> + Send,
    ) -> Result<(), E> {
        with_write(py, &self.lock, |()| {
            // SAFETY: the write lock is held.
            let next = Arc::into_raw(Arc::new(f(unsafe { self.current() })?)).cast_mut();
            let old = with_gil(|| self.live.swap(next, Ordering::AcqRel));
            // SAFETY: `old` is the strong count `live` held, from `Arc::into_raw`, and no reader
            // borrows through it now: readers under the lock are excluded by the write lock;
            // readers relying on the GIL read it before the swap (whose thread held the GIL) or
            // read `next`. Snapshots hold counts of their own.
            drop(unsafe { Arc::from_raw(old) });
            Ok(())
        })
    }
}

/// Runs `f` holding the GIL (on a free-threaded build, none to take: `f` runs as is), on a
/// thread detached from its Python thread state (inside `py.detach`). Runs no Python code.
fn with_gil<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(not(Py_GIL_DISABLED))]
    {
        /// Gives the GIL back however `f` ends.
        struct Release(pyo3::ffi::PyGILState_STATE);
        impl Drop for Release {
            fn drop(&mut self) {
                // SAFETY: the state `PyGILState_Ensure` returned, given back once.
                unsafe { pyo3::ffi::PyGILState_Release(self.0) }
            }
        }
        // SAFETY: this thread has a Python thread state (it detached from it), which `Ensure`
        // makes current again, taking the GIL; `Release` detaches it again.
        let _gil = Release(unsafe { pyo3::ffi::PyGILState_Ensure() });
        f()
    }
    #[cfg(Py_GIL_DISABLED)]
    f()
}

/// A value borrowed mutably by one thread holding the GIL at a time; see the module docs.
pub struct GilCell<T> {
    #[cfg(not(Py_GIL_DISABLED))]
    busy: AtomicBool,
    #[cfg(not(Py_GIL_DISABLED))]
    value: UnsafeCell<T>,
    #[cfg(Py_GIL_DISABLED)]
    value: Mutex<T>,
}

// SAFETY: the value is reached only through `borrow`, by a thread holding the GIL, with `busy`
// clear (set until the guard drops), so by one thread at a time; `T: Send` lets it move between
// threads that way.
#[cfg(not(Py_GIL_DISABLED))]
unsafe impl<T: Send> Sync for GilCell<T> {}

impl<T: Default> Default for GilCell<T> {
    fn default() -> Self {
        Self {
            #[cfg(not(Py_GIL_DISABLED))]
            busy: AtomicBool::new(false),
            value: Default::default(),
        }
    }
}

/// A mutable borrow of a [`GilCell`]'s value, given back when dropped.
pub struct GilBorrow<'a, T> {
    #[cfg(not(Py_GIL_DISABLED))]
    cell: &'a GilCell<T>,
    #[cfg(Py_GIL_DISABLED)]
    guard: MutexGuard<'a, T>,
}

impl<T> GilCell<T> {
    /// The value, unless borrowed already (on a free-threaded build: unless its mutex is taken).
    #[inline(always)]
    pub fn borrow<'a>(&'a self, py: Python<'_>) -> Option<GilBorrow<'a, T>> {
        let _ = py;
        #[cfg(not(Py_GIL_DISABLED))]
        {
            // Only threads holding the GIL (`py`) get here, one at a time: the check and the set
            // cannot interleave with another thread's (no read-modify-write needed). A borrow
            // released without the GIL is published by the `Release` store of its drop.
            if self.busy.load(Ordering::Acquire) {
                return None;
            }
            self.busy.store(true, Ordering::Relaxed);
            Some(GilBorrow { cell: self })
        }
        #[cfg(Py_GIL_DISABLED)]
        {
            self.value.try_lock().map(|guard| GilBorrow { guard })
        }
    }
}

impl<T> std::ops::Deref for GilBorrow<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        #[cfg(not(Py_GIL_DISABLED))]
        {
            // SAFETY: this borrow is the only one (see `GilCell::borrow`).
            unsafe { &*self.cell.value.get() }
        }
        #[cfg(Py_GIL_DISABLED)]
        {
            &self.guard
        }
    }
}

impl<T> std::ops::DerefMut for GilBorrow<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        #[cfg(not(Py_GIL_DISABLED))]
        {
            // SAFETY: this borrow is the only one (see `GilCell::borrow`).
            unsafe { &mut *self.cell.value.get() }
        }
        #[cfg(Py_GIL_DISABLED)]
        {
            &mut self.guard
        }
    }
}

#[cfg(not(Py_GIL_DISABLED))]
impl<T> Drop for GilBorrow<'_, T> {
    fn drop(&mut self) {
        self.cell.busy.store(false, Ordering::Release);
    }
}
