//! Bindings for `crate::blocks`: `kvroute.BlockHasher`.
//!
//! The hasher is immutable after construction, so it needs no lock: any number of Python threads
//! may hash with one object at once. Token arrays of dtype uint32/int32/uint64/int64 are read in
//! place (a copy is made only for non-contiguous arrays); lists are converted once.

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyInt, PyString, PyTuple};

use super::convert::{
    block_hash_from_py, describe, name_item, optional, tokens_from_py, type_error, typed,
    u64_from_int, usize_from_int, Name, Tokens,
};
use super::DETACH_MIN_TOKENS;
use crate::blocks::{BlockHasher, ChainState, MmItem, Options, Profile};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockHasher>()?;
    Ok(())
}

/// `parent=`: `None` (start of a sequence), an int (a native block hash; a negative int64 is read
/// as its two's-complement bits), or a 32-byte digest (`bytes`, `bytearray` or a uint8 array).
fn parent_from_py(obj: Option<&Bound<'_, PyAny>>) -> PyResult<ChainState> {
    let Some(obj) = obj else {
        return Ok(ChainState::Root);
    };
    let digest = if let Ok(b) = obj.cast::<PyBytes>() {
        Some(b.as_bytes().to_vec())
    } else if let Ok(b) = obj.cast::<PyByteArray>() {
        Some(b.to_vec())
    } else if let Ok(a) = obj.cast::<PyArray1<u8>>() {
        Some(a.to_vec()?)
    } else {
        None
    };
    if let Some(digest) = digest {
        return match <[u8; 32]>::try_from(digest.as_slice()) {
            Ok(d) => Ok(ChainState::Digest(d)),
            Err(_) => Err(PyValueError::new_err(format!(
                "parent digest must be 32 bytes, got {}",
                digest.len()
            ))),
        };
    }
    match block_hash_from_py(obj, "parent") {
        Ok(v) => Ok(ChainState::Native(v)),
        Err(e) if e.is_instance_of::<PyTypeError>(obj.py()) => Err(type_error(
            obj,
            "parent must be None, an int (native) or a 32-byte digest (vllm, sglang)",
        )),
        Err(e) => Err(e),
    }
}

/// `mm=`: a sequence of `(identifier: str, offset: int, length: int)`.
fn mm_from_py(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<MmItem>> {
    let Some(obj) = obj else {
        return Ok(Vec::new());
    };
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(type_error(
            obj,
            "mm must be a sequence of (identifier, offset, length) tuples",
        ));
    }
    let mut items = Vec::new();
    for (i, item) in obj.try_iter()?.enumerate() {
        let item = item?;
        let bad = || {
            PyTypeError::new_err(format!(
                "mm[{i}] must be an (identifier: str, offset: int, length: int) tuple, got {}",
                describe(&item)
            ))
        };
        let tuple = item.cast::<PyTuple>().map_err(|_| bad())?;
        if tuple.len() != 3 {
            return Err(bad());
        }
        let identifier = name_item(&tuple.get_item(0)?, &format!("mm[{i}] identifier"))?;
        let offset = tuple.get_item(1)?;
        if offset.is_instance_of::<PyBool>() || !offset.is_instance_of::<PyInt>() {
            return Err(bad());
        }
        let offset = offset.extract::<i64>().map_err(|_| {
            PyValueError::new_err(format!(
                "mm[{i}] offset {} is not an int64",
                describe(&offset)
            ))
        })?;
        let length = u64_from_int(&tuple.get_item(2)?, &format!("mm[{i}] length"), None)?;
        items.push(MmItem {
            identifier,
            offset,
            length,
        });
    }
    Ok(items)
}

fn state_to_py(py: Python<'_>, state: &ChainState) -> PyResult<Py<PyAny>> {
    Ok(match state {
        ChainState::Root => py.None(),
        ChainState::Native(v) => v.into_pyobject(py)?.into_any().unbind(),
        ChainState::Digest(d) => PyBytes::new(py, d).into_any().unbind(),
    })
}

