//! The pre-image vLLM's default `sha256` algorithm hashes: CPython's `pickle.dumps(obj,
//! protocol=5)` of `(parent_digest, tuple(token_ids), extra_keys)`, byte for byte.
//!
//! Only the value types vLLM puts in a block key are written: `bytes`, `str`, `int`, `None` and
//! tuples of those. What the C pickler (`Modules/_pickle.c`, the implementation `pickle.dumps`
//! uses) does with them, and this module reproduces:
//!
//! - `PROTO 5`, the object, `STOP`. From protocol 4 on, everything after `PROTO` is written in
//!   **frames** (`FRAME` + 8-byte little-endian length): a frame is closed before saving an object
//!   (any object, nested ones included) once it holds ≥ 64 KiB, and at the end; a closed frame of
//!   fewer than 4 bytes loses its header. A `bytes`/`str` payload of ≥ 64 KiB closes the frame
//!   and is written, with its opcode, outside any frame.
//! - `int`: `BININT1` (0..=255), `BININT2` (256..=65535), `BININT` (other values in i32), else
//!   `LONG1` with the minimal little-endian two's-complement bytes (`LONG4` past 255 bytes cannot
//!   occur for 64-bit values). `None`: `NONE`.
//! - `bytes`: `SHORT_BINBYTES` (< 256 bytes) / `BINBYTES`; `str`: `SHORT_BINUNICODE` (< 256 UTF-8
//!   bytes) / `BINUNICODE`; both followed by `MEMOIZE`.
//! - tuples: `EMPTY_TUPLE` (not memoized); 1–3 items: the items then `TUPLE1/2/3`; more: `MARK`,
//!   the items, `TUPLE`; then `MEMOIZE`. Ints and `None` are never memoized.
//! - **Memo hits.** An object pickled a second time in the same call is written as `BINGET n`
//!   (`LONG_BINGET` from 256). Within one block key that happens only for the same *object*: the
//!   tag literals of vLLM ≥ 0.31 keys (`"mm"` in a block with two multimodal items), and CPython's
//!   empty and one-character Latin-1 strings, which are singletons. Other equal strings are
//!   distinct objects (a request's salt and LoRA name are separate allocations), so they are
//!   written out again.

/// Frames are closed once they reach this size (CPython's `FRAME_SIZE_TARGET`).
const FRAME_TARGET: usize = 64 * 1024;
/// Frames smaller than this are written without a header (`FRAME_SIZE_MIN`).
const FRAME_MIN: usize = 4;
const FRAME_HEADER: usize = 9;

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';
const MARK: u8 = b'(';
const EMPTY_TUPLE: u8 = b')';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;

/// One `str` object as far as the memo is concerned.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum StrId {
    /// A string literal of vLLM's code (`"lora"`, `"mm"`, `"cache_salt"`): one object per name.
    Literal(&'static str),
    /// A string from the request: one object per occurrence, unless it is empty or a single
    /// Latin-1 character (CPython singletons).
    Value,
}

/// Memo entries a block key can hit (see the module docs); reset per pickle.
#[derive(Default)]
pub struct Memo {
    next: u32,
    literals: Vec<(&'static str, u32)>,
    /// The singleton strings written so far (`None`: the empty string).
    chars: Vec<(Option<char>, u32)>,
}

impl Memo {
    fn clear(&mut self) {
        self.next = 0;
        self.literals.clear();
        self.chars.clear();
    }

    fn take(&mut self) -> u32 {
        let n = self.next;
        self.next += 1;
        n
    }
}

/// Writes one pickle into a caller-owned buffer (cleared first); no allocation once the buffer
/// and the memo have grown to a block's size.
pub struct Pickler<'a> {
    out: &'a mut Vec<u8>,
    memo: &'a mut Memo,
    /// Start of the open frame's header, if a frame is open.
    frame: Option<usize>,
}

impl<'a> Pickler<'a> {
    /// Starts a protocol-5 pickle: `PROTO 5`, framing on.
    pub fn new(out: &'a mut Vec<u8>, memo: &'a mut Memo) -> Self {
        out.clear();
        memo.clear();
        out.extend_from_slice(&[PROTO, 5]);
        Pickler {
            out,
            memo,
            frame: None,
        }
    }

    fn write(&mut self, data: &[u8]) {
        if self.frame.is_none() {
            self.frame = Some(self.out.len());
            self.out.extend_from_slice(&[0; FRAME_HEADER]);
        }
        self.out.extend_from_slice(data);
    }

    fn commit_frame(&mut self) {
        if let Some(start) = self.frame.take() {
            let len = self.out.len() - start - FRAME_HEADER;
            if len >= FRAME_MIN {
                let mut header = [FRAME; FRAME_HEADER];
                header[1..].copy_from_slice(&(len as u64).to_le_bytes());
                self.out[start..start + FRAME_HEADER].copy_from_slice(&header);
            } else {
                self.out.drain(start..start + FRAME_HEADER);
            }
        }
    }

