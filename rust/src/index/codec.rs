//! `dump` / `load`: a versioned, checksummed binary image of a prefix index.
//!
//! Layout (all integers little-endian):
//! ```text
//! magic  b"KVRIDX\0\0"   version u32 (= 1)
//! workers: count u32, then per worker: name length u32, UTF-8 name
//! nodes:   count u32, then per node, parents before children:
//!          parent u32 (0 = root, k = the k-th node), run length u32, last use u64,
//!          worker count u32, worker indices u32 (strictly increasing), block hashes u64 × length
//! checksum u64 = XXH3-64 (seed 0) of every byte before it
//! ```
//! Guarantees: `load(dump(x))` has the same workers, blocks, answers and tree shape as `x`.
//! `load` validates everything (checksum, bounds, UTF-8, unique names and blocks, worker sets
//! non-empty and within their parent's) and returns [`Error::Value`] for any bad image; it never
//! allocates more than the image's size justifies.

use std::sync::atomic::Ordering;

use xxhash_rust::xxh3::xxh3_64;

use super::tree::{Tree, ROOT};
use super::worker_set::WorkerSet;
use super::{PrefixIndex, WorkerId};
use crate::error::{Error, Result};
use crate::value_err;

const MAGIC: &[u8; 8] = b"KVRIDX\0\0";
const VERSION: u32 = 1;

