//! [`GrammarCompiler`]: compiles grammars with llguidance for one tokenizer and caches them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::error::{GrammarError, Result};
use crate::matcher::GrammarMatcher;
use crate::tokenizer::TokenEnv;

/// The kind of a grammar: how its text is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GrammarKind {
    /// A JSON Schema document (JSON text); the output is JSON that the schema accepts.
    JsonSchema,
    /// A regular expression (Rust `regex` syntax) that the whole output must match.
    Regex,
    /// A Lark grammar in llguidance's dialect (`start: ...`; regex terminals, `%ignore`,
    /// `%json {...}` for an embedded JSON Schema).
    Lark,
}

impl std::fmt::Display for GrammarKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GrammarKind::JsonSchema => "JSON Schema",
            GrammarKind::Regex => "regular expression",
            GrammarKind::Lark => "Lark grammar",
        })
    }
}

/// A grammar to compile: its kind and its text.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GrammarSpec {
    /// A JSON Schema as JSON text. Key order matters to llguidance (object properties are
    /// generated and accepted in the schema's order), so the text is parsed with key order
    /// preserved.
    JsonSchema(String),
    /// A regular expression.
    Regex(String),
    /// A Lark grammar.
    Lark(String),
}

impl GrammarSpec {
    /// The kind of this grammar.
    pub fn kind(&self) -> GrammarKind {
        match self {
            GrammarSpec::JsonSchema(_) => GrammarKind::JsonSchema,
            GrammarSpec::Regex(_) => GrammarKind::Regex,
            GrammarSpec::Lark(_) => GrammarKind::Lark,
        }
    }

    /// The grammar's text.
    pub fn text(&self) -> &str {
        match self {
            GrammarSpec::JsonSchema(s) | GrammarSpec::Regex(s) | GrammarSpec::Lark(s) => s,
        }
    }
}

/// The default bound on JSON whitespace: at most 8 whitespace characters in a row.
pub const DEFAULT_MAX_WHITESPACE: usize = 8;

/// Compile options. They are part of the cache key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrammarOptions {
    /// JSON Schema only: the most whitespace characters (space, `\n`, `\r`, `\t`) allowed in a
    /// row between two JSON tokens (around `{ } [ ] , :` and values), in masks and in
    /// validation alike. Default `Some(8)`, so a model cannot loop on newlines. `Some(0)` allows
    /// no whitespace at all (compact JSON: `{"a":1,"b":2}`); `None` leaves it unbounded
    /// (llguidance's default). No whitespace is allowed before the top-level value.
    ///
    /// Implemented with llguidance's `x-guidance` JSON options (`whitespace_pattern`
    /// `[\x20\x0A\x0D\x09]{1,N}`, matched at most once between two tokens;
    /// `whitespace_flexible: false` for 0). A schema that sets `whitespace_pattern` or
    /// `whitespace_flexible` in its own top-level `x-guidance` object keeps its setting.
    /// Ignored for regular expressions and Lark grammars, whose text says where whitespace goes.
    pub max_whitespace: Option<usize>,
}

impl Default for GrammarOptions {
    fn default() -> Self {
        GrammarOptions {
            max_whitespace: Some(DEFAULT_MAX_WHITESPACE),
        }
    }
}

/// A compiled grammar: a matcher template in its start state. Shared (`Arc`) by the cache and
/// every request that uses it; [`CompiledGrammar::matcher`] gives each request its own
/// independent copy.
pub struct CompiledGrammar {
    kind: GrammarKind,
    template: Mutex<Matcher>,
    env: TokenEnv,
    warnings: Vec<String>,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar")
            .field("kind", &self.kind)
            .field("warnings", &self.warnings)
            .finish_non_exhaustive()
    }
}

impl CompiledGrammar {
    /// A new matcher in the grammar's start state: a deep copy of the template (llguidance's
    /// `deep_clone`, tens of µs), independent of every other matcher.
    pub fn matcher(&self) -> GrammarMatcher {
        let template = self
            .template
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        GrammarMatcher::new(template.deep_clone(), self.env.clone())
    }