/// Chained hashes of token blocks, bit-exact with an engine's prefix-cache keys.
///
/// ``BlockHasher(block_size=16, *, profile="native", salt=None, lora_name=None, lora_path=None,
/// seed=None, hash_algo=None, vllm_version=None)``. ``hash(tokens)`` returns one uint64 per FULL
/// block (``len(tokens) // block_size`` values; a partial tail is dropped). Profiles:
/// ``"native"`` (XXH3-64 chain over little-endian u32 tokens), ``"vllm"`` (vLLM's block hash:
/// ``hash_algo`` ``"sha256_cbor"`` (default) or ``"sha256"`` (vLLM's own default, pickle-based),
/// ``vllm_version`` the engines' release, >= 0.23, default the newest read: it selects the
/// extra-key format), ``"sglang"`` (SGLang's page hash). ``salt`` is vLLM's ``cache_salt`` / SGLang's cache salt / a separate native chain
/// (an empty salt is no salt); ``lora_name`` + ``lora_path`` are vLLM's ``("lora", name, path)``
/// key (native: a separate chain; not supported by ``sglang``); ``seed`` is vLLM's NONE_HASH seed
/// (default ``"vllm-none-hash"``; ``"0"`` reproduces ``PYTHONHASHSEED=0``).
///
/// Chains continue with ``parent=``: the previous block's hash (int) for ``native``; for
/// ``vllm``/``sglang`` the previous block's 32-byte digest (from ``hash_with_state`` or
/// ``digests``), because their 64-bit values cannot reconstruct it.
#[pyclass(frozen, module = "kvroute._core", name = "BlockHasher")]
pub struct PyBlockHasher {
    inner: BlockHasher,
}

impl PyBlockHasher {
    /// Converts the arguments of a hashing call, then runs `f` on the core (with the GIL
    /// released for long inputs). Validation happens in the core, before any hashing.
    fn call<R: Send>(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
        mm: Option<&Bound<'_, PyAny>>,
        f: impl FnOnce(&BlockHasher, &ChainState, &[MmItem], Tokens<'_>) -> crate::Result<R> + Send,
    ) -> PyResult<R> {
        let parent = parent_from_py(parent)?;
        let mm = mm_from_py(mm)?;
        let array = tokens_from_py(tokens)?;
        let tokens = Tokens::of(&array);
        let work = || f(&self.inner, &parent, &mm, tokens);
        let result = if tokens.len() >= DETACH_MIN_TOKENS {
            py.detach(work)
        } else {
            work()
        };
        Ok(result?)
    }
}

#[pymethods]
impl PyBlockHasher {
    #[new]
    #[pyo3(
        signature = (block_size=None, *, profile=None, salt=None, lora_name=None, lora_path=None, seed=None, hash_algo=None, vllm_version=None),
        text_signature = "(block_size=16, *, profile='native', salt=None, lora_name=None, lora_path=None, seed=None, hash_algo=None, vllm_version=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        block_size: Option<&Bound<'_, PyAny>>,
        profile: Option<Name<'_>>,
        salt: Option<Name<'_>>,
        lora_name: Option<Name<'_>>,
        lora_path: Option<Name<'_>>,
        seed: Option<Name<'_>>,
        hash_algo: Option<Name<'_>>,
        vllm_version: Option<Name<'_>>,
    ) -> PyResult<Self> {
        let block_size = optional(block_size, |b| usize_from_int(b, "block_size"))?.unwrap_or(16);
        let profile: Profile = match profile {
            None => Profile::Native,
            Some(p) => p.parse()?,
        }
        .with_vllm(hash_algo.as_deref(), vllm_version.as_deref())?;
        let options = Options {
            salt: salt.map(Name::to_owned_string),
            lora_name: lora_name.map(Name::to_owned_string),
            lora_path: lora_path.map(Name::to_owned_string),
            seed: seed.map(Name::to_owned_string),
        };
        Ok(PyBlockHasher {
            inner: BlockHasher::new(block_size, profile, options)?,
        })
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    /// ``"native"``, ``"vllm"`` or ``"sglang"``.
    #[getter]
    fn profile(&self) -> &'static str {
        self.inner.profile().name()
    }

    /// The cache salt (``None`` when unsalted; an empty salt is stored as ``None``).
    #[getter]
    fn salt(&self) -> Option<&str> {
        self.inner.options().salt.as_deref()
    }

    /// The LoRA adapter name, or ``None``.
    #[getter]
    fn lora_name(&self) -> Option<&str> {
        self.inner.options().lora_name.as_deref()
    }

    /// The LoRA adapter path (``""`` when a LoRA was given without a path), or ``None``.
    #[getter]
    fn lora_path(&self) -> Option<&str> {
        self.inner.options().lora_path.as_deref()
    }

    /// vLLM's NONE_HASH seed string (``None`` for other profiles).
    #[getter]
    fn seed(&self) -> Option<&str> {
        self.inner.options().seed.as_deref()
    }

