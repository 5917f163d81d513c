//! The approx model as a snapshot: what a new or restarted replica starts from.
//!
//! [`Router::dump_model`] writes every worker's modelled cache — its blocks with their parents
//! and partitions, least recently touched first — and [`Router::load_model`] replaces this
//! router's model with one. Guarantees:
//! - `load_model(dump_model())` into a router with the same workers, capacity and endpoints
//!   gives the same predictions: the same blocks on every worker, the same index, and the same
//!   eviction order (the blocks are re-touched in their recorded order, and eviction depends on
//!   that order alone). Idle times restart at the load's `now` (the TTL, if any, counts from
//!   there).
//! - Workers of the snapshot this router does not have are ignored; this router's workers
//!   missing from it start empty. Partitions this router's caches do not declare become the
//!   shared pool. A snapshot holding more blocks than a worker's capacity keeps what the cache's
//!   own eviction keeps.
//! - `load_model` validates everything first (magic, version, checksum, bounds, UTF-8, every
//!   parent present, the chains consistent across workers) and on any error returns
//!   [`crate::Error::Value`] changing nothing. It never allocates more than the image justifies.
//!
//! Layout (little-endian): `b"KVRMODEL"`, version `u32` = 1, workers `u32`; per worker: name
//! (`u32` length + UTF-8), partitions `u16` + names (`u16` length + UTF-8; partition 0 is the
//! shared pool, `k` the k-th name), blocks `u32`, then per block `hash u64`, `parent u64`, flags
//! `u8` (bit 0: has a parent), partition `u16`; then `XXH3-64` of every byte before it.

use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_64;

use crate::cache::{BlockCache, PartitionId};
use crate::error::Result;
use crate::index::PrefixIndex;
use crate::value_err;

use super::workers::check_finite;
use super::Router;

const MAGIC: &[u8; 8] = b"KVRMODEL";
const VERSION: u32 = 1;
const BLOCK_BYTES: usize = 8 + 8 + 1 + 2;

/// One worker's part of a decoded snapshot.
struct WorkerImage<'a> {
    name: &'a str,
    partitions: Vec<&'a str>,
    /// `(hash, parent, partition number)`, least recently touched first.
    blocks: Vec<(u64, Option<u64>, u16)>,
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        match self
            .at
            .checked_add(n)
            .and_then(|e| self.data.get(self.at..e))
        {
            Some(s) => {
                self.at += n;
                Ok(s)
            }
            None => value_err!("model snapshot truncated at byte {} ({what})", self.at),
        }
    }

    fn int<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn name(&mut self, len: usize, what: &str) -> Result<&'a str> {
        let at = self.at;
        match std::str::from_utf8(self.take(len, what)?) {
            Ok(s) => Ok(s),
            Err(_) => value_err!("model snapshot: {what} at byte {at} is not UTF-8"),
        }
    }
}

