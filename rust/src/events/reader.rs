//! The msgpack reader under the KV-event decoder: a bounds-checked cursor over one payload.
//!
//! Invariants:
//! - **Never panics, bounded work.** Every read checks the bytes left first and fails with
//!   [`Error::Value`] naming the byte offset; a claimed length can never make a caller reserve or
//!   loop beyond the payload's size ([`Reader::check_items`]); nested values are skipped
//!   iteratively, without recursion.
//! - **Spans, not copies.** Strings are returned as [`Span`]s of the payload (UTF-8 checked
//!   unless the caller only compares bytes); token ids are scanned straight into the caller's
//!   buffer.

use rmp::Marker;

use crate::error::{Error, Result};

/// A byte range of the payload holding a UTF-8 string (or a raw msgpack value).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Span {
    pub(super) start: u32,
    pub(super) len: u32,
}

impl Span {
    pub(super) fn get(self, payload: &[u8]) -> &[u8] {
        let start = self.start as usize;
        payload
            .get(start..start + self.len as usize)
            .unwrap_or_default()
    }

    pub(super) fn str(self, payload: &[u8]) -> &str {
        // Spans of strings were checked to be UTF-8 when decoded.
        std::str::from_utf8(self.get(payload)).unwrap_or_default()
    }
}

/// A msgpack integer, split by sign.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Int {
    Pos(u64),
    Neg(i64),
}

