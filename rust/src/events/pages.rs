//! Rehash mode with engine blocks (pages) smaller than the router's block: `E < R`, `E`
//! dividing `R` (SGLang's default page of 1 token; vLLM blocks of 16 under a router of 64).
//!
//! # Guarantees
//! - **The index gains a router block only once the engine has reported every page of it**, in
//!   one chain: pages `E, 2E, …, R` tokens into the block, each the parent of the next. Its
//!   parent in the index is the router block before it (or none at the root), and its hash the
//!   router's own hash of those `R` tokens, so a `match` of the same tokens finds it.
//! - **Pages not yet completing a block are remembered, not indexed** (`Pages`): each keeps its
//!   tokens and the page before it, so a child page — in this payload or a later one, on any
//!   branch — can complete the block. A page whose predecessors the worker no longer holds (or
//!   never reported) is skipped (`skipped_unknown_parent`), as a block with an unknown parent is.
//! - **Removals are exact for engines that evict leaf first** (SGLang's radix caches do; so does
//!   vLLM's free queue for a chain's blocks): removing the page that completed a router block
//!   drops that block (and, as the index does, every block after it); removing a page inside a
//!   block only forgets the page, whose completing descendants were removed before it.
//! - **Salted chains**: a salt seeds the first router block only. It is known when the root
//!   store completes that block itself, or from the completing store's own `cache_salt` (SGLang
//!   names it on every store of a salted request); otherwise (vLLM, whose salt rides on the first
//!   block's extra keys) the first block is skipped (`skipped_unsupported`).
//!
//! # Memory
//! Per page held and not completing a block: a 24-byte entry plus the map's overhead, and its
//! `E` tokens (4 bytes each) in one shared arena, compacted when over half of it is dead. With
//! SGLang's 1-token pages that is ~30 bytes per cached token the engine reports.

use hashbrown::HashMap;

use super::apply::{ensure_id, Ctx};
use super::decode::Event;
use crate::blocks::ChainState;

/// A page that does not complete a router block.
#[derive(Clone, Copy, Debug)]
pub(super) struct Page {
    /// The page before it: the previous page of the same router block, or, for the block's first
    /// page, the engine block that ends the router block before (absent at the root).
    prev: Option<u64>,
    /// Tokens of its router block up to and including this page (`E`, `2E`, … below `R`).
    filled: u32,
    /// Its tokens: `tokens[at..at + len]` of the arena.
    pub(super) at: u32,
    pub(super) len: u32,
    /// In the first router block of a chain whose root named a salt.
    salted: bool,
}

/// The pages of one worker's tier that do not complete a router block (rehash mode, `E < R`).
#[derive(Default)]
pub(super) struct Pages {
    pub(super) map: HashMap<u64, Page>,
    /// Every page's tokens; `dead` of them belong to pages forgotten since the last compaction.
    pub(super) tokens: Vec<u32>,
    pub(super) dead: usize,
}

/// Where a chain stands before a page: the page before it and its block's tokens so far.
#[derive(Clone, Copy)]
pub(super) struct Cursor {
    pub(super) prev: Option<u64>,
    pub(super) filled: usize,
    pub(super) salted: bool,
}

impl Pages {
    pub(super) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub(super) fn clear(&mut self) {
        self.map.clear();
        self.tokens.clear();
        self.dead = 0;
    }

    /// Forgets page `hash`; returns whether it was held.
    pub(super) fn remove(&mut self, hash: u64) -> bool {
        let Some(page) = self.map.remove(&hash) else {
            return false;
        };
        self.dead += page.len as usize;
        if self.map.is_empty() {
            self.clear();
        } else if self.dead > 4096 && 2 * self.dead > self.tokens.len() {
            self.compact();
        }
        true
    }

