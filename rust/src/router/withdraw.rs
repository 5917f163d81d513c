//! [`Router::withdraw`]: taking back a decision whose request never ran on its worker (shed after
//! routing, or sent elsewhere by the caller).
//!
//! Guarantees:
//! - **Load.** A begun decision's load (`active`, `queued`, its prefill, decode and written
//!   blocks) comes off its worker exactly as `begin` added it, and (events mode) its prompt leaves
//!   the worker's in-flight blocks; a routed one holds none.
//! - **Approx model, exact.** The route recorded the prompt on the worker: the blocks it matched
//!   were refreshed and the rest were new. Withdrawing drops every new
//!   block that nothing touched since (no later route, `finish` or `observe` recorded it), with
//!   the same effect on the model as if the route had never recorded them — blocks another
//!   decision has recorded since stay, since that request needs them. Chains are recorded whole
//!   from their first block, so the blocks touched since form a prefix of the new ones and the
//!   untouched rest is one suffix, removed with what hangs below it (nothing can: a block added
//!   below one of them would have touched it). Not undone: the refresh of the matched blocks and
//!   blocks the route evicted to make room (they are gone from the model either way; the engine
//!   may still hold them, which `observe` corrects), and the policy's step (the generator, the
//!   round-robin position). If the cache's touch order was renumbered since the route (once per
//!   ~4 billion touches) nothing is dropped. The one inexact case: two routed decisions share new
//!   blocks (the later one matched what the earlier one added) and both are withdrawn — the
//!   shared blocks stay, since the earlier sees them touched and the later did not add them. A
//!   withdrawal right after its route (nothing recorded in between: the gateway's and the EPP's
//!   sheds) is always exact.
//! - **Replicas** (`Config::updates`): the load taken back and the blocks dropped go to the
//!   outbox (a `Load` delta and a `Forget`), so the other replicas' models and load views follow.
//! - **Idempotent.** Withdrawing a withdrawn decision changes nothing and returns `false`. A
//!   decision that ran — prefilled, observed or finished — cannot be withdrawn (`Value`); nor can
//!   another router's. Nothing applies to a withdrawn decision after (`begin`, `finish`, … raise).

use crate::error::Result;
use crate::value_err;

use super::decision::{Decision, Stage};
use super::Router;

impl Router {
    /// Takes back `d`: its request never ran on its worker (see the module docs). `Ok(false)` if
    /// it was already withdrawn.
    pub fn withdraw(&mut self, d: &Decision) -> Result<bool> {
        self.own(d)?;
        let active = match d.stage() {
            Stage::Withdrawn => return Ok(false),
            Stage::Finished => return value_err!("decision {} was finished: it ran", d.id),
            Stage::Active if d.is_prefilled() => {
                return value_err!("decision {} was prefilled on {:?}: it ran", d.id, d.worker)
            }
            Stage::Active => true,
            Stage::Routed => false,
        };
        if d.is_observed() {
            return value_err!("decision {} was observed: it ran", d.id);
        }
        d.set_withdrawn();
        let index = self.index.clone();
        let Some(slot) = self
            .workers
            .slot_of_uid(&d.worker, d.worker_uid, d.slot_hint)
        else {
            return Ok(true); // the worker was removed, and its load and blocks with it
        };
        let Some(w) = self.workers.get_mut(slot) else {
            return Ok(true);
        };
        if active {
            // Begun and not prefilled: exactly what `begin` added comes off.
            let (prefill, prompt) = (d.prefill_blocks() as i64, d.prompt_blocks as i64);
            let delta = [-1, -1, -prefill, -prompt, -prefill];
            w.add_load(delta);
            if let (Some(inflight), true) = (self.inflight.as_mut(), d.is_in_flight()) {
                inflight.release(&w.name, d.id);
            }
            self.outbox.load(&d.worker, delta);
        }
        let (Some(model), Some(mark), Some(cache)) = (self.model.as_mut(), d.mark, &w.cache) else {
            return Ok(true);
        };
        let new = d.hashes.get(d.matched_blocks..).unwrap_or_default();
        let untouched = new
            .iter()
            .position(|&h| cache.touched_since(h, mark) == Some(false));
        if let Some(k) = untouched {
            model.forget_from(w, &mut index.write(), &d.hashes, d.matched_blocks + k);
            if let Some(&first) = d.hashes.get(d.matched_blocks + k) {
                self.outbox.forget(&w.name, first); // the other replicas drop them too
            }
        }
        Ok(true)
    }
}
