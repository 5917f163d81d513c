//! The prefix index: which worker holds which cached KV blocks, and how many leading blocks of a
//! request each worker already has.
//!
//! # Model
//! Block hashes are *chained*: a block's hash identifies its whole prefix, so the stored blocks
//! form a tree (a block's parent is the block before it in every chain that contains it). Each
//! worker holds a set of blocks that is always **prefix-closed**: if a worker holds a block, it
//! holds every block before it.
//!
//! - [`PrefixIndex::store`] (`worker`, chain, `parent`): the worker now holds the chain, which
//!   continues from `parent` (or starts a sequence when `parent` is `None`). The worker must hold
//!   `parent`, else [`Error::Key`]. A block already stored after a *different* parent (or repeated
//!   within the chain) is inconsistent input: [`Error::Value`]. Either error changes nothing.
//! - [`PrefixIndex::remove`] (`worker`, blocks): the worker drops each listed block **and every
//!   block after it** that it holds (they could never be matched again without the dropped block;
//!   keeping them would only waste memory). Blocks the worker does not hold are ignored, so
//!   replaying a removal is harmless. A later `store` of the dropped block does not revive its
//!   descendants: the engine stores them again when it reuses them.
//!   [`PrefixIndex::remove_id_into`] also lists the dropped blocks, each after its descendants.
//! - [`PrefixIndex::match_into`] (query chain): for each worker, the number of leading blocks of the
//!   query it holds; workers with 0 are omitted. A block counts only if the worker holds every
//!   block before it *in the query*, and only if it was stored after the same parent the query
//!   gives it.
//! - [`PrefixIndex::len`] counts distinct blocks held by at least one worker;
//!   [`PrefixIndex::num_blocks`] counts the blocks one worker holds, so
//!   `Σ num_blocks = (worker, block) pairs`.
//! - Workers are registered by their first `store` (or [`PrefixIndex::add_worker`]) and keep a
//!   dense internal id ([`WorkerId`]) until [`PrefixIndex::remove_worker`]; ids are reused after
//!   that. [`PrefixIndex::clear`] drops a worker's blocks but keeps the worker.
//!
//! # Structure
//! A radix tree with path compression: a node holds a contiguous run of block hashes that all have
//! the same set of workers, as a bitset over worker ids (inline for ids < 64). Matching a long
//! query compares contiguous memory, with one probe per node (not per block) of a small table
//! from each node's first block to the node. Nodes split when a chain diverges or a worker holds only part of a run, and **merge**
//! back as soon as a removal makes the split unnecessary, so the tree's shape is a function of
//! the stored state alone (canonical form; [`PrefixIndex::num_nodes`] exposes it). The block
//! table (for parents and removals) maps a block hash to its node and offset in 8 bytes per entry
//! (it stores no key: the key is read from the run).
//!
//! # Cost
//! A store or removal does one block-table operation per block it adds or drops and touches only
//! the nodes it changes; nothing is allocated per block (a new run is one allocation, and the
//! traversal buffers are kept in the index between calls, counted in
//! [`PrefixIndex::memory_bytes`]). A chain that continues a leaf only its worker holds (a
//! conversation's next turn) is appended to that run in place. A removal batch — vLLM reports an
//! eviction as one event per block, tail first — is grouped by node and each node is cut once;
//! a run only the removing worker holds is truncated in place.
//!
//! # Memory budget
//! With `max_bytes`, [`PrefixIndex::memory_bytes`] (an account of every heap allocation of the
//! structure, with a per-allocation allowance for the allocator) never exceeds the budget after
//! a mutation returns. When a mutation takes it past the budget, the least recently stored or
//! matched *leaf* nodes (no children) are dropped — for every worker holding them — until the index
//! is at most 15/16 of the budget (the slack amortises the O(nodes) eviction pass), and the
//! structure is compacted. Answers stay sound: eviction only ever removes (worker, block) pairs.
//! Recency is a logical clock stamped on the path of each store and match (one relaxed atomic per
//! visited node, only when a budget is set), so `match` needs only shared access.
//!
//! # Concurrency
//! Queries take `&self`, mutations `&mut self`; share with [`SharedPrefixIndex`]
//! (`Arc<RwLock<PrefixIndex>>`), as the Python class and the router do.

