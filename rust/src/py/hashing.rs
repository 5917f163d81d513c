//! Bindings for `crate::hashing`.

use numpy::PyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::convert::{u64_from_int, u64_slice, with_key, Negative};
use crate::hashing;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(hash_key, m)?)?;
    m.add_function(wrap_pyfunction!(jump_hash, m)?)?;
    m.add_function(wrap_pyfunction!(jump_hash_many, m)?)?;
    Ok(())
}

fn num_buckets_u32(num_buckets: i64) -> PyResult<u32> {
    match u32::try_from(num_buckets) {
        Ok(n) if (1..=i32::MAX as u32).contains(&n) => Ok(n),
        _ => Err(PyValueError::new_err(format!(
            "num_buckets must be in 1..2**31-1, got {num_buckets}"
        ))),
    }
}

/// Stable 64-bit hash of a key: XXH3-64, seed 0, over a str's UTF-8 bytes, bytes as given, or an
/// int's 8 little-endian bytes.
#[pyfunction]
fn hash_key(key: &Bound<'_, PyAny>) -> PyResult<u64> {
    with_key(key, |k| k.hash64())
}

/// Jump consistent hash of the 64-bit `key` into `0..num_buckets`.
#[pyfunction]
fn jump_hash(key: &Bound<'_, PyAny>, num_buckets: i64) -> PyResult<u32> {
    let n = num_buckets_u32(num_buckets)?;
    let k = u64_from_int(key, "key", None)?;
    Ok(hashing::jump_hash(k, n))
}

/// Jump consistent hash of every key of a uint64 array (or sequence of ints); returns int64 buckets.
#[pyfunction]
fn jump_hash_many<'py>(
    py: Python<'py>,
    keys: &Bound<'py, PyAny>,
    num_buckets: i64,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let n = num_buckets_u32(num_buckets)?;
    let keys = u64_slice(keys, "keys", Negative::Reject)?;
    let slice = keys.as_slice();
    let out = py.detach(|| {
        slice
            .iter()
            .map(|&k| i64::from(hashing::jump_hash(k, n)))
            .collect()
    });
    Ok(PyArray1::from_vec(py, out))
}