    /// The grammar's kind.
    pub fn kind(&self) -> GrammarKind {
        self.kind
    }

    /// llguidance's warnings about the grammar (e.g. JSON Schema keywords it ignores, such as
    /// `format` values it does not know).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
}

type Entry = Arc<OnceLock<Result<Arc<CompiledGrammar>>>>;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    spec: GrammarSpec,
    options: GrammarOptions,
}

struct Cache {
    entries: HashMap<CacheKey, (Entry, u64)>,
    clock: u64,
}

/// Compiles grammars for one tokenizer and caches them.
///
/// Owns one llguidance `ParserFactory` (its token slicer costs ~0.2 s at a 32k vocabulary,
/// once) and a cache of compiled grammars keyed by grammar kind, text and options, so one
/// compilation serves every request with the same grammar: [`compile`](Self::compile)
/// returns the same `Arc` for equal keys. A failed compilation is cached too (compilation is
/// deterministic). Concurrent requests for one new key compile it once; the others wait for
/// it. At most `capacity` grammars are kept (default [`GrammarCompiler::DEFAULT_CAPACITY`]);
/// beyond that the least recently used one is dropped (requests holding it keep it).
///
/// `Send + Sync`: share one per model across threads.
pub struct GrammarCompiler {
    env: TokenEnv,
    factory: ParserFactory,
    cache: Mutex<Cache>,
    capacity: usize,
    compilations: AtomicU64,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("env", &self.env)
            .field("capacity", &self.capacity)
            .field("compilations", &self.compilations())
            .finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// Grammars kept by [`GrammarCompiler::new`].
    pub const DEFAULT_CAPACITY: usize = 1024;

    /// A compiler for `env`'s tokenizer, keeping up to [`Self::DEFAULT_CAPACITY`] grammars.
    ///
    /// Errors: [`GrammarError::Tokenizer`] when llguidance cannot set up its token slicer.
    pub fn new(env: TokenEnv) -> Result<Self> {
        Self::with_capacity(env, Self::DEFAULT_CAPACITY)
    }

    /// A compiler keeping up to `capacity` grammars (at least 1).
    ///
    /// Errors: as [`GrammarCompiler::new`].
    pub fn with_capacity(env: TokenEnv, capacity: usize) -> Result<Self> {
        let mut factory = ParserFactory::new_simple(env.tok_env())
            .map_err(|e| GrammarError::Tokenizer(format!("llguidance parser factory: {e}")))?;
        // No llguidance logging on stderr: warnings are returned by CompiledGrammar::warnings.
        factory.quiet();
        Ok(GrammarCompiler {
            env,
            factory,
            cache: Mutex::new(Cache {
                entries: HashMap::new(),
                clock: 0,
            }),
            capacity: capacity.max(1),
            compilations: AtomicU64::new(0),
        })
    }

    /// The token environment grammars are compiled for.
    pub fn token_env(&self) -> &TokenEnv {
        &self.env
    }