    /// Called before saving each object: closes a frame that reached the target size.
    fn boundary(&mut self) {
        if let Some(start) = self.frame {
            if self.out.len() - start - FRAME_HEADER >= FRAME_TARGET {
                self.commit_frame();
            }
        }
    }

    fn write_payload(&mut self, header: &[u8], data: &[u8]) {
        if data.len() >= FRAME_TARGET {
            self.commit_frame();
            self.out.extend_from_slice(header);
            self.out.extend_from_slice(data);
        } else {
            self.write(header);
            self.write(data);
        }
    }

    fn memoize(&mut self) -> u32 {
        self.write(&[MEMOIZE]);
        self.memo.take()
    }

    fn get(&mut self, n: u32) {
        match u8::try_from(n) {
            Ok(n) => self.write(&[BINGET, n]),
            Err(_) => {
                let b = n.to_le_bytes();
                self.write(&[LONG_BINGET, b[0], b[1], b[2], b[3]]);
            }
        }
    }

    /// `None`.
    pub fn none(&mut self) {
        self.boundary();
        self.write(&[NONE]);
    }

    /// An `int` (any `i128` that holds an `i64` or `u64`).
    pub fn int(&mut self, v: i128) {
        self.boundary();
        if (0..=0xff).contains(&v) {
            self.write(&[BININT1, v as u8]);
        } else if (0..=0xffff).contains(&v) {
            let b = (v as u16).to_le_bytes();
            self.write(&[BININT2, b[0], b[1]]);
        } else if let Ok(v) = i32::try_from(v) {
            let b = v.to_le_bytes();
            self.write(&[BININT, b[0], b[1], b[2], b[3]]);
        } else {
            // Minimal two's complement: drop redundant sign bytes from the top.
            let bytes = v.to_le_bytes();
            let mut n = bytes.len();
            while n > 1 {
                let (top, next) = (bytes[n - 1], bytes[n - 2]);
                if (top == 0x00 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.write(&[LONG1, n as u8]);
            self.write(&bytes[..n]);
        }
    }

    /// A `bytes` object.
    pub fn bytes(&mut self, data: &[u8]) {
        self.boundary();
        match u8::try_from(data.len()) {
            Ok(n) => self.write_payload(&[SHORT_BINBYTES, n], data),
            Err(_) => {
                let mut header = [BINBYTES; 5];
                header[1..].copy_from_slice(&(data.len() as u32).to_le_bytes());
                self.write_payload(&header, data);
            }
        }
        self.memoize();
    }

    /// A `str` object (`id` says which object it is, for memo hits).
    pub fn str(&mut self, s: &str, id: StrId) {
        self.boundary();
        let mut chars = s.chars();
        let singleton = match (chars.next(), chars.next()) {
            (None, _) => Some(None),
            (Some(c), None) if u32::from(c) < 256 => Some(Some(c)),
            _ => None,
        };
        let hit = match (id, singleton) {
            (_, Some(c)) => self.memo.chars.iter().find(|e| e.0 == c).map(|e| e.1),
            (StrId::Literal(name), None) => {
                self.memo.literals.iter().find(|e| e.0 == name).map(|e| e.1)
            }
            (StrId::Value, None) => None,
        };
        if let Some(n) = hit {
            self.get(n);
            return;
        }
        match u8::try_from(s.len()) {
            Ok(n) => self.write_payload(&[SHORT_BINUNICODE, n], s.as_bytes()),
            Err(_) => {
                let mut header = [BINUNICODE; 5];
                header[1..].copy_from_slice(&(s.len() as u32).to_le_bytes());
                self.write_payload(&header, s.as_bytes());
            }
        }
        let n = self.memoize();
        match (id, singleton) {
            (_, Some(c)) => self.memo.chars.push((c, n)),
            (StrId::Literal(name), None) => self.memo.literals.push((name, n)),
            (StrId::Value, None) => {}
        }
    }

    /// Opens a tuple of `len` items; write the items, then call [`Pickler::end_tuple`].
    pub fn begin_tuple(&mut self, len: usize) {
        self.boundary();
        if len > 3 {
            self.write(&[MARK]);
        }
    }

    /// Closes a tuple of `len` items opened by [`Pickler::begin_tuple`].
    pub fn end_tuple(&mut self, len: usize) {
        match len {
            0 => self.write(&[EMPTY_TUPLE]),
            1 => self.write(&[TUPLE1]),
            2 => self.write(&[TUPLE2]),
            3 => self.write(&[TUPLE3]),
            _ => self.write(&[TUPLE]),
        }
        if len > 0 {
            self.memoize();
        }
    }

    /// Writes `STOP` and closes the last frame; returns the pickle.
    pub fn finish(mut self) -> &'a [u8] {
        self.write(&[STOP]);
        self.commit_frame();
        self.out
    }
}