    /// vLLM's ``--prefix-caching-hash-algo`` reproduced (``None`` for other profiles).
    #[getter]
    fn hash_algo(&self) -> Option<&'static str> {
        self.inner.profile().vllm_flavor().map(|f| f.algo.name())
    }

    /// The vLLM release (``"major.minor"``) whose extra-key format is reproduced (``None`` for
    /// other profiles).
    #[getter]
    fn vllm_version(&self) -> Option<String> {
        self.inner
            .profile()
            .vllm_flavor()
            .map(|f| f.version.to_string())
    }

    /// The chain's starting state: the native root hash (int), vLLM's NONE_HASH (32 bytes), or
    /// SGLang's salt seed (32 bytes; ``None`` when unsalted). As ``parent`` it hashes like
    /// ``parent=None``, except that a vLLM cache salt only applies with ``parent=None``.
    #[getter]
    fn root(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self.inner.root_state() {
            Some(state) => state_to_py(py, &state),
            None => Ok(py.None()),
        }
    }

    /// Chained hashes of the full blocks of ``tokens`` (``len(tokens) // block_size`` uint64s),
    /// continuing from ``parent``; ``mm`` lists vLLM multimodal items ``(identifier, offset,
    /// length)`` with offsets relative to ``tokens[0]``, sorted by offset.
    #[pyo3(signature = (tokens, parent=None, *, mm=None))]
    fn hash<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        parent: Option<&Bound<'py, PyAny>>,
        mm: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let values = self.call(py, tokens, parent, mm, |h, parent, mm, tokens| {
            let mut out = Vec::new();
            typed!(tokens, |s| h.hash_into(s, parent, mm, &mut out))?;
            Ok(out)
        })?;
        Ok(PyArray1::from_vec(py, values))
    }

    /// ``(hash(tokens, parent), state)`` where ``state`` continues the chain as the next call's
    /// ``parent``: an int for ``native``, the last block's 32-byte digest for ``vllm``/``sglang``,
    /// ``parent`` itself when ``tokens`` holds no full block.
    #[pyo3(signature = (tokens, parent=None, *, mm=None))]
    fn hash_with_state<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        parent: Option<&Bound<'py, PyAny>>,
        mm: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyArray1<u64>>, Py<PyAny>)> {
        let (values, state) = self.call(py, tokens, parent, mm, |h, parent, mm, tokens| {
            let mut out = Vec::new();
            let state = typed!(tokens, |s| h.hash_into(s, parent, mm, &mut out))?;
            Ok((out, state))
        })?;
        Ok((PyArray1::from_vec(py, values), state_to_py(py, &state)?))
    }

    /// The full 32-byte SHA-256 digest of every full block, as a ``(n_blocks, 32)`` uint8 array
    /// (``vllm``/``sglang`` only). Row ``i`` is the chain state after block ``i`` and, for vLLM,
    /// the value published when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``.
    #[pyo3(signature = (tokens, parent=None, *, mm=None))]
    fn digests<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        parent: Option<&Bound<'py, PyAny>>,
        mm: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<u8>>> {
        if !self.inner.profile().chains_on_digest() {
            return Err(PyValueError::new_err(
                "profile 'native' has no digests: its chain state is the 64-bit hash itself",
            ));
        }
        let bytes = self.call(py, tokens, parent, mm, |h, parent, mm, tokens| {
            let mut bytes = Vec::new();
            typed!(tokens, |s| h.hash_each(s, parent, mm, |_, state| {
                if let ChainState::Digest(d) = state {
                    bytes.extend_from_slice(d);
                }
            }))?;
            Ok(bytes)
        })?;
        let rows = bytes.len() / 32;
        PyArray1::from_vec(py, bytes).reshape([rows, 32])
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let o = self.inner.options();
        let quoted = |v: &str| PyString::new(py, v).repr().map(|r| r.to_string());
        let mut s = format!(
            "BlockHasher(block_size={}, profile={}",
            self.inner.block_size(),
            quoted(self.inner.profile().name())?
        );
        let flavor = self.inner.profile().vllm_flavor();
        let algo = flavor.map(|f| f.algo.name().to_owned());
        let version = flavor.map(|f| f.version.to_string());
        for (name, value) in [
            ("salt", &o.salt),
            ("lora_name", &o.lora_name),
            ("lora_path", &o.lora_path),
            ("seed", &o.seed),
            ("hash_algo", &algo),
            ("vllm_version", &version),
        ] {
            if let Some(v) = value {
                s.push_str(&format!(", {name}={}", quoted(v)?));
            }
        }
        s.push(')');
        Ok(s)
    }
}
