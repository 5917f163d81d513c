//! The request arguments `route` and `route_pd` share, converted under the GIL and routed with
//! it released when the work can be long (see the parent module).

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use super::{PyRouter, DETACH_MIN_BLOCKS, DETACH_MIN_TOKENS};
use crate::hashing::Key;
use crate::py::convert::{
    names_from_py, optional, tokens_from_py, typed, u64_slice, Name, Negative, Tokens,
};
use crate::py::keys::with_key;
use crate::router::{prepared_then_locked, prompt_hashes, RouteRequest, Router};

/// A routing key copied out of Python (so routing can run without the GIL).
enum OwnedKey {
    Bytes(Vec<u8>),
    Int(u64),
}

impl OwnedKey {
    fn as_key(&self) -> Key<'_> {
        match self {
            OwnedKey::Bytes(b) => Key::Bytes(b),
            OwnedKey::Int(k) => Key::Int(*k),
        }
    }
}

/// The arguments `route` and `route_pd` share: tokens, block_hashes, key, endpoint, exclude,
/// now.
pub(super) type RouteArgs<'a, 'py> = (
    Option<&'a Bound<'py, PyAny>>,
    Option<&'a Bound<'py, PyAny>>,
    Option<&'a Bound<'py, PyAny>>,
    Option<Name<'a>>,
    Option<&'a Bound<'py, PyAny>>,
    Option<f64>,
);

impl PyRouter {
    /// Converts a request's arguments, hashes its tokens (with the GIL released for long
    /// prompts) and runs `f` (route or route_pd) on the core with it.
    pub(super) fn routed<T: Send>(
        &self,
        py: Python<'_>,
        (tokens, block_hashes, key, endpoint, exclude, now): RouteArgs<'_, '_>,
        f: impl Fn(&mut Router, RouteRequest<'_>) -> crate::Result<T> + Send + Sync,
    ) -> PyResult<T> {
        let key = optional(key, |k| {
            with_key(k, |k| match k {
                Key::Bytes(b) => OwnedKey::Bytes(b.to_vec()),
                Key::Int(v) => OwnedKey::Int(v),
            })
        })?;
        let exclude =
            optional(exclude, |e| names_from_py(e, "exclude", "exclude item"))?.unwrap_or_default();
        let excluded: Vec<&str> = exclude.iter().map(String::as_str).collect();
        let endpoint = endpoint.as_deref();
        let now = self.clock.now(now);
        let request = RouteRequest {
            hashes: Vec::new(),
            prompt_tokens: None,
            key: key.as_ref().map(OwnedKey::as_key),
            endpoint,
            exclude: &excluded,
            now,
        };
        let out = match (tokens, block_hashes) {
            (Some(_), Some(_)) => {
                return Err(PyTypeError::new_err(
                    "route() takes tokens or block_hashes, not both",
                ))
            }
            // No prompt: nothing to hash or match (routed by key, endpoint or load).
            (None, None) => self.run_at(py, true, now, |r| f(r, request))?,
            (Some(tokens), None) => {
                let array = tokens_from_py(tokens)?;
                let tokens = Tokens::of(&array);
                let n = tokens.len();
                let hasher = self.run(py, true, |r| r.hasher_for(endpoint))?;
                let hash = || -> crate::Result<RouteRequest<'_>> {
                    Ok(RouteRequest {
                        hashes: typed!(tokens, |s| prompt_hashes(&hasher, s))?,
                        prompt_tokens: Some(n),
                        ..request
                    })
                };
                if n < DETACH_MIN_TOKENS {
                    let request = hash()?;
                    self.run_at(py, true, now, |r| f(r, request))?
                } else {
                    // Hashing a long prompt is long work too: both run with the GIL released,
                    // the hashing before the router's lock is taken.
                    py.detach(|| prepared_then_locked(&self.core, hash, &f))?
                }
            }
            (None, Some(hashes)) => {
                let hashes = u64_slice(hashes, "block_hashes", Negative::Reinterpret)?;
                let mut hashes = hashes.as_slice().to_vec();
                self.run_at(py, hashes.len() < DETACH_MIN_BLOCKS, now, |r| {
                    r.salt_block_hashes(endpoint, &mut hashes)?;
                    f(r, RouteRequest { hashes, ..request })
                })?
            }
        };
        Ok(out)
    }
}
