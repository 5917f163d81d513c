//! Sharing the approx model between router replicas: what a decision predicts, as updates
//! another replica applies to its own model.
//!
//! # What is shared
//! With [`Config::updates`](super::Config) on (approx mode), every change the router makes to
//! its model is appended, as it happens, to an outbox of **updates** ([`Router::take_updates`]
//! drains it as one batch of bytes); [`Router::apply_updates`] applies another replica's batch to
//! this model without echoing it to the outbox. Two kinds:
//! - `Record { worker, partition, anchor, blocks }`: the worker holds the chain that ends at the
//!   block `anchor` (a block it already held) continued by `blocks`, touched now. `route` sends
//!   the blocks newly predicted on the chosen worker, anchored at the last block it was known to
//!   hold — never the whole prompt when a prefix was known; `finish` sends a touch (`anchor` =
//!   the prompt's last block, no new blocks — or, if part of the prompt left the model since
//!   the route, anchored at what is left and with the rest); `observe` likewise, after a
//!   `Forget` of the first block the engine lacked. So a replica whose model mirrors the
//!   publisher's always holds the anchor.
//! - `Forget { worker, block }`: the worker lacks `block` and everything after it (`observe`
//!   when the engine reported less; `withdraw`, the blocks a withdrawn route added).
//! - `Load { worker, delta }`: the publisher's own load on the worker changed by `delta`
//!   (the five counters of [`super::workers::Load`]): `begin`, `prefilled`, `finish` and
//!   `withdraw` send it, and the receiver adds it to the worker's others' load
//!   ([`super::Worker::others`]), so every replica weighs every replica's requests.
//!   [`Router::set_load`] (the engine's own figures) resets that baseline, which bounds the error
//!   of lost or stale load updates (a replica that died with requests in flight) to one report
//!   interval. In events mode this is all that is
//!   shared (its state comes from the engines' events).
//!
//! # Guarantees of `apply_updates`
//! - The batch is decoded and checked whole before anything changes: a malformed batch is an
//!   [`crate::Error::Value`] and changes nothing.
//! - Each model update is applied as the publisher's own model applied it (`Model::record`,
//!   `Model::forget_from`), at the receiver's `now`. A `Record` whose anchor the receiver's model
//!   of that worker does not hold (its model evicted it, or it never learnt it) cannot be placed
//!   in a prefix-closed model and is skipped (`unanchored`); a worker the receiver does not know
//!   is skipped (`unknown_workers`); a chain contradicting the receiver's index is skipped
//!   (`inconsistent`). Skipping is always safe: the model only ever under-predicts.
//! - Applying the same update twice leaves the model as applying it once, but for recency (a
//!   record touches its chain again); a `Forget` applied twice forgets nothing more.
//!   Idempotence per publisher (sequence numbers, duplicates, order) is the transport's job.
//!
//! # Wire format (little-endian)
//! `b"KVRU"`, version `u8` = 1, then updates until the end: tag `u8` (1 = record, 2 = forget),
//! worker (`u16` length + UTF-8); a record: partition (`u16` length + UTF-8, `0xFFFF` = none),
//! anchor flag `u8` + `u64`, block count `u32` + `u64` each; a forget: block `u64`; a load
//! (tag 3): five `i64` deltas (`active`, `queued`, `prefill_blocks`, `decode_blocks`,
//! `written_blocks`).

use crate::error::Result;
use crate::value_err;

use super::workers::check_finite;
use super::Router;

const MAGIC: &[u8; 4] = b"KVRU";
const VERSION: u8 = 1;
const HEADER: usize = MAGIC.len() + 1;
const RECORD: u8 = 1;
const FORGET: u8 = 2;
const LOAD: u8 = 3;
const NO_PARTITION: u16 = u16::MAX;
/// Counters a load update carries ([`super::workers::Load`]).
const LOAD_COUNTERS: usize = 5;

/// What [`Router::apply_updates`] did with a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Records applied.
    pub records: u64,
    /// Forgets applied.
    pub forgets: u64,
    /// Load changes applied.
    pub loads: u64,
    /// Records skipped: the receiver's model of the worker lacks the anchor.
    pub unanchored: u64,
    /// Updates skipped: the worker is unknown here.
    pub unknown_workers: u64,
    /// Records skipped: the chain contradicts this index.
    pub inconsistent: u64,
}

/// One decoded update, borrowing the batch.
enum Update<'a> {
    Record {
        worker: &'a str,
        partition: Option<&'a str>,
        anchor: Option<u64>,
        blocks: &'a [u8],
    },
    Forget {
        worker: &'a str,
        block: u64,
    },
    Load {
        worker: &'a str,
        delta: [i64; LOAD_COUNTERS],
    },
}

/// The outbox: updates appended as the model changes (empty when updates are off).
#[derive(Default)]
pub(super) struct Outbox {
    on: bool,
    bytes: Vec<u8>,
    /// Where each update starts in `bytes`.
    starts: Vec<usize>,
}

