//! `nucleus._core`'s structured output (Python: `nucleus.GrammarCompiler`,
//! `nucleus.CompiledGrammar`, `nucleus.GrammarMatcher` in `nucleus/grammar.py`): the crate
//! nucleus-grammar (llguidance 1.9) on NumPy bitmasks.
//!
//! Errors of the crate are raised as `ValueError(kind, message)`, `kind` the name of the
//! `GrammarError` variant ([`kind`]); the wrapper turns them into `nucleus.GrammarError`.
//! Loading a tokenizer, compiling and filling a mask run with the GIL released; a matcher's
//! state is behind a mutex, so two threads that share one matcher take turns.

use std::sync::{Arc, Mutex, MutexGuard};

use nucleus_grammar::{
    CompiledGrammar, GrammarCompiler, GrammarError, GrammarKind, GrammarMatcher, GrammarOptions,
    GrammarSpec, TokenEnv,
};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tokenizers::Tokenizer;

/// The Python name of a [`GrammarError`]'s variant: `nucleus.GrammarError.kind`.
fn kind(e: &GrammarError) -> &'static str {
    match e {
        GrammarError::Tokenizer(_) => "Tokenizer",
        GrammarError::TokenTooLong { .. } => "TokenTooLong",
        GrammarError::VocabTooSmall { .. } => "VocabTooSmall",
        GrammarError::NoEosToken => "NoEosToken",
        GrammarError::TokenOutOfRange { .. } => "TokenOutOfRange",
        GrammarError::InvalidSchemaJson(_) => "InvalidSchemaJson",
        GrammarError::Compile { .. } => "Compile",
        GrammarError::TooDeep { .. } => "TooDeep",
        GrammarError::TokenRejected { .. } => "TokenRejected",
        GrammarError::Ended => "Ended",
        GrammarError::RollbackTooFar { .. } => "RollbackTooFar",
        GrammarError::BitmaskTooShort { .. } => "BitmaskTooShort",
        GrammarError::BitmaskShape { .. } => "BitmaskShape",
        GrammarError::Matcher(_) => "Matcher",
    }
}

/// `ValueError(kind, message)`, raised by the wrapper as `nucleus.GrammarError`.
fn grammar_error(e: &GrammarError) -> PyErr {
    PyValueError::new_err((kind(e), e.to_string()))
}

/// `ValueError(kind, message)` for a check of this module that has no crate variant.
fn argument_error(kind: &'static str, message: String) -> PyErr {
    PyValueError::new_err((kind, message))
}

/// The Python name of a grammar kind (`CompiledGrammar.kind`).
fn kind_name(kind: GrammarKind) -> &'static str {
    match kind {
        GrammarKind::JsonSchema => "json_schema",
        GrammarKind::Regex => "regex",
        GrammarKind::Lark => "lark",
    }
}

/// The token environment of a tokenizer.json text: `vocab_size` `None` is the tokenizer's
/// own (its largest id + 1).
fn token_env(
    json: &str,
    eos_token_ids: &[u32],
    vocab_size: Option<usize>,
) -> Result<TokenEnv, GrammarError> {
    let tokenizer: Tokenizer = json
        .parse()
        .map_err(|e| GrammarError::Tokenizer(format!("reading tokenizer.json: {e}")))?;
    let vocab_size = vocab_size.unwrap_or_else(|| {
        tokenizer
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&id| id as usize + 1)
    });
    TokenEnv::from_tokenizer(&tokenizer, eos_token_ids, vocab_size)
}

