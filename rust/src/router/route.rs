//! [`Router::route`], in the steps the [module docs](super) describe: check → match → pick →
//! validate → commit. Everything before commit either changes nothing or (expiry) only what
//! time has already changed; commit cannot fail.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::blocks::{BlockHasher, ChainState, TokenId};
use crate::cache::TouchMark;
use crate::error::{Error, Result};
use crate::events::TierRegistry;
use crate::hashing::Key;
use crate::index::{PrefixIndex, WorkerId};
use crate::value_err;

use super::approx::Model;
use super::decision::{engine_hit_blocks, whole_engine_blocks, Decision, Half};
use super::endpoints::Endpoint;
use super::pd::Phase;
use super::policy::{self, Pick, Reason, View};
use super::workers::{check_finite, Freshness, WorkerTable};
use super::{reserved_partition, RouteRequest, Router, Scratch, OTHER_TIER_WEIGHT};

impl Router {
    /// The hasher for requests of `endpoint` (the router's own without one).
    pub fn hasher_for(&self, endpoint: Option<&str>) -> Result<Arc<BlockHasher>> {
        match endpoint {
            None => Ok(self.hasher.clone()),
            Some(id) => Ok(self.endpoint(id)?.hasher.clone()),
        }
    }

    /// Salts given block hashes for `endpoint` (see [`super::endpoints`]); no-op without one.
    pub fn salt_block_hashes(&self, endpoint: Option<&str>, hashes: &mut [u64]) -> Result<()> {
        if let Some(id) = endpoint {
            self.endpoint(id)?.salt_block_hashes(hashes);
        }
        Ok(())
    }

    /// Hashes `tokens` for `endpoint` and routes them (a convenience over
    /// [`Router::tokens_request`] + [`Router::route`]).
    pub fn route_tokens<T: TokenId>(
        &mut self,
        tokens: &[T],
        key: Option<Key<'_>>,
        endpoint: Option<&str>,
        now: f64,
    ) -> Result<Decision> {
        let req = self.tokens_request(tokens, key, endpoint, now)?;
        self.route(req)
    }

