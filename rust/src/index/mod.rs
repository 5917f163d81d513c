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

mod codec;
mod tree;
mod worker_set;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hashbrown::HashMap;

use crate::error::{Error, Result};
use crate::{key_err, value_err};
use tree::{Tree, ROOT};
use worker_set::WorkerSet;

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

/// Name ↔ id table of the workers, with each worker's block count.
#[derive(Default)]
struct Workers {
    names: Vec<Option<Arc<str>>>,
    ids: HashMap<Arc<str>, WorkerId>,
    blocks: Vec<u64>,
    free: Vec<WorkerId>,
}

impl Workers {
    fn name(&self, id: WorkerId) -> Option<&Arc<str>> {
        self.names.get(id as usize).and_then(Option::as_ref)
    }

    fn insert(&mut self, name: &str) -> WorkerId {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let name: Arc<str> = Arc::from(name);
        let id = match self.free.pop() {
            Some(id) => {
                if let Some(slot) = self.names.get_mut(id as usize) {
                    *slot = Some(name.clone());
                }
                if let Some(count) = self.blocks.get_mut(id as usize) {
                    *count = 0;
                }
                id
            }
            None => {
                self.names.push(Some(name.clone()));
                self.blocks.push(0);
                (self.names.len() - 1) as WorkerId
            }
        };
        self.ids.insert(name, id);
        id
    }

    fn remove(&mut self, id: WorkerId) {
        if let Some(name) = self.names.get_mut(id as usize).and_then(Option::take) {
            self.ids.remove(&name);
            self.free.push(id);
        }
    }

    fn add_blocks(&mut self, id: WorkerId, delta: usize) {
        if let Some(c) = self.blocks.get_mut(id as usize) {
            *c += delta as u64;
        }
    }

    fn sub_blocks(&mut self, id: WorkerId, delta: usize) {
        if let Some(c) = self.blocks.get_mut(id as usize) {
            *c = c.saturating_sub(delta as u64);
        }
    }

    fn heap_bytes(&self) -> usize {
        let names: usize = self
            .names
            .iter()
            .flatten()
            .map(|n| n.len() + 16 + ALLOC_OVERHEAD)
            .sum();
        names
            + self.names.capacity() * std::mem::size_of::<Option<Arc<str>>>()
            + self.ids.allocation_size()
            + self.blocks.capacity() * 8
            + self.free.capacity() * 4
    }

    fn shrink(&mut self) {
        self.names.shrink_to_fit();
        self.ids.shrink_to_fit();
        self.blocks.shrink_to_fit();
        self.free.shrink_to_fit();
    }
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

    /// Keeps the budget after a mutation: evicts after a success; after a failure (no state
    /// changed, but allocations may have grown) only compacts.
    fn after_mutation(&mut self, succeeded: bool) {
        if succeeded {
            self.enforce_budget();
        } else if self.max_bytes.is_some_and(|max| self.memory_bytes() > max) {
            self.compact();
        }
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

    // ---- budget -----------------------------------------------------------------------------

    /// Evicts least recently used leaves until the index fits in 15/16 of the budget.
    fn enforce_budget(&mut self) {
        let Some(max) = self.max_bytes else { return };
        if self.memory_bytes() <= max {
            return;
        }
        let target = max - max / 16;
        while self.memory_bytes() > max && !self.tree.is_empty_tree() {
            self.evict_until(target);
            self.compact();
        }
    }

    /// Bytes the index would take after [`Self::compact`].
    fn compacted_bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.workers.heap_bytes() + self.tree.compacted_bytes()
    }