impl PrefixIndex {
    /// The index as a versioned binary image (see [`PrefixIndex::load`]).
    pub fn dump(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.len() * 8 + self.num_nodes() * 24);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        // Live workers in id order; `index[id]` is the worker's position in the image.
        let mut index = vec![u32::MAX; self.workers.names.len()];
        let live: Vec<(WorkerId, &str)> = (0..self.workers.names.len() as WorkerId)
            .filter_map(|id| self.worker_name(id).map(|n| (id, n)))
            .collect();
        out.extend_from_slice(&(live.len() as u32).to_le_bytes());
        for (pos, (id, name)) in live.iter().enumerate() {
            if let Some(slot) = index.get_mut(*id as usize) {
                *slot = pos as u32;
            }
            out.extend_from_slice(&(name.len() as u32).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
        }
        out.extend_from_slice(&(self.num_nodes() as u32).to_le_bytes());
        let mut number = vec![0u32; self.tree.nodes.len()];
        let mut next = 1u32;
        let mut stack = vec![ROOT];
        let mut kids = Vec::new();
        while let Some(id) = stack.pop() {
            // Children in reverse, so `load` (which links each new child first) keeps their order
            // and `dump(load(image)) == image`.
            kids.clear();
            kids.extend(self.tree.children(id));
            for &c in kids.iter().rev() {
                let n = self.tree.node(c);
                number[c as usize] = next;
                next += 1;
                out.extend_from_slice(&number[id as usize].to_le_bytes());
                out.extend_from_slice(&(n.hashes.len() as u32).to_le_bytes());
                out.extend_from_slice(&n.tick().to_le_bytes());
                out.extend_from_slice(&(n.workers.len() as u32).to_le_bytes());
                for w in n.workers.iter() {
                    let pos = index.get(w as usize).copied().unwrap_or(u32::MAX);
                    out.extend_from_slice(&pos.to_le_bytes());
                }
                for h in &n.hashes {
                    out.extend_from_slice(&h.to_le_bytes());
                }
                stack.push(c);
            }
        }
        let sum = xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// Rebuilds an index from [`PrefixIndex::dump`] output, with memory budget `max_bytes`.
    pub fn load(bytes: &[u8], max_bytes: Option<usize>) -> Result<Self> {
        let Some((body, sum)) = bytes.split_last_chunk::<8>() else {
            return value_err!("index image too short ({} bytes)", bytes.len());
        };
        let mut r = Reader { bytes: body, at: 0 };
        if r.take(8)? != MAGIC {
            return value_err!("not a kvroute index image (bad magic)");
        }
        let version = r.u32()?;
        if version != VERSION {
            return value_err!("unsupported index image version {version} (expected {VERSION})");
        }
        if xxh3_64(body) != u64::from_le_bytes(*sum) {
            return value_err!("index image checksum mismatch (corrupted or truncated)");
        }
        let mut index = PrefixIndex::new(None)?;
        let num_workers = r.count(4, "workers")?;
        for i in 0..num_workers {
            let len = r.count(1, "worker name bytes")?;
            let Ok(name) = std::str::from_utf8(r.take(len)?) else {
                return value_err!("worker {i}: name is not UTF-8");
            };
            if index.worker_id(name).is_some() {
                return value_err!("worker name {name:?} appears twice");
            }
            index.workers.insert(name);
        }
        let num_nodes = r.count(24, "nodes")?;
        let mut tree = Tree::with_capacity(num_nodes + 1, 0);
        let mut ids: Vec<u32> = Vec::with_capacity(num_nodes + 1);
        ids.push(ROOT);
        let mut words = Vec::new();
        for k in 1..=num_nodes {
            let parent = r.u32()? as usize;
            let Some(&parent_id) = ids.get(parent) else {
                return value_err!("node {k}: parent {parent} does not precede it");
            };
            let len = r.count(8, "blocks")?;
            if len == 0 {
                return value_err!("node {k}: empty run");
            }
            let tick = r.u64()?;
            let count = r.count(4, "worker indices")?;
            words.clear();
            let mut last = None;
            for _ in 0..count {
                let w = r.u32()?;
                if w as usize >= num_workers || last.is_some_and(|l| l >= w) {
                    return value_err!("node {k}: bad worker index {w}");
                }
                last = Some(w);
                let word = w as usize / 64;
                if words.len() <= word {
                    words.resize(word + 1, 0);
                }
                if let Some(x) = words.get_mut(word) {
                    *x |= 1 << (w % 64);
                }
            }
            let workers = WorkerSet::from_words(words.clone());
            if workers.is_empty() {
                return value_err!("node {k}: no worker holds it");
            }
            if parent_id != ROOT && !workers.is_subset(&tree.node(parent_id).workers) {
                return value_err!("node {k}: holds workers its parent does not");
            }
            let raw = r.take(len * 8)?;
            let hashes: Vec<u64> = raw
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect();
            let id = tree.alloc(hashes, workers, tick);
            tree.link(id, parent_id);
            if let Err(h) = tree.insert_entries(id) {
                return value_err!("node {k}: block {h:#018x} is stored twice");
            }
            tree.set_start(tree.node(id).hashes.first().copied().unwrap_or(0), id);
            for w in tree.node(id).workers.iter() {
                index.workers.add_blocks(w, len);
            }
            ids.push(id);
        }
        if r.at != body.len() {
            return value_err!("{} trailing bytes after the last node", body.len() - r.at);
        }
        // A parent is never older than its children; then restore canonical form.
        for &id in ids.iter().rev() {
            let n = tree.node(id);
            let (tick, parent) = (n.tick(), n.parent);
            if id != ROOT {
                tree.node(parent)
                    .last_used
                    .fetch_max(tick, Ordering::Relaxed);
            }
        }
        let clock = tree.node(ROOT).tick() + 1;
        for &id in &ids {
            tree.normalize(id);
        }
        index.tree = tree;
        index.clock.store(clock, Ordering::Relaxed);
        index.max_bytes = max_bytes;
        if let Some(max) = max_bytes {
            // The worker table (as loaded: at least its compacted size) must fit beside an empty
            // index, as `add_worker` admits a worker, before blocks are evicted to fit the rest.
            let table = PrefixIndex::min_budget() + index.workers.heap_bytes();
            if table > max {
                return value_err!(
                    "max_bytes = {max} cannot hold the table of {} workers",
                    index.num_workers()
                );
            }
            index.enforce_budget();
        }
        Ok(index)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end.and_then(|e| self.bytes.get(self.at..e)) {
            Some(s) => {
                self.at += n;
                Ok(s)
            }
            None => value_err!("index image truncated at byte {}", self.at),
        }
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes(b.try_into().unwrap_or_default()))
    }

    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }

    /// A count of items of at least `item_size` bytes each, bounded by the bytes left.
    fn count(&mut self, item_size: usize, what: &str) -> Result<usize> {
        let n = self.u32()? as usize;
        if n.saturating_mul(item_size) > self.bytes.len() - self.at {
            return Err(Error::Value(format!(
                "index image claims {n} {what}, more than its remaining bytes hold"
            )));
        }
        Ok(n)
    }
}