    /// Rewrites the arena with the live pages' tokens only.
    fn compact(&mut self) {
        let mut tokens = Vec::with_capacity(self.tokens.len() - self.dead);
        for page in self.map.values_mut() {
            let (at, len) = (page.at as usize, page.len as usize);
            let at_new = tokens.len();
            tokens.extend_from_slice(self.tokens.get(at..at + len).unwrap_or_default());
            page.at = at_new as u32;
        }
        self.tokens = tokens;
        self.dead = 0;
    }

    /// Records a page (replacing one of the same hash). `false` when the arena is full (4 Gi
    /// tokens), which skips the page.
    pub(super) fn insert(&mut self, hash: u64, at: Cursor, tokens: &[u32]) -> bool {
        // First: forgetting the old page may compact (or empty) the arena.
        self.remove(hash);
        let (Ok(start), Ok(len), Ok(filled)) = (
            u32::try_from(self.tokens.len()),
            u32::try_from(tokens.len()),
            u32::try_from(at.filled),
        ) else {
            return false;
        };
        if start.checked_add(len).is_none() {
            return false;
        }
        self.tokens.extend_from_slice(tokens);
        let page = Page {
            prev: at.prev,
            filled,
            at: start,
            len,
            salted: at.salted,
        };
        self.map.insert(hash, page);
        true
    }

    /// The tokens of the router block that the page before `cursor` ends and `last` completes:
    /// writes `out[..router]` and returns the engine block the block's first page follows
    /// (`None` at the root). `None` (outer) when a page of the block is not held.
    fn gather(
        &self,
        cursor: Cursor,
        last: &[u32],
        router: usize,
        out: &mut Vec<u32>,
    ) -> Option<Option<u64>> {
        out.clear();
        out.resize(router, 0);
        let mut end = router.checked_sub(last.len())?;
        out.get_mut(end..)?.copy_from_slice(last);
        let mut prev = cursor.prev;
        while end > 0 {
            let page = self.map.get(&prev?)?;
            let (at, len) = (page.at as usize, page.len as usize);
            if len > end {
                return None;
            }
            let tokens = self.tokens.get(at..at + len)?;
            out.get_mut(end - len..end)?.copy_from_slice(tokens);
            end -= len;
            prev = page.prev;
        }
        Some(prev)
    }
}

