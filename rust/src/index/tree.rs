//! The path-compressed block tree and its hash → position table.
//!
//! Invariants (checked by [`Tree::check`]):
//! - node [`ROOT`] has an empty run and stands for "before the first block"; every other live
//!   node has a non-empty run of block hashes (a free slab slot has an empty run);
//! - the blocks of a run form a chain: each block's only child is the next block of the run;
//! - every live node's worker set is non-empty and a subset of its parent's (root excepted);
//! - canonical form: no node has exactly one child with an equal worker set (they are merged);
//! - the table holds exactly one entry per stored block, `pack(node, pos)` with
//!   `pos - node.base` (wrapping) its offset in the node's run;
//! - `heap_bytes` equals the heap bytes of every live node's run and spilled worker set;
//! - `last_used` of a node is ≥ that of each of its children (recency flows up the path).

use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

use super::worker_set::WorkerSet;
use super::ALLOC_OVERHEAD;

/// The id of the root node.
pub(crate) const ROOT: u32 = 0;
/// "No node" in links.
pub(crate) const NIL: u32 = u32::MAX;

pub(crate) struct Node {
    /// The run of block hashes, in chain order.
    pub hashes: Vec<u64>,
    /// Table positions of this node's blocks are `base + offset` (wrapping), so a split or merge
    /// re-points only the blocks that change node.
    pub base: u32,
    pub parent: u32,
    pub first_child: u32,
    pub next_sibling: u32,
    pub prev_sibling: u32,
    pub num_children: u32,
    pub workers: WorkerSet,
    /// Logical time of the last store or match that went through this node.
    pub last_used: AtomicU64,
}

impl Node {
    fn new(hashes: Vec<u64>, workers: WorkerSet, tick: u64) -> Self {
        Node {
            hashes,
            base: 0,
            parent: NIL,
            first_child: NIL,
            next_sibling: NIL,
            prev_sibling: NIL,
            num_children: 0,
            workers,
            last_used: AtomicU64::new(tick),
        }
    }

    pub fn tick(&self) -> u64 {
        self.last_used.load(Ordering::Relaxed)
    }

    /// Heap bytes owned by the node (run + spilled worker set).
    fn heap_bytes(&self) -> usize {
        let run = if self.hashes.capacity() > 0 {
            self.hashes.capacity() * 8 + ALLOC_OVERHEAD
        } else {
            0
        };
        run + self.workers.heap_bytes()
    }
}

/// The hash of block `h` in the block table and the table of run starts: a multiply-fold that
/// spreads any set of block hashes (sequential, strided, random) over both parts of the hash
/// hashbrown uses — the low bits (the bucket) and the top 7 (the tag compared before the key) —
/// so that a lookup probes O(1) entries whatever the hashes look like.
#[inline]
pub(super) fn mix(h: u64) -> u64 {
    let p = u128::from(h) * 0x9E37_79B9_7F4A_7C15_u128;
    (p as u64) ^ ((p >> 64) as u64)
}

#[inline]
fn pack(node: u32, pos: u32) -> u64 {
    (u64::from(node) << 32) | u64::from(pos)
}

#[inline]
fn unpack(entry: u64) -> (u32, u32) {
    ((entry >> 32) as u32, entry as u32)
}

/// The block hash a table entry points at (0 for a dangling entry, which the invariants exclude).
#[inline]
fn key_at(nodes: &[Node], entry: u64) -> u64 {
    let (node, pos) = unpack(entry);
    nodes
        .get(node as usize)
        .and_then(|n| n.hashes.get(pos.wrapping_sub(n.base) as usize))
        .copied()
        .unwrap_or(0)
}

/// Allocation size of a `HashTable` of `entry`-byte values built with capacity `n` (hashbrown's
/// sizing rule: buckets = next power of two of 8n/7, at least 4; the value plus 1 control byte
/// per bucket, plus one SIMD group of control bytes).
fn table_bytes_for(n: usize, entry: usize) -> usize {
    if n == 0 {
        return 0;
    }
    let buckets = match n {
        0..4 => 4,
        4..8 => 8,
        _ => (n * 8 / 7).next_power_of_two(),
    };
    buckets * (entry + 1) + 16
}