/// The most bytes a tokenizer.json may have (the largest real ones are tens of MB): a bigger
/// file, or a device such as /dev/zero, is refused before it is read into memory.
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// The text of the tokenizer file at `path`, read with at most [`MAX_TOKENIZER_BYTES`].
fn read_bounded(path: &std::path::Path) -> Result<String, GrammarError> {
    use std::io::Read;
    let cannot = |e: std::io::Error| {
        GrammarError::Tokenizer(format!(
            "cannot read the tokenizer file {}: {e}",
            path.display()
        ))
    };
    let file = std::fs::File::open(path).map_err(cannot)?;
    let meta = file.metadata().map_err(cannot)?;
    if !meta.is_file() || meta.len() > MAX_TOKENIZER_BYTES {
        return Err(GrammarError::Tokenizer(format!(
            "the tokenizer path {} is not a regular file of at most {MAX_TOKENIZER_BYTES} bytes",
            path.display()
        )));
    }
    let mut text = String::new();
    file.take(MAX_TOKENIZER_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(cannot)?;
    if text.len() as u64 > MAX_TOKENIZER_BYTES {
        return Err(GrammarError::Tokenizer(format!(
            "the tokenizer file {} is larger than {MAX_TOKENIZER_BYTES} bytes",
            path.display()
        )));
    }
    Ok(text)
}

/// One tokenizer's grammar compiler with its cache (nucleus_grammar::GrammarCompiler).
#[pyclass(name = "GrammarCompiler", module = "nucleus._core", frozen)]
pub(crate) struct PyGrammarCompiler {
    compiler: Arc<GrammarCompiler>,
}

#[pymethods]
impl PyGrammarCompiler {
    /// A compiler for the tokenizer.json at `path` (read, parsed and its token trie built with
    /// the GIL released).
    #[staticmethod]
    #[pyo3(signature = (path, eos_token_ids, vocab_size, cache_size))]
    fn from_file(
        py: Python<'_>,
        path: std::path::PathBuf,
        eos_token_ids: Vec<u32>,
        vocab_size: Option<usize>,
        cache_size: usize,
    ) -> PyResult<Self> {
        py.detach(|| {
            let json = read_bounded(&path)?;
            let env = token_env(&json, &eos_token_ids, vocab_size)?;
            GrammarCompiler::with_capacity(env, cache_size)
        })
        .map(|c| Self {
            compiler: Arc::new(c),
        })
        .map_err(|e| grammar_error(&e))
    }

    /// A compiler for a tokenizer.json given as text.
    #[staticmethod]
    #[pyo3(signature = (json, eos_token_ids, vocab_size, cache_size))]
    fn from_json_str(
        py: Python<'_>,
        json: String,
        eos_token_ids: Vec<u32>,
        vocab_size: Option<usize>,
        cache_size: usize,
    ) -> PyResult<Self> {
        py.detach(|| {
            let env = token_env(&json, &eos_token_ids, vocab_size)?;
            GrammarCompiler::with_capacity(env, cache_size)
        })
        .map(|c| Self {
            compiler: Arc::new(c),
        })
        .map_err(|e| grammar_error(&e))
    }

    /// Ids of a logits row (bits of a bitmask row in use).
    #[getter]
    fn vocab_size(&self) -> usize {
        self.compiler.token_env().vocab_size()
    }

    /// The EOS ids, as given.
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.compiler.token_env().eos_token_ids().to_vec()
    }

    /// Compilations run so far (cache misses).
    #[getter]
    fn compilations(&self) -> u64 {
        self.compiler.compilations()
    }

    /// Grammars in the cache.
    #[getter]
    fn cached_grammars(&self) -> usize {
        self.compiler.cached_grammars()
    }

    /// Empties the cache.
    fn clear_cache(&self) {
        self.compiler.clear_cache();
    }

    /// Compiles `text` of `kind` ("json_schema", "regex" or "lark"), cached, with the GIL
    /// released. `max_whitespace` applies to JSON Schemas (`None`: unbounded).
    #[pyo3(signature = (kind, text, max_whitespace))]
    fn compile(
        &self,
        py: Python<'_>,
        kind: &str,
        text: String,
        max_whitespace: Option<usize>,
    ) -> PyResult<PyCompiledGrammar> {
        let spec = match kind {
            "json_schema" => GrammarSpec::JsonSchema(text),
            "regex" => GrammarSpec::Regex(text),
            "lark" => GrammarSpec::Lark(text),
            other => {
                return Err(PyValueError::new_err(format!(
                    "kind must be \"json_schema\", \"regex\" or \"lark\", got {other:?}"
                )))
            }
        };
        let options = GrammarOptions {
            max_whitespace,
            ..GrammarOptions::default()
        };
        let compiler = &self.compiler;
        let grammar = py
            .detach(|| compiler.compile(&spec, &options))
            .map_err(|e| grammar_error(&e))?;
        Ok(PyCompiledGrammar {
            grammar,
            env: compiler.token_env().clone(),
        })
    }
}