mod budget;
mod codec;
mod tree;
mod worker_set;
mod worker_table;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::{key_err, value_err};
use tree::{Tree, ROOT};
use worker_set::WorkerSet;
use worker_table::Workers;

/// Allowance for the allocator's own bookkeeping, counted once per heap allocation.
pub(crate) const ALLOC_OVERHEAD: usize = 16;

/// Dense internal id of a worker (stable until the worker is removed).
pub type WorkerId = u32;

/// A prefix index shared between threads (the Python class and the router hold one).
pub type SharedPrefixIndex = Arc<parking_lot::RwLock<PrefixIndex>>;

/// One operation of a bulk [`PrefixIndex::apply`].
#[derive(Clone, Copy, Debug)]
pub enum IndexOp<'a> {
    /// [`PrefixIndex::store_id`].
    Store {
        worker: WorkerId,
        hashes: &'a [u64],
        parent: Option<u64>,
    },
    /// [`PrefixIndex::remove_id`].
    Remove { worker: WorkerId, hashes: &'a [u64] },
    /// [`PrefixIndex::clear_id`].
    Clear { worker: WorkerId },
}

/// Buffers the mutations reuse from call to call, so that once they have grown a store or a
/// removal allocates nothing (counted in [`PrefixIndex::memory_bytes`], released by compaction).
#[derive(Default)]
struct Scratch {
    /// `remove`: `(node, offset, block)` of each listed block the worker holds.
    cuts: Vec<(u32, usize, u64)>,
    /// `store`: nodes whose worker set grew; `drop_below`: the nodes visited.
    nodes: Vec<u32>,
    /// `drop_below`: its start nodes, then its traversal stack.
    stack: Vec<u32>,
    /// `drop_below`: the parents of its start nodes.
    parents: Vec<u32>,
}

impl Scratch {
    fn heap_bytes(&self) -> usize {
        fn bytes<T>(v: &Vec<T>) -> usize {
            match v.capacity() {
                0 => 0,
                n => n * std::mem::size_of::<T>() + ALLOC_OVERHEAD,
            }
        }
        bytes(&self.cuts) + bytes(&self.nodes) + bytes(&self.stack) + bytes(&self.parents)
    }
}

/// The prefix index (see the module docs for its semantics and invariants).
pub struct PrefixIndex {
    tree: Tree,
    workers: Workers,
    max_bytes: Option<usize>,
    clock: AtomicU64,
    scratch: Scratch,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex {
            tree: Tree::new(),
            workers: Workers::default(),
            max_bytes: None,
            clock: AtomicU64::new(1),
            scratch: Scratch::default(),
        }
    }
}

impl PrefixIndex {
    /// An empty index; `max_bytes` is the hard memory budget (at least [`Self::min_budget`]).
    pub fn new(max_bytes: Option<usize>) -> Result<Self> {
        let index = PrefixIndex {
            max_bytes,
            ..Default::default()
        };
        if let Some(max) = max_bytes {
            if max < index.memory_bytes() {
                return value_err!(
                    "max_bytes = {max} is below the {} bytes of an empty index",
                    index.memory_bytes()
                );
            }
        }
        Ok(index)
    }

    /// The smallest budget [`Self::new`] accepts (the bytes of an empty index).
    pub fn min_budget() -> usize {
        PrefixIndex::default().memory_bytes()
    }

    /// The memory budget, if any.
    pub fn max_bytes(&self) -> Option<usize> {
        self.max_bytes
    }

    // ---- workers ----------------------------------------------------------------------------

    /// The id of worker `name`, if registered.
    pub fn worker_id(&self, name: &str) -> Option<WorkerId> {
        self.workers.ids.get(name).copied()
    }

