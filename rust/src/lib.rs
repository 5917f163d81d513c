//! kvroute: a routing core that keeps prompt (KV/prefix) caches hot across a fleet of LLM workers.
//!
//! Each concept lives in one module; the Python binding layer (`py`, behind the default `python`
//! feature) only converts types, releases the GIL and maps errors — no routing logic lives there.
//!
//! - [`hashing`]: stable key hashing and the consistent-hashing family (jump, ring, Maglev, rendezvous).
//! - [`blocks`]: token blocks → chained block hashes (native XXH3, vLLM `sha256_cbor`, SGLang).
//! - [`events`]: engine KV events (vLLM, SGLang msgpack) decoded and applied to the indexes.
//! - [`index`]: the prefix index — which worker holds which chained KV blocks, and prefix matching.
//! - [`cache`]: a worker's KV memory model — LRU of leaves with pins, leases and reserved partitions.
//! - [`router`]: workers, load, policies and endpoint pools: which worker gets a request, and why.
//!
//! Guarantees shared by every module: no public function panics on caller-supplied input; invalid
//! input is reported as an [`Error`] and leaves the receiving object unchanged.

pub mod blocks;
pub mod cache;
pub mod error;
pub mod events;
pub mod hashing;
pub mod index;
mod mem;
pub mod router;

#[cfg(feature = "python")]
mod py;

pub use error::{Error, Result};
