//! The Python binding layer (`kvroute._core`).
//!
//! Rules: this layer only converts types, releases the GIL around work longer than a few
//! microseconds, and maps [`crate::Error`] to Python exceptions. Every binding returns `PyResult`;
//! nothing here panics on user input. Routing logic lives in the core modules.

mod blocks;
mod cache;
mod convert;
mod direct_call;
mod events;
mod gil;
mod hashing;
mod in_place;
mod index;
mod keys;
mod names;
mod router;

use parking_lot::{Mutex, RwLock};
use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    hashing::register(m)?;
    blocks::register(m)?;
    index::register(m)?;
    cache::register(m)?;
    events::register(m)?;
    router::register(m)?;
    Ok(())
}

/// Token inputs of at least this many tokens are hashed (and routed) with the GIL released.
const DETACH_MIN_TOKENS: usize = 512;

/// Runs `f` on the value behind `lock`. When `inline` (short work) and the lock is free, at once
/// with the GIL held — releasing and re-taking the GIL would cost more than the work; otherwise
/// with the GIL released, taking the lock inside `py.detach`. Never waits for the lock while
/// holding the GIL.
fn with_mutex<T: Send, R: Send>(
    py: Python<'_>,
    lock: &Mutex<T>,
    inline: bool,
    f: impl FnOnce(&mut T) -> R + Send,
) -> R {
    with_mutex_unless(py, lock, inline, |_| false, f)
}

/// [`with_mutex`] for a call that may first have unbounded work pending in the core (expiry):
/// inline only when `pending` says there is none.
fn with_mutex_unless<T: Send, R: Send>(
    py: Python<'_>,
    lock: &Mutex<T>,
    inline: bool,
    pending: impl FnOnce(&T) -> bool,
    f: impl FnOnce(&mut T) -> R + Send,
) -> R {
    if inline {
        if let Some(mut guard) = lock.try_lock() {
            if !pending(&guard) {
                return f(&mut guard);
            }
        }
    }
    py.detach(|| f(&mut lock.lock()))
}

/// [`with_mutex`] for read access to an `RwLock`.
fn with_read<T: Send + Sync, R: Send>(
    py: Python<'_>,
    lock: &RwLock<T>,
    inline: bool,
    f: impl FnOnce(&T) -> R + Send,
) -> R {
    if inline {
        if let Some(guard) = lock.try_read() {
            return f(&guard);
        }
    }
    py.detach(|| f(&lock.read()))
}

/// Runs `f` with write access to `lock`, the GIL released.
fn with_write<T: Send + Sync, R: Send>(
    py: Python<'_>,
    lock: &RwLock<T>,
    f: impl FnOnce(&mut T) -> R + Send,
) -> R {
    py.detach(|| f(&mut lock.write()))
}