fn decode(data: &[u8]) -> Result<Vec<WorkerImage<'_>>> {
    let Some(body_len) = data.len().checked_sub(8) else {
        return value_err!("model snapshot too short ({} bytes)", data.len());
    };
    let (body, sum) = data.split_at(body_len);
    let mut s = [0u8; 8];
    s.copy_from_slice(sum);
    if body.get(..MAGIC.len()) != Some(MAGIC.as_slice()) {
        return value_err!("not a kvroute model snapshot (no KVRMODEL header)");
    }
    if xxh3_64(body) != u64::from_le_bytes(s) {
        return value_err!("model snapshot checksum mismatch (corrupt or truncated)");
    }
    let mut r = Reader {
        data: body,
        at: MAGIC.len(),
    };
    let version = u32::from_le_bytes(r.int("version")?);
    if version != VERSION {
        return value_err!(
            "model snapshot version {version} is not supported (expected {VERSION})"
        );
    }
    let workers = u32::from_le_bytes(r.int("worker count")?) as usize;
    let mut out = Vec::with_capacity(workers.min(body.len() / 8));
    for _ in 0..workers {
        let len = u32::from_le_bytes(r.int("worker name length")?) as usize;
        let name = r.name(len, "worker name")?;
        let parts = u16::from_le_bytes(r.int("partition count")?);
        let mut partitions = Vec::with_capacity(usize::from(parts).min(body.len() / 2));
        for _ in 0..parts {
            let len = u16::from_le_bytes(r.int("partition name length")?);
            partitions.push(r.name(usize::from(len), "partition name")?);
        }
        let n = u32::from_le_bytes(r.int("block count")?) as usize;
        let raw = r.take(n.saturating_mul(BLOCK_BYTES), "blocks")?;
        let mut blocks = Vec::with_capacity(n);
        for b in raw.chunks_exact(BLOCK_BYTES) {
            let mut br = Reader { data: b, at: 0 };
            let hash = u64::from_le_bytes(br.int("hash")?);
            let parent = u64::from_le_bytes(br.int("parent")?);
            let flags = u8::from_le_bytes(br.int("flags")?);
            let part = u16::from_le_bytes(br.int("partition")?);
            if usize::from(part) > partitions.len() {
                return value_err!(
                    "model snapshot: block {hash:#x} of worker {name:?} names partition {part} \
                     of {}",
                    partitions.len()
                );
            }
            blocks.push((hash, (flags & 1 != 0).then_some(parent), part));
        }
        out.push(WorkerImage {
            name,
            partitions,
            blocks,
        });
    }
    if r.at != body.len() {
        return value_err!("model snapshot has {} trailing bytes", body.len() - r.at);
    }
    Ok(out)
}

/// The blocks of `image` in an order where every parent comes before its children (by depth,
/// stable), or an error naming a block whose parent is missing or a cycle.
fn parents_first(image: &WorkerImage<'_>) -> Result<Vec<usize>> {
    let mut at: HashMap<u64, usize> = HashMap::with_capacity(image.blocks.len());
    for (k, &(h, _, _)) in image.blocks.iter().enumerate() {
        if at.insert(h, k).is_some() {
            return value_err!(
                "model snapshot: block {h:#x} listed twice for worker {:?}",
                image.name
            );
        }
    }
    let n = image.blocks.len();
    let mut depth: Vec<Option<u32>> = vec![None; n];
    let mut path = Vec::new();
    for start in 0..n {
        if depth.get(start).copied().flatten().is_some() {
            continue;
        }
        path.clear();
        let mut k = start;
        // Walk up to a root or to an ancestor whose depth is known.
        let above = loop {
            if path.len() > n {
                return value_err!("model snapshot: worker {:?} has a parent cycle", image.name);
            }
            path.push(k);
            let Some(p) = image.blocks.get(k).and_then(|b| b.1) else {
                break None;
            };
            let Some(&pk) = at.get(&p) else {
                return value_err!(
                    "model snapshot: parent {p:#x} of a block of worker {:?} is missing",
                    image.name
                );
            };
            if let Some(d) = depth.get(pk).copied().flatten() {
                break Some(d);
            }
            k = pk;
        };
        for (d, &k) in (above.map_or(0, |d| d + 1)..).zip(path.iter().rev()) {
            if let Some(slot) = depth.get_mut(k) {
                *slot = Some(d);
            }
        }
    }
    let mut order: Vec<usize> = (0..image.blocks.len()).collect();
    order.sort_by_key(|&k| depth.get(k).copied().flatten().unwrap_or(0));
    Ok(order)
}