    /// The name of worker `id`, if registered.
    pub fn worker_name(&self, id: WorkerId) -> Option<&str> {
        self.workers.name(id).map(|n| &**n)
    }

    /// The name of worker `id` as the index holds it (its identity lets a caller cache a
    /// conversion of the name).
    pub fn worker_name_ref(&self, id: WorkerId) -> Option<&Arc<str>> {
        self.workers.name(id)
    }

    /// The name of worker `id` as a shared string (cheap to clone out of a lock).
    pub fn worker_name_arc(&self, id: WorkerId) -> Option<Arc<str>> {
        self.workers.name(id).cloned()
    }

    /// Registers worker `name` (no-op if known) and returns its id. With a budget, fails with
    /// [`Error::Value`] when the worker table alone would not fit in it.
    pub fn add_worker(&mut self, name: &str) -> Result<WorkerId> {
        if let Some(id) = self.worker_id(name) {
            return Ok(id);
        }
        if let Some(max) = self.max_bytes {
            self.workers.names.reserve(1);
            self.workers.blocks.reserve(1);
            self.workers.ids.reserve(1);
            let needed = PrefixIndex::min_budget()
                + self.workers.heap_bytes()
                + name.len()
                + 16
                + ALLOC_OVERHEAD;
            if needed > max {
                self.workers.shrink();
                return value_err!(
                    "max_bytes = {max} cannot hold the table of {} workers",
                    self.workers.ids.len() + 1
                );
            }
        }
        Ok(self.workers.insert(name))
    }

    /// Names of the registered workers, sorted.
    pub fn workers(&self) -> Vec<Arc<str>> {
        let mut names: Vec<Arc<str>> = self.workers.names.iter().flatten().cloned().collect();
        names.sort();
        names
    }

    /// Number of registered workers.
    pub fn num_workers(&self) -> usize {
        self.workers.ids.len()
    }

    fn check_id(&self, id: WorkerId) -> Result<()> {
        match self.workers.name(id) {
            Some(_) => Ok(()),
            None => key_err!("unknown worker id {id}"),
        }
    }

    fn id_of(&self, name: &str) -> Result<WorkerId> {
        match self.worker_id(name) {
            Some(id) => Ok(id),
            None => key_err!("unknown worker {name:?}"),
        }
    }

    /// Blocks held by worker `name` ([`Error::Key`] if unknown).
    pub fn num_blocks(&self, name: &str) -> Result<u64> {
        self.num_blocks_id(self.id_of(name)?)
    }

    /// Blocks held by worker `id`.
    pub fn num_blocks_id(&self, id: WorkerId) -> Result<u64> {
        self.check_id(id)?;
        Ok(self.workers.blocks.get(id as usize).copied().unwrap_or(0))
    }

    /// Distinct blocks held by at least one worker.
    pub fn len(&self) -> usize {
        self.tree.num_blocks()
    }

    /// True when no worker holds a block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when some worker holds block `h`.
    pub fn contains(&self, h: u64) -> bool {
        self.tree.find(h).is_some()
    }

    /// Number of tree nodes (runs), root excluded: a function of the stored state alone.
    pub fn num_nodes(&self) -> usize {
        self.tree.live_nodes
    }

