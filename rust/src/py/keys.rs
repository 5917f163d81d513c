//! Routing keys from Python: one key (`str`, `bytes` or an integer in 0..2^64) handed to a
//! closure without copying, and [`KeyBatch`], a batch of keys read into reused buffers.
//!
//! Guarantees: a key that is none of those raises `TypeError` naming it (and its position in a
//! batch); `str` keys are read as UTF-8 in place.

use std::collections::TryReserveError;

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyString};

use super::convert::{
    for_each_item, is_integer, list_or_tuple, memory_error, presized, str_bytes, type_error,
    u64_from_int,
};
use crate::hashing::Key;

/// Calls `f` with the routing key held in `obj`: `str` (UTF-8 bytes), `bytes`, or an integer in
/// 0..2^64 (an `int`, a NumPy integer scalar: see [`super::convert::as_int`]).
pub fn with_key<R>(obj: &Bound<'_, PyAny>, f: impl FnOnce(Key<'_>) -> R) -> PyResult<R> {
    with_key_at(obj, None, f)
}

/// [`with_key`] for the key at position `at` of a batch, which errors name (`keys[3] ...`).
#[inline(always)]
pub fn with_key_at<R>(
    obj: &Bound<'_, PyAny>,
    at: Option<usize>,
    f: impl FnOnce(Key<'_>) -> R,
) -> PyResult<R> {
    // Exact `str` first: a pointer comparison, where the subclass check below is a call.
    let key = if let Ok(s) = obj.cast_exact::<PyString>() {
        Key::Bytes(str_bytes(s)?)
    } else if let Ok(s) = obj.cast::<PyString>() {
        Key::Bytes(str_bytes(s)?)
    } else if let Ok(b) = obj.cast::<PyBytes>() {
        Key::Bytes(b.as_bytes())
    } else if is_integer(obj) {
        Key::Int(u64_from_int(
            obj,
            if at.is_some() { "keys" } else { "key" },
            at,
        )?)
    } else {
        return Err(match at {
            Some(i) => type_error(obj, format_args!("keys[{i}] must be str, bytes or int")),
            None => type_error(obj, "key must be str, bytes or int"),
        });
    };
    // One call site: `f` is inlined here rather than made a function of its own, whose result
    // would come back through memory.
    Ok(f(key))
}

/// A batch of keys copied out of Python objects into contiguous memory, so the work on them can
/// run with the GIL released. Byte keys are concatenated; `Int` keys keep their value.
///
/// The bytes buffer is kept longer than its used part (`bytes[used..]`, at least [`SLACK`] bytes
/// once a key is in), so a short key is copied with fixed-size overlapping moves rather than a
/// call to `memcpy` (a third of the cost of reading a list of short `str`s).
#[derive(Default)]
pub struct KeyBatch {
    bytes: Vec<u8>,
    /// Bytes of `bytes` holding keys; the rest is slack.
    used: usize,
    /// Per key: `(start, end)` into `bytes`, or `(u64::MAX, value)` for an integer key.
    spans: Vec<(u64, u64)>,
}

/// Slack kept after the used part of [`KeyBatch`]'s bytes: keys up to this long are copied by
/// [`copy_short`].
const SLACK: usize = 64;

/// Copies `src` to `dst[..src.len()]`, writing nothing else: a key of up to [`SLACK`] bytes with
/// two overlapping fixed-size moves (of the largest power of two not above its length; three
/// single bytes below 4), a longer one with `copy_from_slice`. Returns false when `dst` is
/// shorter than `src`.
#[inline(always)]
fn copy_short(dst: &mut [u8], src: &[u8]) -> bool {
    #[inline(always)]
    fn two<const N: usize>(dst: &mut [u8], src: &[u8]) -> Option<()> {
        let n = src.len();
        *dst.first_chunk_mut::<N>()? = *src.first_chunk::<N>()?;
        *dst.get_mut(n.checked_sub(N)?..n)?.first_chunk_mut::<N>()? = *src.last_chunk::<N>()?;
        Some(())
    }
    let done = match src.len() {
        0 => Some(()),
        1..=3 => {
            // First, middle and last byte cover lengths 1 to 3.
            let n = src.len();
            let (a, b, c) = (src.first(), src.get(n / 2), src.last());
            match (a, b, c, dst.get_mut(..n)) {
                (Some(&a), Some(&b), Some(&c), Some(d)) => {
                    for (at, byte) in [(0, a), (n / 2, b), (n - 1, c)] {
                        if let Some(x) = d.get_mut(at) {
                            *x = byte;
                        }
                    }
                    Some(())
                }
                _ => None,
            }
        }
        4..=7 => two::<4>(dst, src),
        8..=15 => two::<8>(dst, src),
        16..=31 => two::<16>(dst, src),
        32..=SLACK => two::<32>(dst, src),
        n => dst.get_mut(..n).map(|d| d.copy_from_slice(src)),
    };
    done.is_some()
}

impl KeyBatch {
    /// Replaces the batch's keys with those of `obj`, an iterable of `str`/`bytes`/`int` objects,
    /// reusing its buffers. One key (`str`, `bytes`, `bytearray`: iterable too, by character or
    /// byte) raises `TypeError`. On error the batch holds an unspecified prefix of the keys.
    pub fn refill(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<()> {
        self.clear();
        if obj.is_instance_of::<PyString>()
            || obj.is_instance_of::<PyBytes>()
            || obj.is_instance_of::<PyByteArray>()
        {
            return Err(type_error(obj, "keys must be a sequence of keys, not one"));
        }
        if let Some((n, get_item)) = list_or_tuple(obj) {
            // A list's length is its real size: reserved exactly, but fallibly.
            self.spans
                .try_reserve(n)
                .map_err(|_| memory_error(obj, "keys", n))?;
            let py = obj.py();
            return for_each_item(obj, n, get_item, |item, i| {
                // SAFETY: `item` is a live borrowed reference (see `for_each_item`).
                let item = unsafe { Borrowed::from_ptr(py, item) };
                // An exact str is read in place (no Python code runs); anything else is
                // converted through a strong reference, as its conversion may run Python code.
                match item.cast_exact::<PyString>() {
                    Ok(s) => self.push(Key::Bytes(str_bytes(&s)?)),
                    Err(_) => with_key_at(&item.to_owned(), Some(i), |k| self.push(k))?,
                }
                .map_err(|_| memory_error(obj, "keys", self.len() + 1))
            });
        }
        self.spans = presized(obj, "keys", std::mem::take(&mut self.spans))?;
        for (i, item) in obj.try_iter()?.enumerate() {
            let item = item?;
            with_key_at(&item, Some(i), |k| self.push(k))?
                .map_err(|_| memory_error(obj, "keys", self.len() + 1))?;
        }
        Ok(())
    }

    /// Removes every key, keeping the buffers' capacity.
    pub fn clear(&mut self) {
        self.used = 0;
        self.spans.clear();
    }

    /// Bytes of buffer held (for callers that cap what they keep between batches).
    pub fn capacity_bytes(&self) -> usize {
        self.bytes.capacity() + self.spans.capacity() * std::mem::size_of::<(u64, u64)>()
    }

    /// Appends a key; fails (changing nothing) when memory for it cannot be allocated.
    #[inline(always)]
    fn push(&mut self, key: Key<'_>) -> Result<(), TryReserveError> {
        self.spans.try_reserve(1)?;
        match key {
            Key::Bytes(b) => {
                let (start, end) = (self.used, self.used + b.len());
                if self.bytes.len() < end + SLACK {
                    let grown = (end + SLACK).max(2 * self.bytes.len());
                    self.bytes.try_reserve(grown - self.bytes.len())?;
                    self.bytes.resize(grown, 0);
                }
                // The buffer was just grown to hold `end + SLACK` bytes, so the copy succeeds.
                let copied = copy_short(self.bytes.get_mut(start..).unwrap_or_default(), b);
                debug_assert!(copied, "the buffer holds the key and its slack");
                self.used = end;
                self.spans.push((start as u64, end as u64));
            }
            Key::Int(v) => self.spans.push((u64::MAX, v)),
        }
        Ok(())
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// The keys, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Key<'_>> + '_ {
        self.spans.iter().map(move |&(a, b)| {
            if a == u64::MAX {
                Key::Int(b)
            } else {
                // Spans were recorded from `bytes` itself, so they are in bounds.
                Key::Bytes(self.bytes.get(a as usize..b as usize).unwrap_or_default())
            }
        })
    }
}