/// A cursor over the payload (`pos <= payload.len()` always); `rmp` classifies the markers.
/// Reads check their bounds and fail with [`Error::Value`]; the error paths are out of line, so
/// the success paths stay small enough to inline.
pub(super) struct Reader<'a> {
    pub(super) payload: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(payload: &'a [u8]) -> Self {
        Reader { payload, pos: 0 }
    }

    #[inline]
    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    /// The bytes not read yet.
    #[inline]
    pub(super) fn rest(&self) -> &'a [u8] {
        self.payload.get(self.pos..).unwrap_or_default()
    }

    #[inline]
    pub(super) fn remaining(&self) -> usize {
        self.payload.len().saturating_sub(self.pos)
    }

    #[cold]
    #[inline(never)]
    pub(super) fn error_at(&self, at: usize, what: &str) -> Error {
        Error::Value(format!("malformed KV event payload at byte {at}: {what}"))
    }

    #[cold]
    #[inline(never)]
    pub(super) fn error(&self, what: &str) -> Error {
        self.error_at(self.pos(), what)
    }

    #[cold]
    #[inline(never)]
    pub(super) fn truncated(&self) -> Error {
        self.error("the payload ends in the middle of a value")
    }

    #[inline]
    pub(super) fn peek(&self) -> Result<u8> {
        match self.rest().first() {
            Some(&b) => Ok(b),
            None => Err(self.truncated()),
        }
    }

    #[inline]
    pub(super) fn marker(&mut self) -> Result<Marker> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(Marker::from_u8(b))
    }

    #[inline]
    pub(super) fn data<const N: usize>(&mut self) -> Result<[u8; N]> {
        match self.rest().first_chunk::<N>() {
            Some(&buf) => {
                self.pos += N;
                Ok(buf)
            }
            None => Err(self.truncated()),
        }
    }

    #[inline]
    pub(super) fn skip(&mut self, n: usize) -> Result<()> {
        if n > self.remaining() {
            return Err(self.truncated());
        }
        self.pos += n;
        Ok(())
    }

    /// The next `n` bytes, read.
    #[inline]
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        match self.rest().get(..n) {
            Some(bytes) => {
                self.pos += n;
                Ok(bytes)
            }
            None => Err(self.truncated()),
        }
    }

    /// Refuses a claimed element count larger than the bytes left (each element takes ≥ 1 byte),
    /// so no count can make the decoder reserve or loop beyond the payload's size.
    pub(super) fn check_items(&self, n: u32) -> Result<()> {
        if n as usize > self.remaining() {
            return Err(self.error(&format!(
                "a container claims {n} elements but only {} bytes are left",
                self.remaining()
            )));
        }
        Ok(())
    }

    pub(super) fn len16(&mut self) -> Result<u32> {
        Ok(u32::from(u16::from_be_bytes(self.data::<2>()?)))
    }

    pub(super) fn len32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.data::<4>()?))
    }

    pub(super) fn array_len(&mut self, m: Marker) -> Result<u32> {
        match m {
            Marker::FixArray(n) => Ok(u32::from(n)),
            Marker::Array16 => self.len16(),
            Marker::Array32 => self.len32(),
            _ => Err(self.error("expected an array")),
        }
    }

    /// `Some(pairs)` for a map marker (reading its length), `None` for anything else.
    pub(super) fn map_len(&mut self, m: Marker) -> Option<u32> {
        match m {
            Marker::FixMap(n) => Some(u32::from(n)),
            Marker::Map16 => self.len16().ok(),
            Marker::Map32 => self.len32().ok(),
            _ => None,
        }
    }

    /// The span of a complete fixstr (up to 31 bytes, as map keys and tags come) at the cursor,
    /// read, without a UTF-8 check; `None` (nothing read) for anything else.
    #[inline]
    pub(super) fn fixstr(&mut self) -> Option<Span> {
        let rest = self.rest();
        let &m = rest.first()?;
        if m & 0xe0 != 0xa0 {
            return None;
        }
        let len = usize::from(m & 0x1f);
        if len >= rest.len() {
            return None;
        }
        let start = self.pos + 1;
        self.pos = start + len;
        Some(Span {
            start: start as u32,
            len: len as u32,
        })
    }

    /// For a string marker, the (UTF-8 checked) span of its bytes; `None` for a non-string.
    pub(super) fn str_span(&mut self, m: Marker, at: usize) -> Result<Option<Span>> {
        self.str_span_checked(m, at, true)
    }

    /// [`Reader::str_span`], with the UTF-8 check only when `validate` (map keys are compared
    /// as bytes and never turned into `str`).
    pub(super) fn str_span_checked(
        &mut self,
        m: Marker,
        at: usize,
        validate: bool,
    ) -> Result<Option<Span>> {
        let len = match m {
            Marker::FixStr(n) => u32::from(n),
            Marker::Str8 => u32::from(u8::from_be_bytes(self.data::<1>()?)),
            Marker::Str16 => self.len16()?,
            Marker::Str32 => self.len32()?,
            _ => return Ok(None),
        };
        let start = self.pos();
        let bytes = self.take(len as usize)?;
        if validate && !bytes.is_ascii() && std::str::from_utf8(bytes).is_err() {
            return Err(self.error_at(at, "a string is not valid UTF-8"));
        }
        Ok(Some(Span {
            start: start as u32,
            len,
        }))
    }

    pub(super) fn opt_str(&mut self, what: &str) -> Result<Option<Span>> {
        let at = self.pos();
        match self.marker()? {
            Marker::Null => Ok(None),
            m => match self.str_span(m, at)? {
                Some(s) => Ok(Some(s)),
                None => Err(self.error_at(at, &format!("{what} is neither a string nor nil"))),
            },
        }
    }

    #[inline]
    pub(super) fn int_from(&mut self, m: Marker) -> Result<Option<Int>> {
        Ok(Some(match m {
            Marker::FixPos(v) => Int::Pos(u64::from(v)),
            Marker::FixNeg(v) => Int::Neg(i64::from(v)),
            Marker::U8 => Int::Pos(u64::from(u8::from_be_bytes(self.data::<1>()?))),
            Marker::U16 => Int::Pos(u64::from(u16::from_be_bytes(self.data::<2>()?))),
            Marker::U32 => Int::Pos(u64::from(u32::from_be_bytes(self.data::<4>()?))),
            Marker::U64 => Int::Pos(u64::from_be_bytes(self.data::<8>()?)),
            Marker::I8 => signed(i64::from(i8::from_be_bytes(self.data::<1>()?))),
            Marker::I16 => signed(i64::from(i16::from_be_bytes(self.data::<2>()?))),
            Marker::I32 => signed(i64::from(i32::from_be_bytes(self.data::<4>()?))),
            Marker::I64 => signed(i64::from_be_bytes(self.data::<8>()?)),
            _ => return Ok(None),
        }))
    }

    pub(super) fn int(&mut self, what: &str) -> Result<Int> {
        let at = self.pos();
        let m = self.marker()?;
        self.int_from(m)?
            .ok_or_else(|| self.error_at(at, &format!("{what} is not an integer")))
    }

    pub(super) fn opt_int(&mut self, what: &str) -> Result<Option<i64>> {
        let at = self.pos();
        let m = self.marker()?;
        if m == Marker::Null {
            return Ok(None);
        }
        match self.int_from(m)? {
            Some(Int::Neg(v)) => Ok(Some(v)),
            Some(Int::Pos(v)) => match i64::try_from(v) {
                Ok(v) => Ok(Some(v)),
                Err(_) => Err(self.error_at(at, &format!("{what} = {v} is out of range"))),
            },
            None => Err(self.error_at(at, &format!("{what} is neither an integer nor nil"))),
        }
    }

    pub(super) fn float(&mut self) -> Result<f64> {
        let at = self.pos();
        let m = self.marker()?;
        match m {
            Marker::F64 => Ok(f64::from_be_bytes(self.data::<8>()?)),
            Marker::F32 => Ok(f64::from(f32::from_be_bytes(self.data::<4>()?))),
            m => match self.int_from(m)? {
                Some(Int::Pos(v)) => Ok(v as f64),
                Some(Int::Neg(v)) => Ok(v as f64),
                None => Err(self.error_at(at, "ts is not a number")),
            },
        }
    }

    /// Appends `n` token ids to `out` (the hot loop: a direct scan of the integer encodings,
    /// eight `uint16` ids at a time when they come that way, as vocabularies below 65,536 make
    /// them); returns true when some id is negative or beyond `u32` (stored as 0). On `Err`,
    /// `out` and the cursor are unchanged.
    pub(super) fn token_ids(&mut self, n: u32, out: &mut Vec<u32>) -> Result<bool> {
        const LANES: usize = 8;
        let bytes = self.rest();
        let start = out.len();
        out.resize(start + n as usize, 0);
        let mut todo = out.get_mut(start..).unwrap_or_default();
        let mut at = 0usize;
        let mut wide = false;
        let mut failed = None;
        'scan: while !todo.is_empty() {
            let rest = std::mem::take(&mut todo);
            let Some((dst, tail)) = rest.split_at_mut_checked(rest.len().min(LANES)) else {
                break;
            };
            todo = tail;
            let src = bytes
                .get(at..)
                .and_then(|b| b.first_chunk::<{ 3 * LANES }>());
            if let (Ok(dst), Some(src)) = (<&mut [u32; LANES]>::try_from(&mut *dst), src) {
                if src.chunks_exact(3).all(|c| c.first() == Some(&0xcd)) {
                    for (slot, c) in dst.iter_mut().zip(src.chunks_exact(3)) {
                        if let &[_, a, b] = c {
                            *slot = u32::from(u16::from_be_bytes([a, b]));
                        }
                    }
                    at += 3 * LANES;
                    continue;
                }
            }
            for slot in dst.iter_mut() {
                match token_at(bytes, at) {
                    Ok((value, len)) => {
                        at += len;
                        match u32::try_from(value) {
                            Ok(t) => *slot = t,
                            Err(_) => wide = true,
                        }
                    }
                    Err(e) => {
                        failed = Some(e);
                        break 'scan;
                    }
                }
            }
        }
        let failed = failed.or_else(|| self.skip(at).err().map(|_| TokenError::Truncated));
        match failed {
            None => Ok(wide),
            Some(e) => {
                out.truncate(start);
                Err(match e {
                    TokenError::Truncated => self.truncated(),
                    TokenError::NotAnInteger(offset) => self.error_at(
                        self.pos() + offset,
                        "token_ids holds a value that is not an integer",
                    ),
                })
            }
        }
    }

    /// A block hash: an int (negative ones as their two's-complement bits) or a digest (`bin`).
    #[inline]
    pub(super) fn block_hash(&mut self, what: &str) -> Result<u64> {
        if let Some((&0xcf, rest)) = self.rest().split_first() {
            if let Some(&value) = rest.first_chunk::<8>() {
                self.pos += 9;
                return Ok(u64::from_be_bytes(value));
            }
        }
        let at = self.pos();
        let m = self.marker()?;
        if let Some(int) = self.int_from(m)? {
            return Ok(match int {
                Int::Pos(v) => v,
                Int::Neg(v) => v as u64,
            });
        }
        let len = match m {
            Marker::Bin8 => u32::from(u8::from_be_bytes(self.data::<1>()?)),
            Marker::Bin16 => self.len16()?,
            Marker::Bin32 => self.len32()?,
            _ => return Err(self.error_at(at, &format!("{what} holds a value that is not a hash"))),
        };
        if !(1..=64).contains(&len) {
            return Err(self.error_at(
                at,
                &format!("{what} holds a {len}-byte digest (1 to 64 bytes accepted)"),
            ));
        }
        let bytes = self.take(len as usize)?;
        Ok(bytes.iter().fold(0u64, |v, &b| (v << 8) | u64::from(b)))
    }

    /// Skips one complete value (any nesting), iteratively.
    pub(super) fn skip_value(&mut self) -> Result<()> {
        let m = self.marker()?;
        self.skip_rest(m)
    }

    /// Skips the rest of the value whose marker `m` was just read (all of its nested values).
    pub(super) fn skip_rest(&mut self, m: Marker) -> Result<()> {
        let mut pending = self.skip_body(m)?;
        while pending > 0 {
            if pending > self.remaining() as u64 {
                return Err(self.error(&format!(
                    "a container claims {pending} more elements but only {} bytes are left",
                    self.remaining()
                )));
            }
            pending -= 1;
            let m = self.marker()?;
            pending += self.skip_body(m)?;
        }
        Ok(())
    }

    /// Skips the fixed part of a value after its marker; returns the number of nested values
    /// that follow (container elements).
    pub(super) fn skip_body(&mut self, m: Marker) -> Result<u64> {
        let fixed = match m {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
                0
            }
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 | Marker::Bin8 => usize::from(u8::from_be_bytes(self.data::<1>()?)),
            Marker::Str16 | Marker::Bin16 => self.len16()? as usize,
            Marker::Str32 | Marker::Bin32 => self.len32()? as usize,
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => usize::from(u8::from_be_bytes(self.data::<1>()?)) + 1,
            Marker::Ext16 => self.len16()? as usize + 1,
            Marker::Ext32 => self.len32()? as usize + 1,
            Marker::FixArray(n) => return Ok(u64::from(n)),
            Marker::Array16 => return Ok(u64::from(self.len16()?)),
            Marker::Array32 => return Ok(u64::from(self.len32()?)),
            Marker::FixMap(n) => return Ok(2 * u64::from(n)),
            Marker::Map16 => return Ok(2 * u64::from(self.len16()?)),
            Marker::Map32 => return Ok(2 * u64::from(self.len32()?)),
            Marker::Reserved => return Err(self.error("reserved msgpack marker 0xc1")),
        };
        self.skip(fixed)?;
        Ok(0)
    }
}