    /// The request for a prompt of `tokens`, hashed with `endpoint`'s hasher (nothing excluded).
    pub fn tokens_request<'a, T: TokenId>(
        &self,
        tokens: &[T],
        key: Option<Key<'a>>,
        endpoint: Option<&'a str>,
        now: f64,
    ) -> Result<RouteRequest<'a>> {
        let hasher = self.hasher_for(endpoint)?;
        Ok(RouteRequest {
            hashes: prompt_hashes(&hasher, tokens)?,
            prompt_tokens: Some(tokens.len()),
            key,
            endpoint,
            exclude: &[],
            now,
        })
    }

    /// Routes one request (see the module docs). A request without block hashes (no tokens, or
    /// fewer than one block) is whole: it has no prefix to match, and every policy routes it.
    /// Only workers that decode are candidates (a whole request prefills and decodes on one
    /// worker); [`Router::route_pd`] routes a request as a prefill/decode pair.
    ///
    /// Errors change nothing: `now` not finite, `prompt_tokens` disagreeing with the hashes, a
    /// chain contradicting the index (approx mode) (`Value`); an unknown endpoint or excluded
    /// name (`Key`); no candidate ([`Error::NoWorker`]).
    pub fn route(&mut self, req: RouteRequest<'_>) -> Result<Decision> {
        // 1. Check the request and gather the candidates.
        let prompt_tokens = self.check_request(&req)?;
        let endpoint = self.endpoint_arc(req.endpoint)?;
        let Scratch { candidates, .. } = &mut self.scratch;
        let ep = endpoint.as_ref().and_then(|e| self.endpoints.get(e));
        gather_candidates(&self.workers, ep, req.exclude, Phase::Decode, candidates)?;
        if candidates.is_empty() {
            return Err(no_worker(&self.workers, ep, req.exclude, Phase::Decode));
        }

        // 2. Match: drop blocks idle past the TTL, then one index walk → each worker's credit.
        let shared = self.index.clone();
        let mut index = shared.write();
        self.expire_idle(&mut index, req.now);
        self.credit(&index, &req.hashes, req.now);

        // 3. Pick: pure; returns the choice and the state change it implies.
        let keys = RequestKeys::of(&req, endpoint.as_ref());
        let pick = self.pick(&keys, req.hashes.len())?;

        // 4. Validate (approx): the chosen worker's chain must agree with the index. This is
        //    the last step that can fail; it stores the chain in the index or changes nothing.
        let who = self.who(pick.slot)?;
        self.validate_on(&mut index, pick.slot, &req.hashes)?;

        // 5. Commit: nothing fails from here on. The modelled cache of the chosen worker now
        //    holds the prompt (the decision keeps it for finish / observe) …
        let mark = self.commit_on(
            &mut index,
            pick.slot,
            &req.hashes,
            endpoint.as_ref(),
            req.now,
        );
        // … the policy's state change applies, and the decision is counted.
        policy::commit(
            pick.effect,
            pick.slot,
            &self.scratch.candidates,
            &mut self.workers,
            &mut self.rng,
        );
        drop(index);
        let prompt = (prompt_tokens, req.hashes.len());
        // The decision keeps the prompt (approx: for finish / observe / withdraw; events: its
        // in-flight blocks from begin to finish).
        let hashes = req.hashes;
        let made = Made {
            slot: pick.slot,
            who,
            reason: pick.reason,
            scores: pick.scores,
            half: Half::Whole,
            mark,
        };
        Ok(self.decision(made, prompt, hashes, endpoint))
    }

    /// Step 1: the endpoint's own id (`None` without one); `KeyError` for an unknown one.
    pub(super) fn endpoint_arc(&self, endpoint: Option<&str>) -> Result<Option<Arc<str>>> {
        match endpoint {
            Some(id) => Ok(Some(self.endpoint(id)?.id.clone())),
            None => Ok(None),
        }
    }

    /// Step 3: the router's policy over `scratch.candidates` (pure: see [`policy::pick`]).
    pub(super) fn pick(&mut self, keys: &RequestKeys<'_>, prompt_blocks: usize) -> Result<Pick> {
        let Scratch {
            candidates,
            credit,
            pick: buffers,
            ..
        } = &mut self.scratch;
        let view = View {
            workers: &self.workers,
            rng: self.rng,
            bound: self.bound,
            weights: self.config.weights,
        };
        let request = policy::Request {
            candidates: candidates.as_slice(),
            prompt_blocks,
            credit,
            hash_key: keys.hash,
            tie_key: keys.tie,
        };
        policy::pick(self.config.policy, &view, &request, buffers)
    }

    /// The name and uid of the worker a pick chose in `slot`.
    pub(super) fn who(&self, slot: u32) -> Result<(Arc<str>, u64)> {
        match self.workers.get(slot) {
            Some(w) => Ok((w.name.clone(), w.uid)),
            None => Err(picked_missing(slot)),
        }
    }

    /// Step 4 (approx mode): the chain must agree with the index for the worker in `slot`:
    /// stores it there, or fails changing nothing. Must be followed by [`Router::commit_on`].
    pub(super) fn validate_on(
        &mut self,
        index: &mut PrefixIndex,
        slot: u32,
        hashes: &[u64],
    ) -> Result<()> {
        match (&self.model, self.workers.get(slot)) {
            (Some(_), Some(worker)) => Model::validate(worker, index, hashes),
            (Some(_), None) => Err(picked_missing(slot)),
            (None, _) => Ok(()),
        }
    }

    /// Step 5 (approx mode, after [`Router::validate_on`]): the modelled cache of the worker in
    /// `slot` holds the prompt at `now`, in the endpoint's partition when it reserves one. Returns
    /// the worker's touch mark right after (what only this decision touched since can be
    /// withdrawn exactly).
    pub(super) fn commit_on(
        &mut self,
        index: &mut PrefixIndex,
        slot: u32,
        hashes: &[u64],
        endpoint: Option<&Arc<str>>,
        now: f64,
    ) -> Option<TouchMark> {
        let (Some(model), Some(worker)) = (self.model.as_mut(), self.workers.get_mut(slot)) else {
            return None;
        };
        let partition = reserved_partition(&self.endpoints, endpoint);
        model.commit(worker, index, hashes, partition, now);
        let mark = worker.cache.as_ref().map(|c| c.touch_mark());
        // Other replicas hear of the blocks newly predicted there.
        let known = self.scratch.overlap.get(slot as usize).copied();
        self.outbox
            .record(&worker.name, partition, hashes, known.unwrap_or(0) as usize);
        mark
    }

    /// Step 5: counts a decision `made` for a prompt of `(tokens, blocks)` and returns it (its
    /// cached blocks are the match step's overlap on its worker).
    pub(super) fn decision(
        &mut self,
        made: Made,
        (prompt_tokens, prompt_blocks): (usize, usize),
        hashes: Vec<u64>,
        endpoint: Option<Arc<str>>,
    ) -> Decision {
        let (name, uid) = made.who;
        if self.roster_stale {
            self.roster = self.workers.roster();
            self.roster_stale = false;
        }
        self.decisions += 1;
        let matched_blocks = self.scratch.overlap.get(made.slot as usize).copied();
        let matched_blocks = matched_blocks.unwrap_or(0) as usize;
        let inflight_blocks = self.scratch.inflight.get(made.slot as usize).copied();
        let engine = self
            .workers
            .get(made.slot)
            .and_then(|w| w.engine_block_size);
        let engine_hit = |held: usize| {
            engine_hit_blocks(
                self.config.profile,
                prompt_tokens,
                self.config.block_size,
                engine,
                held,
            )
        };
        let priority = endpoint
            .as_ref()
            .and_then(|e| self.endpoints.get(e))
            .map_or(0, |e| e.priority);
        Decision {
            id: self.decisions,
            router: self.id,
            worker: name,
            worker_uid: uid,
            slot_hint: made.slot,
            policy: self.config.policy,
            reason: made.reason,
            half: made.half,
            block_size: self.config.block_size,
            prompt_tokens,
            prompt_blocks,
            cached_blocks: engine_hit(matched_blocks),
            matched_blocks,
            inflight_blocks: engine_hit(inflight_blocks.unwrap_or(0) as usize),
            endpoint,
            priority,
            hashes,
            roster: self.roster.clone(),
            scores: made.scores,
            mark: made.mark,
            state: Default::default(),
        }
    }

    /// Step 1: the prompt's length in tokens, once `now` and the lengths are checked.
    pub(super) fn check_request(&self, req: &RouteRequest<'_>) -> Result<usize> {
        check_finite(req.now, "now")?;
        let bs = self.config.block_size;
        match req.prompt_tokens {
            Some(t) if t / bs != req.hashes.len() => value_err!(
                "{} block hashes given for a prompt of {t} tokens (blocks of {bs})",
                req.hashes.len()
            ),
            Some(t) => Ok(t),
            None => Ok(req.hashes.len().saturating_mul(bs)),
        }
    }

    /// Step 2 (approx mode with a TTL): every worker's blocks idle past the TTL at `now` leave
    /// the model.
    pub(super) fn expire_idle(&mut self, index: &mut PrefixIndex, now: f64) {
        if let Some(model) = self.model.as_mut() {
            for w in self.workers.iter_mut() {
                model.expire_idle(w, index, now);
            }
        }
    }

    /// Whether routing at `now` would first drop blocks idle past the TTL (approx mode with a
    /// TTL, a worker's idle deadline reached): work as long as the blocks, which a caller that
    /// routes short requests inline can ask about first.
    pub fn expiry_due(&self, now: f64) -> bool {
        self.model.as_ref().is_some_and(|m| m.ttl.is_some())
            && self.workers.iter().any(|w| now >= w.idle_deadline)
    }

    /// Step 2: `scratch.overlap` (leading blocks of `hashes` each worker holds, by slot) and
    /// `scratch.credit` (freshness × the overlap, or the tiered sum in events mode); in events
    /// mode `scratch.inflight` (the prefix held by each worker's in-flight requests, which it
    /// will have computed when it reaches this one) and the credit raised to it.
    pub(super) fn credit(&mut self, index: &PrefixIndex, hashes: &[u64], now: f64) {
        self.sync_engine_block_sizes();
        let scratch = &mut self.scratch;
        let n = self.workers.slot_count();
        let block_size = self.config.block_size;
        let workers = &self.workers;
        // A worker holds whole blocks of its engine's size (see `whole_engine_blocks`).
        let whole = |slot: u32, blocks: u32| {
            let engine = workers.get(slot).and_then(|w| w.engine_block_size);
            whole_engine_blocks(u64::from(blocks), block_size, engine) as u32
        };
        scratch.overlap.clear();
        scratch.overlap.resize(n, 0);
        scratch.inflight.clear();
        scratch.inflight.resize(n, 0);
        index.match_into(hashes, &mut scratch.matches);
        for &(id, blocks) in &scratch.matches {
            if let Some(slot) = slot_of_index_worker(&mut self.id_cache, workers, index, id) {
                if let Some(o) = scratch.overlap.get_mut(slot as usize) {
                    *o = whole(slot, blocks);
                }
            }
        }
        scratch.credit.clear();
        scratch
            .credit
            .extend(scratch.overlap.iter().map(|&o| f64::from(o)));
        if let Some(tiers) = &self.tiers {
            add_tier_credit(
                tiers,
                &self.config.tier_weights,
                workers,
                hashes,
                scratch,
                whole,
            );
        }
        let half_life = self.config.stale_half_life;
        for (slot, w) in workers.iter_slots() {
            if !matches!(w.freshness, Freshness::Fresh) {
                if let Some(credit) = scratch.credit.get_mut(slot as usize) {
                    *credit *= w.freshness_at(now, half_life);
                }
            }
        }
        let Some(inflight) = &self.inflight else {
            return;
        };
        let index = inflight.index();
        index.match_into(hashes, &mut scratch.matches);
        for &(id, blocks) in &scratch.matches {
            let Some(slot) = slot_of_index_worker(&mut self.inflight_ids, workers, index, id)
            else {
                continue;
            };
            let blocks = whole(slot, blocks);
            if let Some(o) = scratch.inflight.get_mut(slot as usize) {
                *o = blocks;
            }
            if let Some(c) = scratch.credit.get_mut(slot as usize) {
                *c = c.max(f64::from(blocks));
            }
        }
    }
}

