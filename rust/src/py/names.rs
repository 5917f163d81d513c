//! Python `str` objects for the names the core holds as `Arc<str>` by a dense id (nodes,
//! workers): each made once per id and reused while the id keeps its name.
//!
//! Guarantees: a cached `str` is returned for an id only when it was made from the very `Arc`
//! the core holds for that id now (identity, not equality: the cache keeps the `Arc` alive, so
//! its address cannot be reused by another name). The cache is only read and written with the
//! GIL held (a [`GilCell`]: no lock taken), and no Python code runs while it is borrowed (making
//! a `str` or setting a dict item does not start the cyclic garbage collector). A view made while
//! another is alive (which no caller does) reads and caches nothing: it makes each `str` afresh.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyString;

use super::gil::{GilBorrow, GilCell};

/// A name as the core holds it, and the Python `str` made from it.
type CachedName = (Arc<str>, Py<PyString>);

/// The cache (see the module docs).
#[derive(Default)]
pub struct NameCache(GilCell<Vec<Option<CachedName>>>);

impl NameCache {
    /// The cache borrowed once, for the many names of one call.
    pub fn view(&self, py: Python<'_>) -> NameView<'_> {
        NameView(self.0.borrow(py))
    }
}

/// The cache, borrowed (see [`NameCache::view`]); `None`: another view is alive.
pub struct NameView<'a>(Option<GilBorrow<'a, Vec<Option<CachedName>>>>);

impl NameView<'_> {
    /// Whether id `id`'s cached `str` was made from `name` itself. Reads no Python object: may be
    /// called under a core lock, to label a result read under it.
    pub fn holds(&self, id: u32, name: &Arc<str>) -> bool {
        self.0
            .as_ref()
            .and_then(|names| names.get(id as usize))
            .and_then(Option::as_ref)
            .is_some_and(|(cached, _)| Arc::ptr_eq(cached, name))
    }

    /// The cached `str` of id `id` (held since [`NameView::holds`] said so, with the GIL held
    /// throughout, so that no other call could change the cache), or `None`.
    pub fn cached<'py>(&self, py: Python<'py>, id: u32) -> Option<Bound<'py, PyString>> {
        let (_, s) = self.0.as_ref()?.get(id as usize)?.as_ref()?;
        Some(s.bind(py).clone())
    }

    /// The `str` of the name `name` that id `id` has: the cached one when made from `name`, else
    /// a new one, cached (uncached when another view is alive).
    pub fn get<'py>(&mut self, py: Python<'py>, id: u32, name: &Arc<str>) -> Bound<'py, PyString> {
        let Some(names) = self.0.as_deref_mut() else {
            return PyString::new(py, name);
        };
        let at = id as usize;
        if names.len() <= at {
            names.resize_with(at + 1, || None);
        }
        match names.get_mut(at) {
            Some(Some((cached, s))) if Arc::ptr_eq(cached, name) => s.bind(py).clone(),
            Some(slot) => {
                let s = PyString::new(py, name);
                *slot = Some((Arc::clone(name), s.clone().unbind()));
                s
            }
            None => PyString::new(py, name),
        }
    }
}