/// Length of the common prefix of two runs, compared eight hashes at a time.
#[inline]
pub(crate) fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        if ca != cb {
            break;
        }
        i += 8;
    }
    i + a[i..]
        .iter()
        .zip(&b[i..])
        .take_while(|(x, y)| x == y)
        .count()
}

pub(crate) struct Tree {
    pub nodes: Vec<Node>,
    pub(super) free: Vec<u32>,
    table: HashTable<u64>,
    /// First block of every live node → node: a small table (one entry per node, key inline)
    /// that `match` and `store` use to step from a node to its child without touching the
    /// block table.
    starts: HashTable<(u64, u32)>,
    /// Heap bytes of all live nodes' runs and spilled worker sets.
    pub heap_bytes: usize,
    /// Number of live non-root nodes.
    pub live_nodes: usize,
}

impl Tree {
    pub fn new() -> Self {
        Self::with_capacity(1, 0)
    }

    pub fn with_capacity(nodes: usize, blocks: usize) -> Self {
        let mut v = Vec::with_capacity(nodes.max(1));
        v.push(Node::new(Vec::new(), WorkerSet::default(), 0));
        Tree {
            nodes: v,
            free: Vec::new(),
            table: HashTable::with_capacity(blocks),
            starts: HashTable::with_capacity(nodes.saturating_sub(1)),
            heap_bytes: 0,
            live_nodes: 0,
        }
    }

    /// Number of stored (distinct) blocks.
    pub fn num_blocks(&self) -> usize {
        self.table.len()
    }