/// The block hashes of a prompt of `tokens` (full blocks, from the root), in one allocation.
pub fn prompt_hashes<T: TokenId>(hasher: &BlockHasher, tokens: &[T]) -> Result<Vec<u64>> {
    let mut hashes = Vec::with_capacity(hasher.num_blocks(tokens.len()));
    hasher.hash_into(tokens, &ChainState::Root, &[], &mut hashes)?;
    Ok(hashes)
}

/// Runs `prepare` with `lock` free, then `f` on the router under `lock` with what `prepare`
/// made: hashing a long prompt this way (the Python binding does), other callers of the router
/// wait behind the routing only, never behind the hashing. An error from `prepare` takes no lock
/// and runs no `f`.
pub fn prepared_then_locked<P, R>(
    lock: &Mutex<Router>,
    prepare: impl FnOnce() -> Result<P>,
    f: impl FnOnce(&mut Router, P) -> Result<R>,
) -> Result<R> {
    let prepared = prepare()?;
    f(&mut lock.lock(), prepared)
}

/// The keys a pick uses: `hash` routes by the request's key, else its endpoint, else its first
/// block; ties break by the first block, else the key, else the endpoint.
pub(super) struct RequestKeys<'a> {
    pub hash: Key<'a>,
    pub tie: Key<'a>,
}