impl Outbox {
    pub fn new(on: bool) -> Self {
        Outbox {
            on,
            ..Outbox::default()
        }
    }

    fn start(&mut self, tag: u8, worker: &str) {
        if self.bytes.is_empty() {
            self.bytes.extend_from_slice(MAGIC);
            self.bytes.push(VERSION);
        }
        self.starts.push(self.bytes.len());
        self.bytes.push(tag);
        put_str(&mut self.bytes, worker);
    }

    /// Appends a record (see the module docs); nothing when updates are off or when it says
    /// nothing (no anchor and no block).
    pub fn record(&mut self, worker: &str, partition: Option<&str>, hashes: &[u64], known: usize) {
        if !self.on || hashes.is_empty() {
            return;
        }
        let known = known.min(hashes.len());
        self.start(RECORD, worker);
        match partition {
            Some(p) => put_str(&mut self.bytes, p),
            None => self.bytes.extend_from_slice(&NO_PARTITION.to_le_bytes()),
        }
        match known.checked_sub(1).and_then(|k| hashes.get(k)) {
            Some(anchor) => {
                self.bytes.push(1);
                self.bytes.extend_from_slice(&anchor.to_le_bytes());
            }
            None => {
                self.bytes.push(0);
                self.bytes.extend_from_slice(&0u64.to_le_bytes());
            }
        }
        let blocks = hashes.get(known..).unwrap_or(&[]);
        self.bytes
            .extend_from_slice(&(blocks.len() as u32).to_le_bytes());
        for h in blocks {
            self.bytes.extend_from_slice(&h.to_le_bytes());
        }
    }

    /// Appends a change of `worker`'s load by `(active, prefill_blocks, decode_blocks)`
    /// (nothing when updates are off or it is zero).
    pub fn load(&mut self, worker: &str, delta: [i64; LOAD_COUNTERS]) {
        if !self.on || delta == [0; LOAD_COUNTERS] {
            return;
        }
        self.start(LOAD, worker);
        for d in delta {
            self.bytes.extend_from_slice(&d.to_le_bytes());
        }
    }

    /// Appends a forget of `block` on `worker` (nothing when updates are off).
    pub fn forget(&mut self, worker: &str, block: u64) {
        if !self.on {
            return;
        }
        self.start(FORGET, worker);
        self.bytes.extend_from_slice(&block.to_le_bytes());
    }

    /// The pending updates as one batch (empty when there is none), at most `max_bytes` long
    /// unless its first update alone is longer (a batch always holds at least one); the rest
    /// stays for the next call.
    pub fn take(&mut self, max_bytes: Option<usize>) -> Vec<u8> {
        let limit = max_bytes.unwrap_or(usize::MAX);
        if self.bytes.len() <= limit {
            self.starts.clear();
            return std::mem::take(&mut self.bytes);
        }
        // Take the longest run of whole updates that fits, and at least one: `split` is where
        // the first update left behind starts.
        let mut cut = 1;
        while self.starts.get(cut + 1).is_some_and(|&end| end <= limit) {
            cut += 1;
        }
        let Some(&split) = self.starts.get(cut) else {
            self.starts.clear();
            return std::mem::take(&mut self.bytes);
        };
        let mut rest = Vec::with_capacity(HEADER + self.bytes.len() - split);
        rest.extend_from_slice(self.bytes.get(..HEADER).unwrap_or(&[]));
        rest.extend_from_slice(self.bytes.get(split..).unwrap_or(&[]));
        self.bytes.truncate(split);
        let shift = split - HEADER;
        self.starts = self.starts.split_off(cut);
        for s in &mut self.starts {
            *s -= shift;
        }
        std::mem::replace(&mut self.bytes, rest)
    }
}

/// Appends `s` with a `u16` length; names longer than 65,534 bytes are cut at a char boundary
/// (worker and endpoint names are short; the router's own names are what is written).
fn put_str(out: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(usize::from(NO_PARTITION) - 1);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let s = s.get(..end).unwrap_or("");
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A cursor over a batch; every read fails with a message naming what was cut short.
struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n);
        match end.and_then(|e| self.data.get(self.at..e)) {
            Some(s) => {
                self.at += n;
                Ok(s)
            }
            None => value_err!(
                "update batch truncated at byte {} (reading {what}, {} bytes)",
                self.at,
                self.data.len()
            ),
        }
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?.first().copied().unwrap_or(0))
    }

    fn u16(&mut self, what: &str) -> Result<u16> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([
            b.first().copied().unwrap_or(0),
            b.get(1).copied().unwrap_or(0),
        ]))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_le_bytes(a))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(a))
    }

    fn str_of(&mut self, len: u16, what: &str) -> Result<&'a str> {
        let at = self.at;
        let b = self.take(usize::from(len), what)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s),
            Err(_) => value_err!("update batch: {what} at byte {at} is not UTF-8"),
        }
    }
}