    /// Heap bytes of the tree: node slab, runs, worker sets, block table, run starts, free list.
    pub fn memory_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.heap_bytes
            + self.table.allocation_size()
            + self.starts.allocation_size()
            + self.free.capacity() * 4
    }

    pub fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }

    fn node_mut(&mut self, id: u32) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    pub fn is_live(&self, id: u32) -> bool {
        id == ROOT
            || self
                .nodes
                .get(id as usize)
                .is_some_and(|n| !n.hashes.is_empty())
    }

    /// Runs `f` on node `id`, keeping `heap_bytes` in step with its allocations.
    fn edit<R>(&mut self, id: u32, f: impl FnOnce(&mut Node) -> R) -> R {
        let node = &mut self.nodes[id as usize];
        let before = node.heap_bytes();
        let out = f(node);
        let after = node.heap_bytes();
        self.heap_bytes = self.heap_bytes + after - before;
        out
    }

    /// Where block `h` is stored: `(node, offset in its run)`.
    #[inline]
    pub fn find(&self, h: u64) -> Option<(u32, usize)> {
        let nodes = &self.nodes;
        self.table
            .find(mix(h), |&e| key_at(nodes, e) == h)
            .map(|&e| {
                let (node, pos) = unpack(e);
                let base = nodes.get(node as usize).map_or(0, |n| n.base);
                (node, pos.wrapping_sub(base) as usize)
            })
    }

    /// The child of `parent` whose run starts with `h`.
    #[inline]
    pub fn child_starting_with(&self, parent: u32, h: u64) -> Option<u32> {
        let &(_, c) = self.starts.find(mix(h), |e| e.0 == h)?;
        (self.node(c).parent == parent).then_some(c)
    }

    /// Records that node `id`'s run starts with block `h`.
    pub fn set_start(&mut self, h: u64, id: u32) {
        match self.starts.entry(mix(h), |e| e.0 == h, |e| mix(e.0)) {
            Entry::Occupied(mut e) => e.get_mut().1 = id,
            Entry::Vacant(v) => {
                v.insert((h, id));
            }
        }
    }

    /// Forgets that node `id`'s run starts with block `h`.
    fn clear_start(&mut self, h: u64, id: u32) {
        if let Ok(e) = self.starts.find_entry(mix(h), |e| *e == (h, id)) {
            e.remove();
        }
    }

    /// The first block of node `id` (0 for the root).
    fn start_of(&self, id: u32) -> u64 {
        self.node(id).hashes.first().copied().unwrap_or(0)
    }

    // ---- slab -------------------------------------------------------------------------------

    /// A new, unlinked node.
    pub fn alloc(&mut self, hashes: Vec<u64>, workers: WorkerSet, tick: u64) -> u32 {
        let node = Node::new(hashes, workers, tick);
        self.heap_bytes += node.heap_bytes();
        self.live_nodes += 1;
        match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Returns an unlinked node's slot to the free list (its table entries must be gone).
    fn release(&mut self, id: u32) {
        let node = std::mem::replace(
            &mut self.nodes[id as usize],
            Node::new(Vec::new(), WorkerSet::default(), 0),
        );
        self.heap_bytes -= node.heap_bytes();
        self.live_nodes -= 1;
        self.free.push(id);
    }

    // ---- table ------------------------------------------------------------------------------

    /// Adds table entries for every block of node `id`'s run. If a block is already stored
    /// (elsewhere, or twice in this run), removes the entries it added and returns that hash.
    pub fn insert_entries(&mut self, id: u32) -> Result<(), u64> {
        self.insert_entries_from(id, 0)
    }

    /// Adds table entries for the blocks of node `id`'s run from offset `start` on; on a block
    /// already stored, removes the entries it added and returns that hash.
    fn insert_entries_from(&mut self, id: u32, start: usize) -> Result<(), u64> {
        let conflict = {
            let Tree { nodes, table, .. } = self;
            let (base, run) = nodes.get(id as usize).map_or((0, &[][..]), |n| {
                (n.base, n.hashes.get(start..).unwrap_or_default())
            });
            let mut conflict = None;
            for (j, &h) in (start..).zip(run) {
                match table.entry(
                    mix(h),
                    |&e| key_at(nodes, e) == h,
                    |&e| mix(key_at(nodes, e)),
                ) {
                    Entry::Occupied(_) => {
                        conflict = Some((j, h));
                        break;
                    }
                    Entry::Vacant(v) => {
                        v.insert(pack(id, base.wrapping_add(j as u32)));
                    }
                }
            }
            conflict
        };
        match conflict {
            Some((j, h)) => {
                self.remove_entries(id, start..j);
                Err(h)
            }
            None => Ok(()),
        }
    }

    /// Appends `new` to the run of node `id` and adds their table entries. On a block already
    /// stored (elsewhere, or twice), undoes both and returns that hash. The run grows by at least
    /// an eighth of its length, so repeated appends cost amortised O(1) copies per block with
    /// little slack.
    pub fn extend_run(&mut self, id: u32, new: &[u64]) -> Result<(), u64> {
        let old = self.node(id).hashes.len();
        let capacity = self.node(id).hashes.capacity();
        self.edit(id, |n| {
            if n.hashes.capacity() - old < new.len() {
                n.hashes.reserve_exact(new.len().max(old / 8));
            }
            n.hashes.extend_from_slice(new);
        });
        let out = self.insert_entries_from(id, old);
        if out.is_err() {
            self.edit(id, |n| {
                n.hashes.truncate(old);
                n.hashes.shrink_to(capacity);
            });
        }
        out
    }

    /// Cuts the run of live node `id` to its first `len` blocks (0 < len), removing the table
    /// entries of the rest. The allocation shrinks only when at most half of it stays in use.
    pub fn truncate(&mut self, id: u32, len: usize) {
        let old = self.node(id).hashes.len();
        if len == 0 || len >= old {
            return;
        }
        self.remove_entries(id, len..old);
        self.edit(id, |n| {
            n.hashes.truncate(len);
            if len * 2 <= n.hashes.capacity() {
                n.hashes.shrink_to_fit();
            }
        });
    }

    /// Removes the table entries of blocks `range` of node `id`'s run.
    fn remove_entries(&mut self, id: u32, range: std::ops::Range<usize>) {
        let node = &self.nodes[id as usize];
        for j in range {
            let Some(&h) = node.hashes.get(j) else { break };
            let target = pack(id, node.base.wrapping_add(j as u32));
            if let Ok(entry) = self.table.find_entry(mix(h), |&e| e == target) {
                entry.remove();
            }
        }
    }

    /// Re-points the entries of blocks `range` of node `to`'s run, which were the blocks at
    /// positions `from_pos, from_pos + 1, …` of node `from`.
    fn repoint(&mut self, to: u32, range: std::ops::Range<usize>, from: u32, from_pos: u32) {
        let Tree { nodes, table, .. } = self;
        let node = &nodes[to as usize];
        let start = range.start;
        for j in range {
            let Some(&h) = node.hashes.get(j) else { break };
            let old = pack(from, from_pos.wrapping_add((j - start) as u32));
            if let Some(e) = table.find_mut(mix(h), |&e| e == old) {
                *e = pack(to, node.base.wrapping_add(j as u32));
            }
        }
    }

    // ---- links ------------------------------------------------------------------------------

    /// Makes unlinked node `child` a child of `parent`.
    pub fn link(&mut self, child: u32, parent: u32) {
        let next = self.node(parent).first_child;
        {
            let c = self.node_mut(child);
            c.parent = parent;
            c.prev_sibling = NIL;
            c.next_sibling = next;
        }
        if next != NIL {
            self.node_mut(next).prev_sibling = child;
        }
        let p = self.node_mut(parent);
        p.first_child = child;
        p.num_children += 1;
    }

    fn unlink(&mut self, child: u32) {
        let (parent, prev, next) = {
            let c = self.node(child);
            (c.parent, c.prev_sibling, c.next_sibling)
        };
        if prev != NIL {
            self.node_mut(prev).next_sibling = next;
        } else if parent != NIL {
            self.node_mut(parent).first_child = next;
        }
        if next != NIL {
            self.node_mut(next).prev_sibling = prev;
        }
        if parent != NIL {
            self.node_mut(parent).num_children -= 1;
        }
        let c = self.node_mut(child);
        c.parent = NIL;
        c.prev_sibling = NIL;
        c.next_sibling = NIL;
    }

    /// Unlinked node `new` takes linked node `old`'s place among its parent's children.
    fn replace(&mut self, old: u32, new: u32) {
        let (parent, prev, next) = {
            let o = self.node(old);
            (o.parent, o.prev_sibling, o.next_sibling)
        };
        {
            let n = self.node_mut(new);
            n.parent = parent;
            n.prev_sibling = prev;
            n.next_sibling = next;
        }
        if prev != NIL {
            self.node_mut(prev).next_sibling = new;
        } else if parent != NIL {
            self.node_mut(parent).first_child = new;
        }
        if next != NIL {
            self.node_mut(next).prev_sibling = new;
        }
        let o = self.node_mut(old);
        o.parent = NIL;
        o.prev_sibling = NIL;
        o.next_sibling = NIL;
    }

    /// Moves all children of `from` to `to` (which has none).
    fn move_children(&mut self, from: u32, to: u32) {
        let (first, count) = {
            let f = self.node_mut(from);
            let out = (f.first_child, f.num_children);
            f.first_child = NIL;
            f.num_children = 0;
            out
        };
        let mut c = first;
        while c != NIL {
            let n = self.node_mut(c);
            n.parent = to;
            c = n.next_sibling;
        }
        let t = self.node_mut(to);
        t.first_child = first;
        t.num_children = count;
    }

    /// The children of `id`.
    pub fn children(&self, id: u32) -> Children<'_> {
        Children {
            tree: self,
            next: self.node(id).first_child,
        }
    }

    // ---- structural edits -------------------------------------------------------------------

    /// Splits live node `id` before offset `k` (0 < k < len); returns `(prefix, suffix)`. The
    /// shorter half moves to a new node, so the cost is the shorter half's table updates.
    pub fn split(&mut self, id: u32, k: usize) -> (u32, u32) {
        let len = self.node(id).hashes.len();
        let (workers, tick, base) = {
            let n = self.node(id);
            (n.workers.clone(), n.tick(), n.base)
        };
        if k <= len - k {
            let prefix = self.edit(id, |n| {
                let prefix: Vec<u64> = n.hashes.drain(..k).collect();
                n.base = n.base.wrapping_add(k as u32);
                prefix
            });
            let m = self.alloc(prefix, workers, tick);
            self.repoint(m, 0..k, id, base);
            self.set_start(self.start_of(m), m);
            self.set_start(self.start_of(id), id);
            self.replace(id, m);
            self.link(id, m);
            (m, id)
        } else {
            let suffix = self.edit(id, |n| {
                let suffix = n.hashes.split_off(k);
                n.hashes.shrink_to_fit();
                suffix
            });
            let m = self.alloc(suffix, workers, tick);
            self.repoint(m, 0..len - k, id, base.wrapping_add(k as u32));
            self.set_start(self.start_of(m), m);
            self.move_children(id, m);
            self.link(m, id);
            (id, m)
        }
    }

    /// Merges `child` (the only child of `parent`, with an equal worker set) into one node;
    /// the longer run stays in place. Returns the surviving id.
    fn merge(&mut self, parent: u32, child: u32) -> u32 {
        let tick = self.node(parent).tick().max(self.node(child).tick());
        let lp = self.node(parent).hashes.len();
        let lc = self.node(child).hashes.len();
        let (pstart, cstart) = (self.start_of(parent), self.start_of(child));
        self.clear_start(cstart, child);
        let survivor = if lp <= lc {
            self.set_start(pstart, child);
            let pbase = self.node(parent).base;
            let prefix = self.edit(parent, |n| std::mem::take(&mut n.hashes));
            self.edit(child, |n| {
                let mut run = Vec::with_capacity(lp + lc);
                run.extend_from_slice(&prefix);
                run.extend_from_slice(&n.hashes);
                n.hashes = run;
                n.base = n.base.wrapping_sub(lp as u32);
            });
            self.repoint(child, 0..lp, parent, pbase);
            self.unlink(child);
            self.replace(parent, child);
            self.release(parent);
            child
        } else {
            let cbase = self.node(child).base;
            let suffix = self.edit(child, |n| std::mem::take(&mut n.hashes));
            self.edit(parent, |n| n.hashes.extend_from_slice(&suffix));
            self.repoint(parent, lp..lp + lc, child, cbase);
            self.unlink(child);
            self.move_children(child, parent);
            self.release(child);
            parent
        };
        self.node(survivor).last_used.store(tick, Ordering::Relaxed);
        survivor
    }

    /// Restores canonical form around live node `id` after its worker set or children changed:
    /// merges it into its parent and its only child while their worker sets are equal.
    pub fn normalize(&mut self, id: u32) {
        if id == ROOT || !self.is_live(id) {
            return;
        }
        let mut id = id;
        let parent = self.node(id).parent;
        if parent != ROOT
            && self.node(parent).num_children == 1
            && self.node(parent).workers == self.node(id).workers
        {
            id = self.merge(parent, id);
        }
        while self.node(id).num_children == 1 {
            let child = self.node(id).first_child;
            if self.node(child).workers != self.node(id).workers {
                break;
            }
            id = self.merge(id, child);
        }
    }

    /// Adds worker `w` to node `id`'s set.
    pub fn add_worker(&mut self, id: u32, w: u32) {
        self.edit(id, |n| n.workers.insert(w));
    }

    /// Removes worker `w` from node `id`'s set.
    pub fn remove_worker(&mut self, id: u32, w: u32) {
        self.edit(id, |n| n.workers.remove(w));
    }

    /// Deletes leaf `id` (no children): its table entries, its link, its slot.
    pub fn delete_leaf(&mut self, id: u32) {
        self.clear_start(self.start_of(id), id);
        let len = self.node(id).hashes.len();
        self.remove_entries(id, 0..len);
        self.unlink(id);
        self.release(id);
    }

    /// Sets the recency of `id` and all its ancestors to `tick`.
    pub fn touch_path(&self, mut id: u32, tick: u64) {
        while id != NIL {
            let n = self.node(id);
            n.last_used.fetch_max(tick, Ordering::Relaxed);
            id = n.parent;
        }
    }

    /// True when no block is stored.
    pub fn is_empty_tree(&self) -> bool {
        self.live_nodes == 0
    }

    /// An upper bound of [`Self::memory_bytes`] after [`Self::rebuilt`].
    pub fn compacted_bytes(&self) -> usize {
        (self.live_nodes + 1) * std::mem::size_of::<Node>()
            + self.heap_bytes
            + table_bytes_for(self.table.len(), 8)
            + table_bytes_for(self.live_nodes, 16)
    }

    /// A copy of the tree in exactly sized allocations (same shape, ids renumbered).
    pub fn rebuilt(&self) -> Tree {
        let mut out = Tree::with_capacity(self.live_nodes + 1, self.table.len());
        let mut stack = vec![(ROOT, ROOT)];
        while let Some((old, new)) = stack.pop() {
            for c in self.children(old) {
                let n = self.node(c);
                let id = out.alloc(n.hashes.clone(), n.workers.clone(), n.tick());
                out.link(id, new);
                let r = out.insert_entries(id);
                debug_assert!(r.is_ok(), "the blocks are unique in `self`: no conflict");
                out.set_start(out.start_of(id), id);
                stack.push((c, id));
            }
        }
        out.node(ROOT)
            .last_used
            .store(self.node(ROOT).tick(), Ordering::Relaxed);
        out
    }

    /// Checks every invariant listed in the module docs; returns the first violation.
    pub fn check(&self) -> Result<(), String> {
        let mut blocks = 0usize;
        let mut heap = 0usize;
        let mut live = 0usize;
        let mut stack = vec![ROOT];
        let mut seen = vec![false; self.nodes.len()];
        while let Some(id) = stack.pop() {
            let n = self.node(id);
            match seen.get_mut(id as usize) {
                Some(s) if !*s => *s = true,
                _ => return Err(format!("node {id} reached twice or out of range")),
            }
            if id != ROOT {
                live += 1;
                heap += n.heap_bytes();
                if n.hashes.is_empty() || n.workers.is_empty() {
                    return Err(format!("node {id} has an empty run or worker set"));
                }
                let p = self.node(n.parent);
                if n.parent != ROOT {
                    if !n.workers.is_subset(&p.workers) {
                        return Err(format!("node {id}: workers not within parent's"));
                    }
                    if p.num_children == 1 && p.workers == n.workers {
                        return Err(format!("node {id}: mergeable with parent {}", n.parent));
                    }
                }
                if n.parent != ROOT && n.tick() > p.tick() {
                    return Err(format!("node {id}: newer than its parent"));
                }
                for (j, &h) in n.hashes.iter().enumerate() {
                    if self.find(h) != Some((id, j)) {
                        return Err(format!("block {h:#x} of node {id} not found at offset {j}"));
                    }
                }
                blocks += n.hashes.len();
                if self.child_starting_with(n.parent, self.start_of(id)) != Some(id) {
                    return Err(format!("node {id}: start not recorded"));
                }
            }
            let mut count = 0;
            let mut prev = NIL;
            for c in self.children(id) {
                let cn = self.node(c);
                if cn.parent != id || cn.prev_sibling != prev {
                    return Err(format!("bad links at node {c}"));
                }
                prev = c;
                count += 1;
                stack.push(c);
            }
            if count != n.num_children {
                return Err(format!(
                    "node {id}: child count {count} != {}",
                    n.num_children
                ));
            }
        }
        if self.starts.len() != live {
            return Err(format!(
                "{} node starts for {live} nodes",
                self.starts.len()
            ));
        }
        if blocks != self.table.len() {
            return Err(format!(
                "table has {} entries for {blocks} blocks",
                self.table.len()
            ));
        }
        if heap != self.heap_bytes || live != self.live_nodes {
            return Err(format!(
                "accounting: heap {} vs {heap}, nodes {} vs {live}",
                self.heap_bytes, self.live_nodes
            ));
        }
        Ok(())
    }
}

pub(crate) struct Children<'a> {
    tree: &'a Tree,
    next: u32,
}

impl Iterator for Children<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.next == NIL {
            return None;
        }
        let id = self.next;
        self.next = self.tree.node(id).next_sibling;
        Some(id)
    }
}