    /// Compiles `spec` with `options`, or returns the cached result.
    ///
    /// Errors: [`GrammarError::InvalidSchemaJson`] for JSON Schema text that is not JSON;
    /// [`GrammarError::Compile`] with llguidance's message for a grammar it rejects
    /// (unsupported JSON Schema keywords such as `oneOf`, a bad regex, a Lark syntax error).
    pub fn compile(
        &self,
        spec: &GrammarSpec,
        options: &GrammarOptions,
    ) -> Result<Arc<CompiledGrammar>> {
        let options = match spec.kind() {
            GrammarKind::JsonSchema => *options,
            // Options only affect JSON: one cache entry per regex / Lark text.
            _ => GrammarOptions::default(),
        };
        let key = CacheKey {
            spec: spec.clone(),
            options,
        };
        let entry = {
            let mut cache = self
                .cache
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            cache.clock += 1;
            let now = cache.clock;
            if let Some((entry, used)) = cache.entries.get_mut(&key) {
                *used = now;
                entry.clone()
            } else {
                if cache.entries.len() >= self.capacity {
                    let oldest = cache
                        .entries
                        .iter()
                        .min_by_key(|(_, (_, used))| *used)
                        .map(|(k, _)| k.clone());
                    if let Some(oldest) = oldest {
                        cache.entries.remove(&oldest);
                    }
                }
                let entry: Entry = Arc::new(OnceLock::new());
                cache.entries.insert(key, (entry.clone(), now));
                entry
            }
        };
        entry
            .get_or_init(|| {
                self.compilations.fetch_add(1, Ordering::Relaxed);
                self.compile_uncached(spec, &options).map(Arc::new)
            })
            .clone()
    }

    /// A matcher for `spec` in its start state: [`compile`](Self::compile) (cached) then
    /// [`CompiledGrammar::matcher`].
    ///
    /// Errors: as [`compile`](Self::compile).
    pub fn matcher(&self, spec: &GrammarSpec, options: &GrammarOptions) -> Result<GrammarMatcher> {
        Ok(self.compile(spec, options)?.matcher())
    }

    /// How many compilations ran (cache misses), since this compiler was made.
    pub fn compilations(&self) -> u64 {
        self.compilations.load(Ordering::Relaxed)
    }

    /// How many grammars the cache holds.
    pub fn cached_grammars(&self) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entries
            .len()
    }

    /// Empties the cache (matchers and `Arc`s already handed out stay valid).
    pub fn clear_cache(&self) {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entries
            .clear();
    }

    fn compile_uncached(
        &self,
        spec: &GrammarSpec,
        options: &GrammarOptions,
    ) -> Result<CompiledGrammar> {
        let _span = tracing::debug_span!("grammar_compile", kind = %spec.kind()).entered();
        let kind = spec.kind();
        let grammar = match spec {
            GrammarSpec::JsonSchema(text) => {
                let mut schema: Value = serde_json::from_str(text)
                    .map_err(|e| GrammarError::InvalidSchemaJson(e.to_string()))?;
                apply_json_options(&mut schema, options);
                TopLevelGrammar::from_json_schema(schema)
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let compiled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Matcher::new(self.factory.create_parser(grammar))
        }));
        let mut template = compiled.map_err(|_| GrammarError::Compile {
            kind,
            message: "llguidance panicked while compiling".to_string(),
        })?;
        if let Some(message) = template.get_error() {
            return Err(GrammarError::Compile { kind, message });
        }
        let warnings = template.grammar_warnings();
        Ok(CompiledGrammar {
            kind,
            template: Mutex::new(template),
            env: self.env.clone(),
            warnings,
        })
    }
}

/// Writes `options` into the schema's top-level `x-guidance` object (llguidance's per-schema
/// JSON options), keeping whitespace settings the schema already has there.
fn apply_json_options(schema: &mut Value, options: &GrammarOptions) {
    let Some(max) = options.max_whitespace else {
        return;
    };
    if *schema == Value::Bool(true) {
        // `true` accepts everything, as `{}` does; only an object can carry x-guidance.
        *schema = Value::Object(Default::default());
    }
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    let guidance = object
        .entry("x-guidance")
        .or_insert_with(|| Value::Object(Default::default()));
    let Some(guidance) = guidance.as_object_mut() else {
        // Not an object: llguidance reports it as a compile error.
        return;
    };
    if guidance.contains_key("whitespace_pattern") || guidance.contains_key("whitespace_flexible") {
        return;
    }
    if max == 0 {
        guidance.insert("whitespace_flexible".to_string(), Value::Bool(false));
    } else {
        guidance.insert(
            "whitespace_pattern".to_string(),
            Value::String(format!(r"[\x20\x0A\x0D\x09]{{1,{max}}}")),
        );
    }
}
