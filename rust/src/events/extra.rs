//! The `extra_keys` of a `BlockStored` event, as re-hashing reads them.
//!
//! The wire decoder only delimits the field ([`ExtraKeys::raw`]); what the keys mean for
//! recomputing the router's block hashes (a cache salt on the first block, the LoRA name, or keys
//! the router cannot reproduce) is decided here, lazily, by [`ExtraKeys::summary`], which never
//! fails: an unreadable field counts as unsupported.

use rmp::Marker;

use super::reader::Reader;

/// The `extra_keys` of a `BlockStored`: one entry per block, each nil or an array of keys, in the
/// untagged form events publish (vLLM ≥ 0.31 and ≤ 0.30 alike): the LoRA name (a string equal to
/// `lora_name`), multimodal items (`[identifier, offset]` arrays), the cache salt (a string, first
/// block of a sequence only) and prompt-embedding digests (`bin`).
#[derive(Clone, Copy, Debug, Default)]
pub struct ExtraKeys<'a>(pub(super) Option<&'a [u8]>);

/// What the extra keys mean for re-hashing a chain (see [`ExtraKeys::summary`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtraSummary<'a> {
    /// The cache salt found on the first block, if any.
    pub salt: Option<&'a str>,
    /// True when some key cannot be reproduced from the event alone (a multimodal item, a prompt
    /// embedding digest, a string on a later block, or an unrecognised key).
    pub unsupported: bool,
}

impl<'a> ExtraKeys<'a> {
    /// The field's msgpack encoding, as sent (`None` when absent).
    pub fn raw(&self) -> Option<&'a [u8]> {
        self.0
    }

    /// True when the field was absent or nil.
    pub fn is_none(&self) -> bool {
        self.0.is_none_or(|b| b == [0xc0])
    }

    /// Classifies the keys: on each block, a string equal to `lora_name` is the LoRA key (once per
    /// block); on block 0 one other string is the cache salt; anything else is unsupported.
    pub fn summary(&self, lora_name: Option<&str>) -> ExtraSummary<'a> {
        let Some(bytes) = self.0 else {
            return ExtraSummary::default();
        };
        let mut out = ExtraSummary::default();
        let mut r = Reader::new(bytes);
        let blocks = match r.marker() {
            Ok(Marker::Null) => return out,
            Ok(m) => match r.array_len(m) {
                Ok(n) => n,
                Err(_) => return unsupported(),
            },
            Err(_) => return unsupported(),
        };
        for block in 0..blocks {
            let keys = match r.marker() {
                Ok(Marker::Null) => continue,
                Ok(m) => match r.array_len(m) {
                    Ok(n) => n,
                    Err(_) => return unsupported(),
                },
                Err(_) => return unsupported(),
            };
            let mut lora_seen = false;
            for _ in 0..keys {
                let start = r.pos();
                let Ok(m) = r.marker() else {
                    return unsupported();
                };
                match r.str_span(m, start) {
                    Ok(Some(span)) => {
                        let s = span.str(bytes);
                        if lora_name == Some(s) && !lora_seen {
                            lora_seen = true;
                        } else if block == 0 && out.salt.is_none() {
                            out.salt = Some(s);
                        } else {
                            out.unsupported = true;
                        }
                    }
                    Ok(None) => {
                        out.unsupported = true;
                        if r.skip_rest(m).is_err() {
                            return unsupported();
                        }
                    }
                    Err(_) => return unsupported(),
                }
            }
        }
        out
    }
}

fn unsupported<'a>() -> ExtraSummary<'a> {
    ExtraSummary {
        salt: None,
        unsupported: true,
    }
}
