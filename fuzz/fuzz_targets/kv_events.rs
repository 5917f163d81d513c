//! Arbitrary bytes as a KV-event payload: the decoder never panics, a refused payload leaves the
//! index byte-for-byte unchanged, and an accepted one leaves it consistent.
#![no_main]

use std::sync::Arc;

use kvroute::events::{Applier, Batch, Config, Decoder, Mode};
use kvroute::index::PrefixIndex;
use libfuzzer_sys::fuzz_target;
use parking_lot::RwLock;

fuzz_target!(|data: &[u8]| {
    let mut batch = Batch::default();
    let decoded = Decoder::new().decode(data, &mut batch).is_ok();
    if decoded {
        for e in batch.events(data) {
            let _ = e.extra_keys.summary(e.lora_name);
        }
    }
    for mode in [Mode::Rehash, Mode::Direct] {
        let index = Arc::new(RwLock::new(PrefixIndex::default()));
        let config = Config { mode, block_size: 1, ..Config::default() };
        let Ok(mut applier) = Applier::new(index.clone(), config) else { return };
        // Seed some state so removals and parents have something to hit.
        let _ = applier.apply("w", data);
        let before = index.read().dump();
        let out = applier.apply("w", data);
        assert_eq!(out.is_ok(), decoded);
        if out.is_err() {
            assert_eq!(index.read().dump(), before);
        }
        let checked = index.read().check_invariants();
        if let Err(e) = checked {
            panic!("index invariant broken: {e}");
        }
    }
});