/// A compiled grammar, shared by every matcher made from it.
#[pyclass(name = "CompiledGrammar", module = "nucleus._core", frozen)]
pub(crate) struct PyCompiledGrammar {
    grammar: Arc<CompiledGrammar>,
    env: TokenEnv,
}

#[pymethods]
impl PyCompiledGrammar {
    /// "json_schema", "regex" or "lark".
    #[getter]
    fn kind(&self) -> &'static str {
        kind_name(self.grammar.kind())
    }

    /// llguidance's warnings about the grammar.
    #[getter]
    fn warnings(&self) -> Vec<String> {
        self.grammar.warnings().to_vec()
    }

    /// The vocabulary size the grammar was compiled for.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.env.vocab_size()
    }

    /// The EOS ids.
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.env.eos_token_ids().to_vec()
    }
}

/// One request's matcher, with its compiled grammar (for `reset`).
#[pyclass(name = "GrammarMatcher", module = "nucleus._core", frozen)]
pub(crate) struct PyGrammarMatcher {
    grammar: Arc<CompiledGrammar>,
    env: TokenEnv,
    matcher: Mutex<GrammarMatcher>,
}

impl PyGrammarMatcher {
    fn lock(&self) -> MutexGuard<'_, GrammarMatcher> {
        self.matcher
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[pymethods]
impl PyGrammarMatcher {
    /// A matcher in the grammar's start state.
    #[new]
    fn new(py: Python<'_>, compiled: &PyCompiledGrammar) -> Self {
        let grammar = compiled.grammar.clone();
        let matcher = py.detach(|| grammar.matcher());
        Self {
            grammar,
            env: compiled.env.clone(),
            matcher: Mutex::new(matcher),
        }
    }