/// Decodes a whole batch (see the module docs) into `out`.
fn decode<'a>(data: &'a [u8], out: &mut Vec<Update<'a>>) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    if data.len() < HEADER || data.get(..MAGIC.len()) != Some(MAGIC.as_slice()) {
        return value_err!(
            "not a kvroute update batch ({} bytes, no KVRU header)",
            data.len()
        );
    }
    // Never missing (the header was checked above); were it, 0 is no version: refused below.
    let version = data.get(MAGIC.len()).copied().unwrap_or_default();
    if version != VERSION {
        return value_err!("update batch version {version} is not supported (expected {VERSION})");
    }
    let mut r = Reader { data, at: HEADER };
    while r.at < data.len() {
        let tag = r.u8("tag")?;
        let len = r.u16("worker length")?;
        let worker = r.str_of(len, "worker")?;
        match tag {
            RECORD => {
                let plen = r.u16("partition length")?;
                let partition = if plen == NO_PARTITION {
                    None
                } else {
                    Some(r.str_of(plen, "partition")?)
                };
                let has_anchor = r.u8("anchor flag")?;
                let anchor = r.u64("anchor")?;
                let n = r.u32("block count")? as usize;
                let blocks = r.take(n.saturating_mul(8), "blocks")?;
                out.push(Update::Record {
                    worker,
                    partition,
                    anchor: (has_anchor != 0).then_some(anchor),
                    blocks,
                });
            }
            FORGET => {
                let block = r.u64("block")?;
                out.push(Update::Forget { worker, block });
            }
            LOAD => {
                let mut delta = [0i64; LOAD_COUNTERS];
                for d in &mut delta {
                    *d = r.u64("load delta")? as i64;
                }
                out.push(Update::Load { worker, delta });
            }
            other => {
                return value_err!(
                    "update batch: unknown update tag {other} at byte {}",
                    r.at - 3 - usize::from(len)
                )
            }
        }
    }
    Ok(())
}

impl Router {
    /// The updates appended since the last call, as one batch (empty bytes when there is none,
    /// or when updates are off) of at most `max_bytes` when given (but at least one update);
    /// what does not fit stays for the next call. See the module docs.
    pub fn take_updates(&mut self, max_bytes: Option<usize>) -> Vec<u8> {
        self.outbox.take(max_bytes)
    }

    /// Applies another replica's batch of updates to this router's model at `now` (see the
    /// module docs); nothing is echoed to this router's outbox. `loads = false` skips the load
    /// updates (re-applying this router's own batch to a model loaded from a snapshot: its own
    /// requests are already in its own counters).
    ///
    /// Errors change nothing: not approx mode, `now` not finite, a malformed batch (`Value`).
    pub fn apply_updates(&mut self, data: &[u8], now: f64, loads: bool) -> Result<ApplyStats> {
        check_finite(now, "now")?;
        let mut updates = Vec::new();
        decode(data, &mut updates)?;
        let mut stats = ApplyStats::default();
        let index = self.index.clone();
        let mut index = index.write();
        let mut chain = std::mem::take(&mut self.scratch.chain);
        for update in updates {
            let name = match &update {
                Update::Record { worker, .. }
                | Update::Forget { worker, .. }
                | Update::Load { worker, .. } => *worker,
            };
            let Some(w) = self
                .workers
                .slot(name)
                .and_then(|s| self.workers.get_mut(s))
            else {
                stats.unknown_workers += 1;
                continue;
            };
            let model = match update {
                Update::Load { .. } if !loads => continue,
                Update::Load { delta, .. } => {
                    w.others.add(delta);
                    stats.loads += 1;
                    continue;
                }
                // Events mode has no model: records and forgets are another mode's news.
                _ => match self.model.as_mut() {
                    Some(m) => m,
                    None => continue,
                },
            };
            match update {
                Update::Load { .. } => {}
                Update::Record {
                    partition,
                    anchor,
                    blocks,
                    ..
                } => {
                    chain.clear();
                    if let Some(a) = anchor {
                        let held = w
                            .cache
                            .as_ref()
                            .is_some_and(|c| c.chain_into(a, &mut chain));
                        if !held {
                            stats.unanchored += 1;
                            continue;
                        }
                    }
                    chain.extend(blocks.chunks_exact(8).map(|b| {
                        let mut a = [0u8; 8];
                        a.copy_from_slice(b);
                        u64::from_le_bytes(a)
                    }));
                    // A partition this worker's cache does not declare is its shared pool.
                    match model.record(w, &mut index, &chain, partition, now) {
                        Ok(()) => stats.records += 1,
                        Err(_) => stats.inconsistent += 1,
                    }
                }
                Update::Forget { block, .. } => {
                    model.forget_from(w, &mut index, &[block], 0);
                    stats.forgets += 1;
                }
            }
        }
        self.scratch.chain = chain;
        Ok(stats)
    }
}
