//! State that threads holding the GIL share without a lock: the GIL already excludes them from
//! one another, and on the hot paths (`HashRing.get`: a 14-byte key in ~100 ns) an atomic
//! read-modify-write per lock and unlock was a tenth of the call.
//!
//! - [`Published`]: a value read in place by threads holding the GIL and replaced whole (copy,
//!   change, publish). Guarantees: a reader sees the value before or after a change, never
//!   part of one; a change that fails or panics publishes nothing; writers are serialised, so no
//!   change is lost; readers without the GIL (long batches) read under a read lock, which holds
//!   the value they see until they let go.
//! - [`GilCell`]: a value one thread holding the GIL at a time borrows mutably. A second borrow
//!   while the first lives (re-entry, or a borrow held across a GIL release) is refused (`None`),
//!   never granted.
//!
//! Both rely on the GIL being a mutual exclusion between the threads that touch them: CPython with
//! the GIL (PyO3 refuses sub-interpreters, which could each have their own). On a free-threaded
//! build (`Py_GIL_DISABLED`) they are ordinary locks instead: [`Published`] reads take its read
//! lock, [`GilCell`] a mutex (never waited for while attached — a wait there could hold up a
//! stop-the-world pause that the holder needs).

#[cfg(not(Py_GIL_DISABLED))]
use std::cell::UnsafeCell;
#[cfg(not(Py_GIL_DISABLED))]
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use parking_lot::RwLock;
#[cfg(Py_GIL_DISABLED)]
use parking_lot::{Mutex, MutexGuard};
use pyo3::prelude::*;

/// A value read without a lock by threads holding the GIL; see the module docs.
pub struct Published<T> {
    /// The current value. A writer holds the write lock from its copy to the publication;
    /// readers without the GIL hold the read lock.
    lock: RwLock<Box<T>>,
    /// The address of the value in `lock`: stored only with both the write lock and the GIL
    /// held, and the value it replaced freed only after that store.
    #[cfg(not(Py_GIL_DISABLED))]
    live: AtomicPtr<T>,
}

impl<T: Clone + Send + Sync> Published<T> {
    pub fn new(value: T) -> Self {
        let value = Box::new(value);
        Self {
            #[cfg(not(Py_GIL_DISABLED))]
            live: AtomicPtr::new(std::ptr::from_ref::<T>(&value).cast_mut()),
            lock: RwLock::new(value),
        }
    }

    /// Runs `f` on the current value with the GIL held and no lock taken. (On a free-threaded
    /// build: under the read lock, waited for with this thread detached if a writer holds it.)
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
            // caller's contract). `live` is replaced only by a thread holding the GIL, and the
            // value it pointed to freed only after that, so the value loaded here outlives `f`.
            f(unsafe { &*self.live.load(Ordering::Acquire) })
        }
        #[cfg(Py_GIL_DISABLED)]
        {
            use parking_lot::lock_api::RawRwLock as _;
            let value = self.lock.try_read().unwrap_or_else(|| {
                // SAFETY: the read lock is taken here (detached) and handed to the guard, which
                // releases it.
                unsafe {
                    py.detach(|| self.lock.raw().lock_shared());
                    self.lock.make_read_guard_unchecked()
                }
            });
            f(&value)
        }
    }

    /// Runs `f` on the current value: when `inline` (short work), at once with the GIL held;
    /// otherwise with the GIL released, under the read lock.
    pub fn read<R: Send>(&self, py: Python<'_>, inline: bool, f: impl FnOnce(&T) -> R + Send) -> R {
        if inline {
            // SAFETY: `f` is `Send`, so it holds no GIL token and no Python object: pure Rust,
            // which cannot release the GIL.
            return unsafe { self.attached(py, f) };
        }
        py.detach(|| f(&self.lock.read()))
    }

    /// Changes a copy of the value with `f` (the GIL released), then publishes the copy (the
    /// GIL held for the swap alone). The copy is published whatever `f` returns; `f` that
    /// changes nothing on error leaves the value as it was. A panic in `f` publishes nothing.
    pub fn write<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut T) -> R + Send) -> R {
        py.detach(|| {
            let mut current = self.lock.write();
            let mut next = Box::new(T::clone(&current));
            let r = f(&mut next);
            let old = Python::attach(|_| {
                let old = std::mem::replace(&mut *current, next);
                #[cfg(not(Py_GIL_DISABLED))]
                self.live.store(
                    std::ptr::from_ref::<T>(&current).cast_mut(),
                    Ordering::Release,
                );
                old
            });
            // Freed with the GIL released: no reader holds it (see `live`).
            drop(current);
            drop(old);
            r
        })
    }
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