impl<'a> RequestKeys<'a> {
    pub(super) fn of(req: &RouteRequest<'a>, endpoint: Option<&'a Arc<str>>) -> Self {
        let first_block = req.hashes.first().map(|&h| Key::Int(h));
        let endpoint_key = endpoint.map(|e| Key::Bytes(e.as_bytes()));
        RequestKeys {
            hash: req
                .key
                .or(endpoint_key)
                .or(first_block)
                .unwrap_or(Key::Int(0)),
            tie: first_block
                .or(req.key)
                .or(endpoint_key)
                .unwrap_or(Key::Int(0)),
        }
    }
}

/// A choice about to become a [`Decision`].
pub(super) struct Made {
    pub slot: u32,
    /// The worker's name and uid (from [`Router::who`]).
    pub who: (Arc<str>, u64),
    pub reason: Reason,
    pub scores: Vec<(u32, f64)>,
    pub half: Half,
    /// Approx mode: the worker's touch mark after the prompt was recorded on it.
    pub mark: Option<TouchMark>,
}

/// Step 1: the candidates for `phase` into `out` (ascending slots): healthy, able to do the
/// phase, in the endpoint's pool for it, not excluded. `out` may end empty.
pub(super) fn gather_candidates(
    workers: &WorkerTable,
    ep: Option<&Endpoint>,
    exclude: &[&str],
    phase: Phase,
    out: &mut Vec<u32>,
) -> Result<()> {
    out.clear();
    match ep {
        Some(ep) => out.extend_from_slice(ep.pool(phase)),
        None => out.extend(
            workers
                .iter_slots()
                .filter(|(_, w)| w.healthy && w.role.does(phase))
                .map(|(s, _)| s),
        ),
    }
    for name in exclude {
        let slot = workers.require(name)?;
        out.retain(|&c| c != slot);
    }
    Ok(())
}