/// Why a token id could not be read.
#[derive(Clone, Copy, Debug)]
enum TokenError {
    /// The payload ends inside it.
    Truncated,
    /// The value at this offset (from the first id) is not an integer.
    NotAnInteger(usize),
}

/// The token id encoded at `bytes[at..]` and its encoded length. Negative ids and signed
/// encodings give `u64::MAX` (not a `u32`).
#[inline]
fn token_at(bytes: &[u8], at: usize) -> std::result::Result<(u64, usize), TokenError> {
    let rest = bytes.get(at..).unwrap_or_default();
    let Some(&m) = rest.first() else {
        return Err(TokenError::Truncated);
    };
    let fixed = |n: usize| -> std::result::Result<u64, TokenError> {
        match rest.get(1..=n) {
            Some(b) => Ok(b.iter().fold(0u64, |v, &x| (v << 8) | u64::from(x))),
            None => Err(TokenError::Truncated),
        }
    };
    Ok(match m {
        0x00..=0x7f => (u64::from(m), 1),
        0xcc => (fixed(1)?, 2),
        0xcd => (fixed(2)?, 3),
        0xce => (fixed(4)?, 5),
        0xcf => (fixed(8)?, 9),
        0xd0..=0xd3 => {
            let len = 1usize << (m - 0xd0);
            fixed(len)?;
            (u64::MAX, 1 + len)
        }
        0xe0..=0xff => (u64::MAX, 1),
        _ => return Err(TokenError::NotAnInteger(at)),
    })
}

fn signed(v: i64) -> Int {
    if v < 0 {
        Int::Neg(v)
    } else {
        Int::Pos(v as u64)
    }
}