impl Router {
    /// The approx model as a snapshot (see the module docs). Errors in events mode.
    pub fn dump_model(&self) -> Result<Vec<u8>> {
        if self.model.is_none() {
            return value_err!("dump_model needs index='approx' (events mode has no model)");
        }
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(self.workers.len() as u32).to_le_bytes());
        for w in self.workers.iter() {
            out.extend_from_slice(&(w.name.len() as u32).to_le_bytes());
            out.extend_from_slice(w.name.as_bytes());
            let Some(cache) = w.cache.as_ref() else {
                out.extend_from_slice(&0u16.to_le_bytes());
                out.extend_from_slice(&0u32.to_le_bytes());
                continue;
            };
            let names: Vec<&str> = cache.reservations().map(|(n, _)| n).collect();
            out.extend_from_slice(&(names.len() as u16).to_le_bytes());
            for n in &names {
                out.extend_from_slice(&(n.len() as u16).to_le_bytes());
                out.extend_from_slice(n.as_bytes());
            }
            let blocks = cache.blocks_by_recency();
            out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
            for (hash, parent, part) in blocks {
                out.extend_from_slice(&hash.to_le_bytes());
                out.extend_from_slice(&parent.unwrap_or(0).to_le_bytes());
                out.push(u8::from(parent.is_some()));
                // Partition k is the k-th declared name (0: shared).
                let number = cache
                    .partition_name(part)
                    .and_then(|n| names.iter().position(|&x| x == n))
                    .map_or(0, |p| p + 1);
                out.extend_from_slice(&(number as u16).to_le_bytes());
            }
        }
        let sum = xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        Ok(out)
    }

    /// Replaces the approx model with a snapshot's at `now` (see the module docs); errors
    /// change nothing.
    pub fn load_model(&mut self, data: &[u8], now: f64) -> Result<()> {
        check_finite(now, "now")?;
        let Some(model) = self.model.as_ref() else {
            return value_err!("load_model needs index='approx' (events mode has no model)");
        };
        let images = decode(data)?;
        let by_name: HashMap<&str, &WorkerImage<'_>> = images.iter().map(|i| (i.name, i)).collect();
        // Build every new cache and the new index aside; swap them in only once all is valid.
        let mut index = PrefixIndex::new(None)?;
        let mut built: Vec<(u32, BlockCache, u32)> = Vec::with_capacity(self.workers.len());
        let mut evicted = Vec::new();
        for (slot, w) in self.workers.iter_slots() {
            let mut cache = model.new_cache()?;
            if let Some(old) = w.cache.as_ref() {
                for (name, blocks) in old.reservations() {
                    cache.add_partition(name, blocks)?;
                }
            }
            if let Some(image) = by_name.get(&*w.name) {
                let part_of = |k: u16| -> PartitionId {
                    k.checked_sub(1)
                        .and_then(|k| image.partitions.get(usize::from(k)))
                        .and_then(|n| cache.partition(n).ok())
                        .unwrap_or(PartitionId::SHARED)
                };
                let parts: Vec<PartitionId> = image.blocks.iter().map(|b| part_of(b.2)).collect();
                for k in parents_first(image)? {
                    let (Some(&(h, parent, _)), Some(&part)) = (image.blocks.get(k), parts.get(k))
                    else {
                        continue;
                    };
                    // The parent is placed before its children; it may have been evicted if the
                    // snapshot is larger than this cache, and then the block goes too.
                    if parent.is_some_and(|p| !cache.contains(p)) {
                        continue;
                    }
                    evicted.clear();
                    cache.insert_into(&[h], part, parent, now, &mut evicted)?;
                }
                for &(h, _, _) in &image.blocks {
                    cache.match_prefix(&[h]);
                }
            }
            let id = index.add_worker(&w.name)?;
            let mut stored = cache.blocks_by_recency();
            let image = WorkerImage {
                name: &w.name,
                partitions: Vec::new(),
                blocks: stored.drain(..).map(|(h, p, _)| (h, p, 0)).collect(),
            };
            for k in parents_first(&image)? {
                if let Some(&(h, parent, _)) = image.blocks.get(k) {
                    index.store_id(id, &[h], parent)?;
                }
            }
            built.push((slot, cache, id));
        }
        // Commit: nothing fails from here on.
        *self.index.write() = index;
        for (slot, cache, id) in built {
            if let Some(w) = self.workers.get_mut(slot) {
                w.cache = Some(Box::new(cache));
                w.index_id = Some(id);
                w.idle_deadline = f64::NEG_INFINITY;
            }
        }
        self.id_cache.clear();
        Ok(())
    }
}
