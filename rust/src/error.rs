//! The one error type of the core.
//!
//! Each variant corresponds to one Python exception class, so the binding layer maps errors
//! mechanically: [`Error::Value`] → `ValueError`, [`Error::Type`] → `TypeError`,
//! [`Error::Key`] → `KeyError`, [`Error::NoWorker`] → `kvroute.NoWorkerError` (a `ValueError`).
//! Messages name the offending value.

/// An error raised by the core on invalid input. Returning one never leaves an object half-modified.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A value of the right type but outside what the operation accepts.
    #[error("{0}")]
    Value(String),
    /// A value of a type the operation does not accept.
    #[error("{0}")]
    Type(String),
    /// A name (node, worker, partition, endpoint, …) that is not known, or already known.
    #[error("{0}")]
    Key(String),
    /// A request has no worker to go to: none is healthy, in the endpoint's pool and not
    /// excluded. A `ValueError` in Python (`kvroute.NoWorkerError`), so callers can tell "no
    /// capacity right now" (retry later, answer 503) from a bad argument.
    #[error("{0}")]
    NoWorker(String),
}

/// Result alias used throughout the core.
pub type Result<T> = std::result::Result<T, Error>;

/// Shorthand for `Err(Error::Value(format!(...)))`.
#[macro_export]
macro_rules! value_err {
    ($($arg:tt)*) => { Err($crate::error::Error::Value(format!($($arg)*))) };
}

/// Shorthand for `Err(Error::Key(format!(...)))`.
#[macro_export]
macro_rules! key_err {
    ($($arg:tt)*) => { Err($crate::error::Error::Key(format!($($arg)*))) };
}