/// The error for no candidate of `phase`, saying why (the phase only when some worker does not
/// do it).
pub(super) fn no_worker(
    workers: &WorkerTable,
    ep: Option<&Endpoint>,
    exclude: &[&str],
    phase: Phase,
) -> Error {
    let able = workers.capable(phase);
    let roles = able < workers.len();
    Error::NoWorker(format!(
        "no worker to route to: {} workers, {} healthy{}{}{}",
        workers.len(),
        workers.healthy(),
        if roles {
            format!(", {able} able to {}", phase.name())
        } else {
            String::new()
        },
        ep.map_or(String::new(), |ep| format!(
            ", endpoint {:?} with {} in its {}pool",
            ep.id,
            ep.pool(phase).len(),
            if roles {
                format!("{} ", phase.name())
            } else {
                String::new()
            }
        )),
        if exclude.is_empty() {
            String::new()
        } else {
            format!(", {} excluded", exclude.len())
        }
    ))
}

/// The pick named a slot without a worker (cannot happen: picks choose among candidates).
pub(super) fn picked_missing(slot: u32) -> Error {
    Error::NoWorker(format!(
        "no worker to route to: slot {slot} was picked but is empty"
    ))
}

/// Our slot for index worker `id`, through a cache validated by the index's own name pointer.
fn slot_of_index_worker(
    cache: &mut Vec<Option<(Arc<str>, u32)>>,
    workers: &WorkerTable,
    index: &PrefixIndex,
    id: WorkerId,
) -> Option<u32> {
    let name = index.worker_name(id)?;
    let at = id as usize;
    if let Some(Some((cached, slot))) = cache.get(at) {
        if std::ptr::eq(cached.as_ptr(), name.as_ptr()) && cached.len() == name.len() {
            return Some(*slot);
        }
    }
    let slot = workers.slot(name)?;
    if cache.len() <= at {
        cache.resize(at + 1, None);
    }
    if let Some(entry) = cache.get_mut(at) {
        *entry = index.worker_name_arc(id).map(|arc| (arc, slot));
    }
    Some(slot)
}

/// Adds, per worker, the credit of blocks found only in slower tiers (see the module docs).
fn add_tier_credit(
    tiers: &TierRegistry,
    weights: &[(String, f64)],
    workers: &WorkerTable,
    query: &[u64],
    scratch: &mut Scratch,
    whole: impl Fn(u32, u32) -> u32,
) {
    let tiers = tiers.read();
    if tiers.is_empty() || query.is_empty() {
        return;
    }
    // (slot, overlap, weight) of every tier holding part of the prefix on a worker.
    let hits = &mut scratch.tier_hits;
    hits.clear();
    for (name, index) in tiers.iter() {
        let weight = weights
            .iter()
            .find(|(t, _)| **t == **name)
            .map_or(OTHER_TIER_WEIGHT, |&(_, w)| w);
        let index = index.read();
        index.match_into(query, &mut scratch.matches);
        for &(id, blocks) in &scratch.matches {
            if let Some(slot) = index.worker_name(id).and_then(|n| workers.slot(n)) {
                hits.push((slot, whole(slot, blocks), weight));
            }
        }
    }
    hits.sort_unstable_by_key(|h| h.0);
    for worker_hits in hits.chunk_by(|a, b| a.0 == b.0) {
        let Some(&(slot, _, _)) = worker_hits.first() else {
            continue;
        };
        let gpu = scratch.overlap.get(slot as usize).copied().unwrap_or(0);
        let per_tier = &mut scratch.tier_overlap;
        per_tier.clear();
        per_tier.extend(
            worker_hits
                .iter()
                .map(|&(_, blocks, weight)| (blocks, weight)),
        );
        per_tier.push((gpu, 1.0));
        if let Some(c) = scratch.credit.get_mut(slot as usize) {
            *c = tiered_credit(per_tier);
        }
    }
}

/// `Σ_{i < max o_t} max{ w_t : o_t > i }` for `(o_t, w_t)` pairs (reordered in place).
pub(super) fn tiered_credit(sorted: &mut [(u32, f64)]) -> f64 {
    // Descending overlap: walking down, the best weight among tiers reaching past each block.
    sorted.sort_unstable_by_key(|t| std::cmp::Reverse(t.0));
    let mut credit = 0.0;
    let mut best = 0.0f64;
    for (k, &(o, w)) in sorted.iter().enumerate() {
        best = best.max(w);
        let below = sorted.get(k + 1).map_or(0, |&(n, _)| n);
        credit += f64::from(o - below.min(o)) * best;
    }
    credit
}
