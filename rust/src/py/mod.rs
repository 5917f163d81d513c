//! The Python binding layer (`kvroute._core`).
//!
//! Rules: this layer only converts types, releases the GIL around work longer than a few
//! microseconds, and maps [`crate::Error`] to Python exceptions. Every binding returns `PyResult`;
//! nothing here panics on user input. Routing logic lives in the core modules.

mod blocks;
mod cache;
mod convert;
mod events;
mod fastcall;
mod hashing;
mod index;
mod router;

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