    /// Heap bytes of the whole structure (see the module docs).
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.tree.memory_bytes()
            + self.workers.heap_bytes()
            + self.scratch.heap_bytes()
    }

    fn next_tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    // ---- store ------------------------------------------------------------------------------

    /// Worker `name` (registered if new) now holds the chain `hashes`, continuing from `parent`.
    pub fn store(&mut self, name: &str, hashes: &[u64], parent: Option<u64>) -> Result<()> {
        match self.worker_id(name) {
            Some(id) => self.store_id(id, hashes, parent),
            None => {
                if let Some(p) = parent {
                    return key_err!("worker {name:?} does not hold parent block {p:#018x}");
                }
                let id = self.add_worker(name)?;
                let out = self.store_unchecked_budget(id, hashes, parent);
                if out.is_err() {
                    self.workers.remove(id);
                }
                self.after_mutation(out.is_ok());
                out
            }
        }
    }

    /// [`Self::store`] by worker id.
    pub fn store_id(&mut self, w: WorkerId, hashes: &[u64], parent: Option<u64>) -> Result<()> {
        let out = self.store_unchecked_budget(w, hashes, parent);
        self.after_mutation(out.is_ok());
        out
    }

    fn store_unchecked_budget(
        &mut self,
        w: WorkerId,
        hashes: &[u64],
        parent: Option<u64>,
    ) -> Result<()> {
        self.check_id(w)?;
        if hashes.len() >= (u32::MAX / 2) as usize {
            return value_err!("a chain of {} blocks is too long", hashes.len());
        }
        // Phase 1 (read-only): follow the chain through the tree as far as it is stored.
        let (mut node, mut consumed) = match parent {
            None => (ROOT, 0usize),
            Some(p) => match self.tree.find(p) {
                Some((n, off)) if self.tree.node(n).workers.contains(w) => (n, off + 1),
                _ => {
                    let name = self.worker_name(w).unwrap_or("?");
                    return key_err!("worker {name:?} does not hold parent block {p:#018x}");
                }
            },
        };
        let mut i = 0;
        while let Some(&h) = hashes.get(i) {
            let run = &self.tree.node(node).hashes;
            if consumed < run.len() {
                let k = tree::common_prefix(&run[consumed..], &hashes[i..]);
                i += k;
                consumed += k;
                if k == 0 {
                    break; // diverges inside the run
                }
            } else {
                // Not a child here: new, or stored elsewhere (caught when its entry is inserted).
                let Some(c) = self.tree.child_starting_with(node, h) else {
                    break;
                };
                node = c;
                consumed = 1;
                i += 1;
            }
        }
        let new = hashes.get(i..).unwrap_or_default();
        let tick = self.next_tick();
        let conflict = |h: u64| {
            value_err!("block {h:#018x} is already stored after a different parent, or repeated")
        };

        // The chain continues past the end of a leaf only this worker holds (a conversation's
        // next turn): the new blocks extend that run in place (canonical form is kept: the
        // leaf's worker set and links do not change). It can fail only as phase 2 can.
        if !new.is_empty() && node != ROOT {
            let n = self.tree.node(node);
            if consumed == n.hashes.len() && n.num_children == 0 && n.workers.is_only(w) {
                if let Err(h) = self.tree.extend_run(node, new) {
                    return conflict(h);
                }
                self.workers.add_blocks(w, new.len());
                self.tree.touch_path(node, tick);
                return Ok(());
            }
        }

        // Phase 2: the new blocks go into a fresh node (the only step that can still fail, on a
        // block stored elsewhere or repeated; it undoes itself).
        let fresh = if new.is_empty() {
            None
        } else {
            let h0 = new.first().copied().unwrap_or(0);
            let x = self.tree.alloc(new.to_vec(), WorkerSet::single(w), tick);
            if let Err(h) = self.tree.insert_entries(x) {
                self.tree.delete_leaf(x);
                return conflict(h);
            }
            self.tree.set_start(h0, x);
            Some(x)
        };

        // Phase 3: the worker's blocks end (or the chain diverges) inside a run: split it.
        let run_len = self.tree.node(node).hashes.len();
        if node != ROOT
            && consumed < run_len
            && (fresh.is_some() || !self.tree.node(node).workers.contains(w))
        {
            node = self.tree.split(node, consumed).0;
        }
        // The worker now holds the whole path to `node`: add it where missing (a suffix of the
        // path, since its blocks are prefix-closed).
        let mut touched = std::mem::take(&mut self.scratch.nodes);
        touched.clear();
        let mut y = node;
        while y != ROOT && !self.tree.node(y).workers.contains(w) {
            self.tree.add_worker(y, w);
            self.workers.add_blocks(w, self.tree.node(y).hashes.len());
            touched.push(y);
            y = self.tree.node(y).parent;
        }
        let end = match fresh {
            Some(x) => {
                self.tree.link(x, node);
                self.workers.add_blocks(w, new.len());
                touched.push(x);
                x
            }
            None => node,
        };
        self.tree.touch_path(end, tick);
        for &t in &touched {
            self.tree.normalize(t);
        }
        touched.clear();
        self.scratch.nodes = touched;
        Ok(())
    }

    // ---- remove -----------------------------------------------------------------------------

    /// Worker `name` dropped `hashes` (and the blocks after each); returns the number of
    /// (worker, block) pairs dropped.
    pub fn remove(&mut self, name: &str, hashes: &[u64]) -> Result<u64> {
        self.remove_id(self.id_of(name)?, hashes)
    }

    /// [`Self::remove`] by worker id.
    ///
    /// The result does not depend on the order of `hashes`; a batch (e.g. one block per evicted
    /// block, tail first, as vLLM reports evictions) costs one cut per tree node it touches.
    pub fn remove_id(&mut self, w: WorkerId, hashes: &[u64]) -> Result<u64> {
        self.remove_impl(w, hashes, None)
    }

    /// [`Self::remove_id`], also appending every block the worker dropped to `dropped`, each
    /// block after all of its descendants (so the list can be replayed leaf-first, e.g. on a
    /// [`crate::cache::BlockCache`] that mirrors the worker).
    pub fn remove_id_into(
        &mut self,
        w: WorkerId,
        hashes: &[u64],
        dropped: &mut Vec<u64>,
    ) -> Result<u64> {
        self.remove_impl(w, hashes, Some(dropped))
    }

    fn remove_impl(
        &mut self,
        w: WorkerId,
        hashes: &[u64],
        collect: Option<&mut Vec<u64>>,
    ) -> Result<u64> {
        self.check_id(w)?;
        let dropped = match hashes {
            [] => 0,
            &[h] => self.cut(w, h, collect),
            _ => self.cut_many(w, hashes, collect),
        };
        self.enforce_budget();
        Ok(dropped)
    }

    /// Drops worker `w`'s blocks `hashes` and the blocks after them, with one cut per node: the
    /// listed blocks `w` holds are grouped by node and only the first of each node is cut
    /// (dropping a block drops the rest of its run anyway). With `collect`, appends the dropped
    /// blocks, each after its descendants (a later cut never drops a descendant of an earlier
    /// one's blocks: those are gone already).
    fn cut_many(&mut self, w: WorkerId, hashes: &[u64], mut collect: Option<&mut Vec<u64>>) -> u64 {
        let mut cuts = std::mem::take(&mut self.scratch.cuts);
        cuts.clear();
        for &h in hashes {
            if let Some((node, off)) = self.tree.find(h) {
                if self.tree.node(node).workers.contains(w) {
                    cuts.push((node, off, h));
                }
            }
        }
        cuts.sort_unstable();
        cuts.dedup_by_key(|c| c.0);
        // A cut can delete, split or merge other nodes of the list, so each block is looked up
        // again; one another cut already dropped is a no-op.
        let dropped = cuts
            .iter()
            .map(|&(_, _, h)| self.cut(w, h, collect.as_deref_mut()))
            .sum();
        cuts.clear();
        self.scratch.cuts = cuts;
        dropped
    }

    /// Drops worker `w`'s block `h` and every block after it that `w` holds; returns the pairs
    /// dropped (0 when `w` does not hold `h`). With `collect`, appends the dropped blocks, each
    /// after its descendants.
    fn cut(&mut self, w: WorkerId, h: u64, mut collect: Option<&mut Vec<u64>>) -> u64 {
        let Some((node, off)) = self.tree.find(h) else {
            return 0;
        };
        let n = self.tree.node(node);
        if !n.workers.contains(w) {
            return 0;
        }
        if off > 0 && n.workers.is_only(w) {
            // `w` alone holds this run, so also everything below it: cut the run in place and
            // delete the subtrees under it. Canonical form is kept (the node stays, with the
            // same worker set and parent, now a leaf).
            let len = n.hashes.len();
            let mut dropped = 0;
            if n.num_children > 0 {
                self.scratch.stack.clear();
                self.scratch.stack.extend(self.tree.children(node));
                dropped = self.drop_below(w, collect.as_deref_mut());
            }
            if let Some(out) = collect {
                out.extend(self.tree.node(node).hashes.iter().skip(off).rev());
            }
            self.tree.truncate(node, off);
            self.workers.sub_blocks(w, len - off);
            return dropped + (len - off) as u64;
        }
        let start = if off > 0 {
            self.tree.split(node, off).1
        } else {
            node
        };
        self.scratch.stack.clear();
        self.scratch.stack.push(start);
        self.drop_below(w, collect)
    }

    /// Worker `name` dropped all its blocks (it stays registered).
    pub fn clear(&mut self, name: &str) -> Result<u64> {
        self.clear_id(self.id_of(name)?)
    }

    /// [`Self::clear`] by worker id.
    pub fn clear_id(&mut self, w: WorkerId) -> Result<u64> {
        self.check_id(w)?;
        let mut tops = std::mem::take(&mut self.scratch.stack);
        tops.clear();
        tops.extend(
            self.tree
                .children(ROOT)
                .filter(|&c| self.tree.node(c).workers.contains(w)),
        );
        self.scratch.stack = tops;
        let dropped = self.drop_below(w, None);
        self.enforce_budget();
        Ok(dropped)
    }

    /// Forgets worker `name` and its blocks.
    pub fn remove_worker(&mut self, name: &str) -> Result<u64> {
        self.remove_worker_id(self.id_of(name)?)
    }

    /// [`Self::remove_worker`] by worker id.
    pub fn remove_worker_id(&mut self, w: WorkerId) -> Result<u64> {
        let dropped = self.clear_id(w)?;
        self.workers.remove(w);
        Ok(dropped)
    }

    /// Removes worker `w` from the subtrees at the nodes in `scratch.stack` (nodes holding `w`),
    /// deletes nodes left without workers and restores canonical form. Returns the pairs
    /// dropped. With `collect`, appends the dropped blocks, each after all of its descendants.
    fn drop_below(&mut self, w: WorkerId, collect: Option<&mut Vec<u64>>) -> u64 {
        let mut visited = std::mem::take(&mut self.scratch.nodes);
        let mut stack = std::mem::take(&mut self.scratch.stack);
        let mut parents = std::mem::take(&mut self.scratch.parents);
        visited.clear();
        parents.clear();
        parents.extend(stack.iter().map(|&s| self.tree.node(s).parent));
        while let Some(x) = stack.pop() {
            visited.push(x);
            stack.extend(
                self.tree
                    .children(x)
                    .filter(|&c| self.tree.node(c).workers.contains(w)),
            );
        }
        if let Some(out) = collect {
            // `visited` lists every node before its children: reversed (runs too), every block
            // comes after its descendants.
            for &x in visited.iter().rev() {
                out.extend(self.tree.node(x).hashes.iter().rev());
            }
        }
        let mut dropped = 0u64;
        for &x in &visited {
            self.tree.remove_worker(x, w);
            dropped += self.tree.node(x).hashes.len() as u64;
        }
        self.workers.sub_blocks(w, dropped as usize);
        // Children come after their parent in `visited`; delete empty nodes bottom-up.
        for &x in visited.iter().rev() {
            if self.tree.node(x).workers.is_empty() {
                self.tree.delete_leaf(x);
            }
        }
        for &x in parents.iter().chain(&visited) {
            self.tree.normalize(x);
        }
        visited.clear();
        parents.clear();
        self.scratch.nodes = visited;
        self.scratch.stack = stack;
        self.scratch.parents = parents;
        dropped
    }

    // ---- match ------------------------------------------------------------------------------

    /// Per worker, the number of leading blocks of `query` it holds, written to `out` (cleared
    /// first) as `(worker id, blocks)`; workers with 0 are omitted.
    pub fn match_into(&self, query: &[u64], out: &mut Vec<(WorkerId, u32)>) {
        out.clear();
        let tick = self.max_bytes.map(|_| self.next_tick());
        let depth_u32 = |d: usize| u32::try_from(d).unwrap_or(u32::MAX);
        let mut node = ROOT;
        let mut depth = 0usize;
        loop {
            let next = query
                .get(depth)
                .and_then(|&h| self.tree.child_starting_with(node, h));
            let Some(child) = next else {
                if node != ROOT {
                    let d = depth_u32(depth);
                    out.extend(self.tree.node(node).workers.iter().map(|w| (w, d)));
                }
                return;
            };
            let c = self.tree.node(child);
            if node != ROOT {
                let d = depth_u32(depth);
                let n = self.tree.node(node);
                out.extend(n.workers.iter_minus(&c.workers).map(|w| (w, d)));
            }
            if let Some(t) = tick {
                c.last_used.fetch_max(t, Ordering::Relaxed);
            }
            let k = tree::common_prefix(&c.hashes, query.get(depth..).unwrap_or_default());
            depth += k;
            if k < c.hashes.len() {
                let d = depth_u32(depth);
                out.extend(c.workers.iter().map(|w| (w, d)));
                return;
            }
            node = child;
        }
    }

    /// [`Self::match_into`] with worker names, in a new vector.
    pub fn match_names(&self, query: &[u64]) -> Vec<(Arc<str>, u32)> {
        let mut ids = Vec::new();
        self.match_into(query, &mut ids);
        ids.into_iter()
            .filter_map(|(w, n)| self.worker_name_arc(w).map(|name| (name, n)))
            .collect()
    }

    // ---- bulk -------------------------------------------------------------------------------

    /// Applies `ops` in order. Each op is atomic; a failing op is skipped and reported as
    /// `(position, error)` without stopping the others.
    pub fn apply<'a>(&mut self, ops: impl IntoIterator<Item = IndexOp<'a>>) -> Vec<(usize, Error)> {
        let mut errors = Vec::new();
        for (i, op) in ops.into_iter().enumerate() {
            let out = match op {
                IndexOp::Store {
                    worker,
                    hashes,
                    parent,
                } => self.store_id(worker, hashes, parent),
                IndexOp::Remove { worker, hashes } => self.remove_id(worker, hashes).map(drop),
                IndexOp::Clear { worker } => self.clear_id(worker).map(drop),
            };
            if let Err(e) = out {
                errors.push((i, e));
            }
        }
        errors
    }

    /// Checks the structure's invariants and the per-worker block counts (for tests).
    #[doc(hidden)]
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.tree.check()?;
        let mut counts = vec![0u64; self.workers.names.len()];
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            if id != ROOT {
                let n = self.tree.node(id);
                for w in n.workers.iter() {
                    if self.workers.name(w).is_none() {
                        return Err(format!("node {id} holds unregistered worker {w}"));
                    }
                    if let Some(c) = counts.get_mut(w as usize) {
                        *c += n.hashes.len() as u64;
                    }
                }
            }
            stack.extend(self.tree.children(id));
        }
        if counts != self.workers.blocks {
            return Err(format!(
                "block counts {:?} != {:?}",
                self.workers.blocks, counts
            ));
        }
        if let Some(max) = self.max_bytes {
            if self.memory_bytes() > max {
                return Err(format!("memory {} > budget {max}", self.memory_bytes()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
/// Tests for the survivors of the never-run even shards 22/40-38/40 (`tests_shards_even.rs`).
#[cfg(test)]
mod tests_shards_even;
/// Tests for the survivors of the never-run odd shards 23/40-39/40 (`tests_shards_odd.rs`).
#[cfg(test)]
mod tests_shards_odd;