    fn evict_until(&mut self, target: usize) {
        // Every node, oldest first; among equals deepest first, so children go before parents
        // (a parent is never older than its children).
        let mut order: Vec<(u64, u32, u32)> = Vec::with_capacity(self.tree.live_nodes);
        let mut stack = vec![(ROOT, 0u32)];
        while let Some((id, depth)) = stack.pop() {
            for c in self.tree.children(id) {
                order.push((self.tree.node(c).tick(), u32::MAX - depth, c));
                stack.push((c, depth + 1));
            }
        }
        order.sort_unstable();
        let mut parents = Vec::new();
        for (_, _, id) in order {
            if self.compacted_bytes() <= target {
                break;
            }
            if self.tree.node(id).num_children > 0 {
                continue;
            }
            let len = self.tree.node(id).hashes.len();
            let holders: Vec<WorkerId> = self.tree.node(id).workers.iter().collect();
            for w in holders {
                self.workers.sub_blocks(w, len);
            }
            parents.push(self.tree.node(id).parent);
            self.tree.delete_leaf(id);
        }
        for p in parents {
            self.tree.normalize(p);
        }
    }

    /// Rebuilds the tree into exactly sized allocations.
    fn compact(&mut self) {
        self.tree = self.tree.rebuilt();
        self.workers.shrink();
        self.scratch = Scratch::default();
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
mod tests {
    //! Hand-written cases and a randomized comparison with a naive model.

    use std::collections::{HashMap, HashSet};

    use super::*;

    fn m(index: &PrefixIndex, q: &[u64]) -> Vec<(String, u32)> {
        let mut out: Vec<(String, u32)> = index
            .match_names(q)
            .into_iter()
            .map(|(n, c)| (n.to_string(), c))
            .collect();
        out.sort();
        out
    }

    fn pairs(v: &[(&str, u32)]) -> Vec<(String, u32)> {
        let mut out: Vec<(String, u32)> = v.iter().map(|(n, c)| (n.to_string(), *c)).collect();
        out.sort();
        out
    }

    #[test]
    fn store_match_split_merge() {
        let mut ix = PrefixIndex::new(None).unwrap();
        ix.store("a", &[1, 2, 3, 4], None).unwrap();
        assert_eq!(ix.num_nodes(), 1);
        ix.store("b", &[1, 2], None).unwrap();
        assert_eq!(ix.num_nodes(), 2);
        ix.store("b", &[5, 6], Some(2)).unwrap();
        assert_eq!(ix.num_nodes(), 3);
        assert_eq!(m(&ix, &[1, 2, 3, 4]), pairs(&[("a", 4), ("b", 2)]));
        assert_eq!(m(&ix, &[1, 2, 5, 6, 7]), pairs(&[("a", 2), ("b", 4)]));
        assert_eq!(m(&ix, &[1, 9]), pairs(&[("a", 1), ("b", 1)]));
        assert_eq!(m(&ix, &[2]), pairs(&[]));
        assert_eq!(ix.len(), 6);
        assert_eq!(ix.num_blocks("b").unwrap(), 4);
        // Dropping b's branch makes the split at 2 unnecessary: back to one node.
        assert_eq!(ix.remove("b", &[5]).unwrap(), 2);
        assert_eq!(ix.num_nodes(), 2);
        assert_eq!(ix.remove("b", &[1]).unwrap(), 2);
        assert_eq!(ix.num_nodes(), 1);
        ix.check_invariants().unwrap();
        assert_eq!(m(&ix, &[1, 2, 3, 4]), pairs(&[("a", 4)]));
    }

    #[test]
    fn remove_middle_drops_descendants() {
        let mut ix = PrefixIndex::new(None).unwrap();
        ix.store("a", &[1, 2, 3, 4], None).unwrap();
        ix.store("b", &[1, 2, 3, 4], None).unwrap();
        assert_eq!(ix.remove("a", &[3, 99]).unwrap(), 2);
        assert_eq!(ix.num_blocks("a").unwrap(), 2);
        assert_eq!(m(&ix, &[1, 2, 3, 4]), pairs(&[("a", 2), ("b", 4)]));
        assert_eq!(ix.remove("a", &[3]).unwrap(), 0);
        ix.store("a", &[3], Some(2)).unwrap();
        assert_eq!(m(&ix, &[1, 2, 3, 4]), pairs(&[("a", 3), ("b", 4)]));
        ix.check_invariants().unwrap();
    }

    #[test]
    fn batched_removal_cuts_once_per_node() {
        let mut ix = PrefixIndex::new(None).unwrap();
        let chain: Vec<u64> = (1..=10).collect();
        ix.store("a", &chain, None).unwrap();
        ix.store("b", &chain[..6], None).unwrap();
        ix.store("a", &[20, 21], Some(4)).unwrap();
        assert_eq!(ix.num_nodes(), 4);
        // vLLM order: a's tail 10, 9, 8, 7 one block each, then a block of the branch, an
        // unknown block and a repeat.
        assert_eq!(ix.remove("a", &[10, 9, 8, 7, 21, 99, 9]).unwrap(), 5);
        assert_eq!(ix.num_blocks("a").unwrap(), 7);
        assert_eq!(m(&ix, &[1, 2, 3, 4, 5, 6, 7]), pairs(&[("a", 6), ("b", 6)]));
        assert_eq!(m(&ix, &[1, 2, 3, 4, 20, 21]), pairs(&[("a", 5), ("b", 4)]));
        ix.check_invariants().unwrap();
        // Shared run: b drops its tail block by block; a keeps it; the runs merge back.
        assert_eq!(ix.remove("b", &[6, 5]).unwrap(), 2);
        assert_eq!(m(&ix, &[1, 2, 3, 4, 5, 6]), pairs(&[("a", 6), ("b", 4)]));
        ix.check_invariants().unwrap();
        // A block and its ancestor in one batch, descendant first.
        assert_eq!(ix.remove("a", &[20, 3]).unwrap(), 5);
        assert_eq!(m(&ix, &[1, 2, 3]), pairs(&[("a", 2), ("b", 3)]));
        ix.check_invariants().unwrap();
        // Continuing a chain the worker alone holds extends its leaf in place; a conflicting
        // continuation changes nothing.
        ix.store("a", &[30, 31], Some(2)).unwrap();
        let before = ix.dump();
        assert!(matches!(
            ix.store("a", &[32, 3], Some(31)),
            Err(Error::Value(_))
        ));
        assert!(matches!(
            ix.store("a", &[32, 33, 32], Some(31)),
            Err(Error::Value(_))
        ));
        assert_eq!(ix.dump(), before);
        ix.store("a", &[32], Some(31)).unwrap();
        assert_eq!(m(&ix, &[1, 2, 30, 31, 32]), pairs(&[("a", 5), ("b", 2)]));
        ix.check_invariants().unwrap();
    }

    #[test]
    fn bad_input_changes_nothing() {
        let mut ix = PrefixIndex::new(None).unwrap();
        ix.store("a", &[1, 2, 3], None).unwrap();
        let before = ix.dump();
        assert!(matches!(ix.store("a", &[7], Some(99)), Err(Error::Key(_))));
        assert!(matches!(ix.store("b", &[7], Some(1)), Err(Error::Key(_))));
        assert!(matches!(ix.store("a", &[2], None), Err(Error::Value(_))));
        assert!(matches!(
            ix.store("a", &[5, 6, 5], None),
            Err(Error::Value(_))
        ));
        assert!(matches!(
            ix.store("a", &[1, 2, 3, 8, 1], None),
            Err(Error::Value(_))
        ));
        assert!(matches!(ix.store("c", &[1, 3], None), Err(Error::Value(_))));
        assert!(matches!(ix.remove("zz", &[1]), Err(Error::Key(_))));
        assert_eq!(ix.dump(), before);
        assert_eq!(ix.workers().len(), 1);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn many_workers_spill() {
        let mut ix = PrefixIndex::new(None).unwrap();
        for w in 0..200u64 {
            let chain: Vec<u64> = (0..=w % 7).map(|i| 1000 + i).collect();
            ix.store(&format!("w{w}"), &chain, None).unwrap();
        }
        ix.check_invariants().unwrap();
        let got = m(&ix, &[1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007]);
        assert_eq!(got.len(), 200);
        for (name, count) in got {
            let w: u64 = name[1..].parse().unwrap();
            assert_eq!(u64::from(count), w % 7 + 1);
        }
        for w in 0..200 {
            ix.remove_worker(&format!("w{w}")).unwrap();
            ix.check_invariants().unwrap();
        }
        assert_eq!(ix.num_nodes(), 0);
        assert!(ix.is_empty());
    }

    /// Naive model: global parent links plus per-worker block sets.
    #[derive(Default, Clone)]
    struct Model {
        parent: HashMap<u64, Option<u64>>,
        held: HashMap<String, HashSet<u64>>,
    }

    impl Model {
        fn holders(&self, b: u64) -> Vec<&str> {
            let mut v: Vec<&str> = self
                .held
                .iter()
                .filter(|(_, s)| s.contains(&b))
                .map(|(n, _)| n.as_str())
                .collect();
            v.sort();
            v
        }

        fn prune(&mut self) {
            let live: HashSet<u64> = self.held.values().flatten().copied().collect();
            self.parent.retain(|b, _| live.contains(b));
        }

        fn store(
            &mut self,
            w: &str,
            chain: &[u64],
            parent: Option<u64>,
        ) -> std::result::Result<(), char> {
            if let Some(p) = parent {
                if !self.held.get(w).is_some_and(|s| s.contains(&p)) {
                    return Err('K');
                }
            }
            let mut prev = parent;
            let mut seen = HashSet::new();
            for &b in chain {
                if !seen.insert(b) || self.parent.get(&b).is_some_and(|&p| p != prev) {
                    return Err('V');
                }
                prev = Some(b);
            }
            let mut prev = parent;
            let set = self.held.entry(w.to_string()).or_default();
            for &b in chain {
                self.parent.insert(b, prev);
                set.insert(b);
                prev = Some(b);
            }
            Ok(())
        }

        fn remove(&mut self, w: &str, blocks: &[u64]) -> u64 {
            let mut dropped = 0;
            for &b in blocks {
                let Some(set) = self.held.get(w) else {
                    return 0;
                };
                if !set.contains(&b) {
                    continue;
                }
                let gone: Vec<u64> = set
                    .iter()
                    .copied()
                    .filter(|&x| {
                        let mut y = Some(x);
                        while let Some(z) = y {
                            if z == b {
                                return true;
                            }
                            y = self.parent.get(&z).copied().flatten();
                        }
                        false
                    })
                    .collect();
                let set = self.held.get_mut(w).unwrap();
                for x in gone {
                    set.remove(&x);
                    dropped += 1;
                }
            }
            self.prune();
            dropped
        }

        fn matches(&self, q: &[u64]) -> Vec<(String, u32)> {
            let mut out = Vec::new();
            for (w, set) in &self.held {
                let mut prev = None;
                let mut n = 0;
                for &b in q {
                    if !set.contains(&b) || self.parent.get(&b) != Some(&prev) {
                        break;
                    }
                    prev = Some(b);
                    n += 1;
                }
                if n > 0 {
                    out.push((w.clone(), n));
                }
            }
            out.sort();
            out
        }

        fn canonical_nodes(&self) -> usize {
            let mut children: HashMap<Option<u64>, usize> = HashMap::new();
            for p in self.parent.values() {
                *children.entry(*p).or_default() += 1;
            }
            self.parent
                .iter()
                .filter(|(b, p)| match p {
                    None => true,
                    Some(p) => children[&Some(*p)] > 1 || self.holders(**b) != self.holders(*p),
                })
                .count()
        }
    }

    /// xorshift64*: a small deterministic generator for the randomized tests.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    fn random_ops(seed: u64, steps: usize, workers: u64, budget: Option<usize>) {
        let mut rng = Rng(seed);
        let mut ix = PrefixIndex::new(budget).unwrap();
        let mut model = Model::default();
        // Sequences: a few shared "system prompts", then private continuations.
        let mut chains: Vec<Vec<u64>> = Vec::new();
        let mut fresh = 1u64;
        for step in 0..steps {
            let w = format!("w{}", rng.below(workers));
            match rng.below(10) {
                0..=4 => {
                    // Extend a known chain (or start a new one) by some blocks.
                    let (base, parent) = if !chains.is_empty() && rng.below(4) > 0 {
                        let c = chains[rng.below(chains.len() as u64) as usize].clone();
                        let cut = rng.below(c.len() as u64 + 1) as usize;
                        (
                            c[..cut].to_vec(),
                            if cut > 0 { Some(c[cut - 1]) } else { None },
                        )
                    } else {
                        (Vec::new(), None)
                    };
                    let mut chain = base.clone();
                    for _ in 0..rng.below(12) {
                        chain.push(fresh * 7919);
                        fresh += 1;
                    }
                    // Store either the whole chain from the root or just the tail after `parent`.
                    let (hashes, par) = if rng.below(2) == 0 {
                        (chain.clone(), None)
                    } else {
                        (chain[base.len()..].to_vec(), parent)
                    };
                    let want = model.store(&w, &hashes, par);
                    let got = ix.store(&w, &hashes, par);
                    match (&want, &got) {
                        (Ok(()), Ok(())) => {}
                        (Err('K'), Err(Error::Key(_))) | (Err('V'), Err(Error::Value(_))) => {}
                        _ if budget.is_some() && got.is_err() => {}
                        _ => panic!("step {step}: store {hashes:?} {par:?}: {want:?} vs {got:?}"),
                    }
                    if budget.is_some() && got.is_err() && want.is_ok() {
                        // Evicted parent: the model stays a superset of the index.
                    }
                    chains.push(chain);
                }
                5 | 6 => {
                    // One block; or a batch: a chain's tail, last block first (as vLLM reports
                    // evictions, one event per block), and blocks of other chains.
                    let mut blocks = Vec::new();
                    for part in 0..=rng.below(3) {
                        let pick = rng.below(chains.len().max(1) as u64) as usize;
                        if let Some(c) = chains.get(pick).filter(|c| !c.is_empty()) {
                            let at = rng.below(c.len() as u64) as usize;
                            if part == 0 && rng.below(2) == 0 {
                                blocks.extend(c[at..].iter().rev());
                            } else {
                                blocks.push(c[at]);
                            }
                        }
                    }
                    if !blocks.is_empty() {
                        let before = model.clone();
                        let want = model.remove(&w, &blocks);
                        let mut listed = Vec::new();
                        let id = ix.worker_id(&w);
                        let got = id.map(|id| ix.remove_id_into(id, &blocks, &mut listed));
                        if let (Some(Ok(got)), None) = (got, budget) {
                            assert_eq!(got, want, "step {step}: remove {blocks:?}");
                            // The listed blocks are exactly the dropped ones, each after all
                            // of its descendants.
                            let held = |m: &Model| m.held.get(&w).cloned().unwrap_or_default();
                            let gone: HashSet<u64> =
                                held(&before).difference(&held(&model)).copied().collect();
                            assert_eq!(listed.len() as u64, got, "step {step}");
                            assert_eq!(listed.iter().copied().collect::<HashSet<_>>(), gone);
                            for (i, &b) in listed.iter().enumerate() {
                                let mut up = before.parent.get(&b).copied().flatten();
                                while let Some(a) = up {
                                    if let Some(j) = listed.iter().position(|&x| x == a) {
                                        assert!(j > i, "step {step}: {a} listed before {b}");
                                    }
                                    up = before.parent.get(&a).copied().flatten();
                                }
                            }
                        }
                    }
                }
                7 => {
                    if rng.below(3) == 0 {
                        model.held.remove(&w);
                        model.prune();
                        let _ = ix.remove_worker(&w);
                    } else {
                        if let Some(s) = model.held.get_mut(&w) {
                            s.clear();
                        }
                        model.prune();
                        let _ = ix.clear(&w);
                    }
                }
                _ => {}
            }
            ix.check_invariants()
                .unwrap_or_else(|e| panic!("step {step}: {e}"));
            for c in chains.iter().rev().take(3) {
                let want = model.matches(c);
                let got = m(&ix, c);
                if budget.is_none() {
                    assert_eq!(got, want, "step {step}: match {c:?}");
                } else {
                    let want: HashMap<String, u32> = want.into_iter().collect();
                    for (w, n) in got {
                        assert!(
                            n <= want.get(&w).copied().unwrap_or(0),
                            "step {step}: unsound"
                        );
                    }
                }
            }
            if budget.is_none() {
                assert_eq!(ix.num_nodes(), model.canonical_nodes(), "step {step}");
                assert_eq!(ix.len(), model.parent.len(), "step {step}");
                if step % 50 == 0 {
                    let copy = PrefixIndex::load(&ix.dump(), None).unwrap();
                    copy.check_invariants().unwrap();
                    assert_eq!(copy.dump().len(), ix.dump().len());
                    for c in chains.iter().rev().take(5) {
                        assert_eq!(m(&copy, c), m(&ix, c));
                    }
                }
            }
        }
    }

    #[test]
    fn random_against_model() {
        for seed in 1..=20 {
            random_ops(seed * 0x9E37_79B9, 400, 5, None);
        }
        random_ops(77, 300, 100, None);
    }

    #[test]
    fn random_with_budget_is_sound() {
        for seed in 1..=10 {
            random_ops(
                seed * 31 + 7,
                400,
                6,
                Some(PrefixIndex::min_budget() + 6000),
            );
        }
    }

    #[test]
    fn budget_holds_and_evicts_lru_first() {
        let budget = 200_000;
        let mut ix = PrefixIndex::new(Some(budget)).unwrap();
        for s in 0..200u64 {
            let chain: Vec<u64> = (0..100).map(|i| (s << 32) | (i + 1)).collect();
            ix.store(&format!("w{}", s % 4), &chain, None).unwrap();
            assert!(ix.memory_bytes() <= budget);
            // Keep sequence 0 hot.
            let hot: Vec<u64> = (0..100).map(|i| i + 1).collect();
            let _ = ix.match_names(&hot);
            ix.check_invariants().unwrap();
        }
        let hot: Vec<u64> = (0..100).map(|i| i + 1).collect();
        assert_eq!(m(&ix, &hot), pairs(&[("w0", 100)]));
        assert!(ix.len() < 200 * 100);
        assert!(PrefixIndex::new(Some(10)).is_err());
    }

    #[test]
    fn load_rejects_garbage_without_panicking() {
        let mut ix = PrefixIndex::new(None).unwrap();
        ix.store("a", &[1, 2, 3], None).unwrap();
        ix.store("b", &[1, 2, 9], None).unwrap();
        let image = ix.dump();
        let copy = PrefixIndex::load(&image, None).unwrap();
        assert_eq!(copy.dump(), image);
        let mut rng = Rng(5);
        for _ in 0..2000 {
            let mut bad = image.clone();
            match rng.below(3) {
                0 => bad.truncate(rng.below(image.len() as u64) as usize),
                1 => {
                    let i = rng.below(bad.len() as u64) as usize;
                    bad[i] ^= 1 << rng.below(8);
                }
                _ => {
                    // Corrupt the body and fix the checksum, so structural validation must catch it.
                    let body = bad.len() - 8;
                    let i = rng.below(body as u64) as usize;
                    bad[i] = rng.next() as u8;
                    let sum = xxhash_rust::xxh3::xxh3_64(&bad[..body]).to_le_bytes();
                    bad[body..].copy_from_slice(&sum);
                }
            }
            if let Ok(loaded) = PrefixIndex::load(&bad, None) {
                loaded.check_invariants().unwrap();
            }
        }
    }

    #[test]
    fn remove_into_lists_descendants_first() {
        let mut ix = PrefixIndex::new(None).unwrap();
        ix.store("a", &[1, 2, 3, 4], None).unwrap();
        ix.store("a", &[5, 6], Some(2)).unwrap();
        ix.store("b", &[1, 2, 3], None).unwrap();
        let a = ix.worker_id("a").unwrap();
        let mut dropped = Vec::new();
        assert_eq!(ix.remove_id_into(a, &[2, 77], &mut dropped).unwrap(), 5);
        let pos = |h: u64| dropped.iter().position(|&x| x == h).unwrap();
        let mut sorted = dropped.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![2, 3, 4, 5, 6]);
        assert!(pos(4) < pos(3) && pos(3) < pos(2));
        assert!(pos(6) < pos(5) && pos(5) < pos(2));
        assert_eq!(m(&ix, &[1, 2, 3]), pairs(&[("a", 1), ("b", 3)]));
        ix.check_invariants().unwrap();
    }
}