impl Ctx<'_> {
    /// Applies a store of `E`-token pages, `E < R` dividing `R` (see the module docs).
    pub(super) fn store_pages(&mut self, ev: &Event<'_>, tier: usize, engine: usize) {
        let Some((root_salt, lora)) = self.rehash_namespace(ev) else {
            self.state.counters.skipped_unsupported += 1;
            return;
        };
        // A salt seeds the first router block: the root's, or SGLang's on each of its stores.
        let salt = match ev.parent {
            None => root_salt,
            Some(_) => ev.cache_salt.filter(|s| !s.is_empty()),
        };
        let router = self.config.block_size;
        // Registered first: a worker the index forgot starts afresh (its pages forgotten too)
        // before this store's pages are recorded.
        let registered = match (self.state.tiers.get_mut(tier), self.indexes.get(tier)) {
            (Some(state), Some((_, index))) => ensure_id(&mut index.write(), state, self.name),
            _ => return,
        };
        let (Ok(_), Some(state)) = (registered, self.state.tiers.get(tier)) else {
            self.state.counters.index_rejected += 1;
            return;
        };
        let mut cursor = match ev.parent {
            None => Cursor {
                prev: None,
                filled: 0,
                salted: root_salt.is_some(),
            },
            Some(p) => match state.pages.map.get(&p) {
                Some(page) => Cursor {
                    prev: Some(p),
                    filled: page.filled as usize,
                    salted: page.salted,
                },
                None if state.links.contains_key(&p) => Cursor {
                    prev: Some(p),
                    filled: 0,
                    salted: false,
                },
                None => {
                    self.state.counters.skipped_unknown_parent += 1;
                    return;
                }
            },
        };
        let mut block = std::mem::take(&mut self.scratch.tokens);
        let mut applied = 0u64;
        let pages = ev
            .block_hashes
            .iter()
            .zip(ev.token_ids.chunks_exact(engine));
        for (&hash, tokens) in pages {
            cursor.filled += engine;
            if cursor.filled < router {
                let Some(state) = self.state.tiers.get_mut(tier) else {
                    break;
                };
                if !state.pages.insert(hash, cursor, tokens) {
                    self.state.counters.skipped_unsupported += 1;
                    break;
                }
                applied += 1;
                cursor.prev = Some(hash);
                continue;
            }
            match self.complete(tier, hash, cursor, tokens, &mut block, (salt, lora)) {
                Ok(()) => applied += 1,
                Err(Skip::UnknownParent) => {
                    self.state.counters.skipped_unknown_parent += 1;
                    break;
                }
                Err(Skip::Unsupported) => {
                    self.state.counters.skipped_unsupported += 1;
                    break;
                }
                Err(Skip::Rejected) => {
                    self.state.counters.index_rejected += 1;
                    break;
                }
            }
            cursor = Cursor {
                prev: Some(hash),
                filled: 0,
                salted: false,
            };
        }
        self.state.counters.blocks_stored += applied;
        self.scratch.tokens = block;
    }

    /// Indexes the router block page `hash` (`tokens`) completes after the pages `cursor` ends.
    /// `namespace` is the store's (salt, LoRA name); the salt is used for a chain's first block.
    fn complete(
        &mut self,
        tier: usize,
        hash: u64,
        cursor: Cursor,
        tokens: &[u32],
        block: &mut Vec<u32>,
        (salt, lora): (Option<&str>, Option<&str>),
    ) -> Result<(), Skip> {
        let router = self.config.block_size;
        let digest_chain = self.config.profile.chains_on_digest();
        let state = self.state.tiers.get(tier).ok_or(Skip::Rejected)?;
        let anchor = state
            .pages
            .gather(cursor, tokens, router, block)
            .ok_or(Skip::UnknownParent)?;
        let (parent, start) = match anchor {
            None => (None, ChainState::Root),
            Some(a) => {
                let last = *state.links.get(&a).ok_or(Skip::UnknownParent)?;
                let start = match digest_chain {
                    true => ChainState::Digest(*state.digests.get(&a).ok_or(Skip::UnknownParent)?),
                    false => ChainState::Native(last),
                };
                (Some(last), start)
            }
        };
        let salt = match cursor.salted {
            true => Some(salt.ok_or(Skip::Unsupported)?),
            false => None,
        };
        let hasher = self.hasher(salt, lora).map_err(|_| Skip::Unsupported)?;
        let (mut own, mut end) = (None, None);
        hasher
            .hash_each(block, &start, &[], |value, state| {
                own = Some(value);
                if let ChainState::Digest(d) = state {
                    end = Some(*d);
                }
            })
            .map_err(|_| Skip::Unsupported)?;
        let own = own.ok_or(Skip::Unsupported)?;
        let end = match digest_chain {
            true => Some(end.ok_or(Skip::Unsupported)?),
            false => None,
        };
        let (Some(state), Some((_, index))) =
            (self.state.tiers.get_mut(tier), self.indexes.get(tier))
        else {
            return Err(Skip::Rejected);
        };
        let mut index = index.write();
        ensure_id(&mut index, state, self.name)
            .and_then(|id| index.store_id(id, &[own], parent))
            .map_err(|_| Skip::Rejected)?;
        drop(index);
        state.pages.remove(hash);
        state.links.insert(hash, own);
        if !state.firsts.is_empty() {
            state.firsts.remove(&hash);
        }
        if let Some(d) = end {
            state.digests.insert(hash, d);
        }
        Ok(())
    }
}

/// Why a page was not applied.
enum Skip {
    UnknownParent,
    Unsupported,
    Rejected,
}