    /// Fills row `index` of `bitmask` (int32 `[B, W]`, its rows' words contiguous) with the
    /// allowed tokens; no other row is read or written. Returns whether the row is not all
    /// ones over the vocabulary (XGrammar's "needs applying").
    fn fill_next_token_bitmask(
        &self,
        py: Python<'_>,
        bitmask: &Bound<'_, PyUntypedArray>,
        index: usize,
    ) -> PyResult<bool> {
        if bitmask.ndim() != 2 || !bitmask.dtype().is_equiv_to(&numpy::dtype::<i32>(py)) {
            return Err(argument_error(
                "BitmaskShape",
                "the bitmask must be a 2-D int32 array".to_string(),
            ));
        }
        // SAFETY: a live NumPy array; reading its flags is sound.
        let flags = unsafe { (*bitmask.as_array_ptr()).fields.flags };
        if flags & numpy::npyffi::NPY_ARRAY_WRITEABLE == 0 {
            return Err(argument_error(
                "BitmaskShape",
                "the bitmask is read-only: fill_next_token_bitmask writes into it".to_string(),
            ));
        }
        let (rows, words) = (bitmask.shape()[0], bitmask.shape()[1]);
        if index >= rows {
            return Err(argument_error(
                "BitmaskIndex",
                format!("index {index} is out of range: the bitmask has {rows} rows"),
            ));
        }
        let strides = bitmask.strides();
        if words > 1 && strides[1] != 4 {
            return Err(argument_error(
                "BitmaskShape",
                format!(
                    "the bitmask's rows must be contiguous (word stride {} bytes, an int32 is 4)",
                    strides[1]
                ),
            ));
        }
        if rows > 1 && words > 0 && strides[0].unsigned_abs() < words * 4 {
            return Err(argument_error(
                "BitmaskShape",
                format!(
                    "the bitmask's rows overlap (row stride {} bytes, rows of {words} words): \
                     each row needs its own memory",
                    strides[0]
                ),
            ));
        }
        // SAFETY: a live NumPy array; reading its data pointer is sound.
        let data = unsafe { (*bitmask.as_array_ptr()).fields.data.cast::<i32>() };
        if !(data as usize).is_multiple_of(std::mem::align_of::<i32>()) {
            return Err(argument_error(
                "BitmaskShape",
                "the bitmask is not aligned to 4 bytes; copy it (np.ascontiguousarray)".to_string(),
            ));
        }
        let row: &mut [u32] = if words == 0 {
            &mut []
        } else {
            // SAFETY: `index < rows`, and the row's `words` words are contiguous and no other
            // row overlaps them (checked above), so [start, start + words) lies inside the
            // array and is this row's alone. Only this row is borrowed, not the array (NumPy
            // borrow tracking would refuse threads filling other rows of one bitmask, which
            // is how engines use it): a second thread writing the *same* row at the same time
            // is the caller's race, as with XGrammar and llguidance. i32 and u32 have the same
            // size and alignment, and every bit pattern is valid for both. The array is kept
            // alive by the caller's reference for the duration of the call.
            unsafe {
                let start = data
                    .cast::<u8>()
                    .offset(index as isize * strides[0])
                    .cast::<u32>();
                std::slice::from_raw_parts_mut(start, words)
            }
        };
        let vocab = self.env.vocab_size();
        py.detach(|| {
            self.lock().fill_bitmask(row)?;
            let full = vocab / 32;
            let rest = vocab % 32;
            let all = row[..full].iter().all(|&w| w == u32::MAX)
                && (rest == 0 || row[full] & ((1u32 << rest) - 1) == (1u32 << rest) - 1);
            Ok(!all)
        })
        .map_err(|e: GrammarError| grammar_error(&e))
    }

    /// Commits `token`; the crate's errors (`TokenRejected`, `TokenOutOfRange`, `Ended`,
    /// `Matcher`) are raised, the matcher unchanged by a rejected token.
    fn commit(&self, py: Python<'_>, token: u32) -> PyResult<()> {
        py.detach(|| self.lock().commit(token))
            .map_err(|e| grammar_error(&e))
    }

    /// How many of `tokens`, from the start, the grammar accepts in a row; commits nothing.
    fn validate_tokens(&self, py: Python<'_>, tokens: Vec<u32>) -> usize {
        py.detach(|| self.lock().validate_tokens(&tokens))
    }

    /// Undoes the last `num_tokens` committed tokens (a committed EOS included).
    fn rollback(&self, py: Python<'_>, num_tokens: usize) -> PyResult<()> {
        py.detach(|| self.lock().rollback(num_tokens))
            .map_err(|e| grammar_error(&e))
    }

    /// Back to the grammar's start state (a new matcher from the compiled grammar).
    fn reset(&self, py: Python<'_>) {
        py.detach(|| *self.lock() = self.grammar.matcher());
    }

    /// The crate's `may_end`: the committed text is complete, EOS is allowed.
    fn may_end(&self, py: Python<'_>) -> bool {
        py.detach(|| self.lock().may_end())
    }

    /// The crate's `is_ended`: an EOS was committed, or nothing but EOS can follow.
    fn is_ended(&self) -> bool {
        self.lock().is_ended()
    }

    /// Tokens committed, a committed EOS included (the most `rollback` can undo).
    #[getter]
    fn num_committed(&self) -> usize {
        self.lock().committed_len()
    }

    /// llguidance's message when the matcher is in its error state, else `None`.
    #[getter]
    fn error(&self) -> Option<String> {
        self.lock().error()
    }

    /// The vocabulary size.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.env.vocab_size()
    }

    /// The EOS ids.
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.env.eos_token_ids().to_vec()
    }
}

/// Adds the grammar classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGrammarCompiler>()?;
    m.add_class::<PyCompiledGrammar>()?;
    m.add_class::<PyGrammarMatcher>()?;
    Ok(())
}
