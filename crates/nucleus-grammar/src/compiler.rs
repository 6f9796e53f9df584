//! [`GrammarCompiler`]: compiles grammars with llguidance for one tokenizer and caches them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::depth::{
    json_text_depth, lark_depth, schema_depth, COMPILE_STACK_BYTES, MAX_GRAMMAR_DEPTH,
};
use crate::error::{GrammarError, Result};
use crate::matcher::{on_stack, GrammarMatcher};
use crate::relax;
use crate::schema_validator::{SchemaValidator, SchemaValidatorError, SchemaVerdict};
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
    /// JSON Schema only: what to do with a schema llguidance cannot compile exactly. Default
    /// [`JsonSchemaMode::Strict`]. Ignored for regular expressions and Lark grammars.
    pub json_schema_mode: JsonSchemaMode,
}

impl Default for GrammarOptions {
    fn default() -> Self {
        GrammarOptions {
            max_whitespace: Some(DEFAULT_MAX_WHITESPACE),
            json_schema_mode: JsonSchemaMode::Strict,
        }
    }
}

/// How a JSON Schema that llguidance cannot compile exactly is handled
/// ([`GrammarOptions::json_schema_mode`]).
///
/// Either way the schema is first compiled exactly (llguidance 1.9 with its lenient options
/// off), and a schema that compiles so is used as it is: [`CompiledGrammar::relaxed`] is
/// empty. In both modes [`CompiledGrammar::validate_json`] checks a finished text against the
/// original schema exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum JsonSchemaMode {
    /// Refuse the schema ([`GrammarError::Compile`] with llguidance's message, e.g.
    /// `Unimplemented keys: ["not"]`, `oneOf constraints are not supported`): the mask then
    /// never lets through a text the schema rejects (llguidance's property-order rule aside,
    /// which is a narrowing).
    #[default]
    Strict,
    /// Compile the narrowest schema llguidance supports that contains the original, so that
    /// the mask accepts every text the schema accepts, and maybe some it rejects (validate the
    /// result with [`CompiledGrammar::validate_json`]). Relaxations, each only widening:
    ///
    /// - llguidance's `lenient` option (its `x-guidance` JSON option, set unless the schema's
    ///   top-level `x-guidance` sets `lenient` itself): keywords it does not implement are
    ///   ignored (`not`, `uniqueItems`, `dependencies`, `dependentRequired`,
    ///   `dependentSchemas`, `propertyNames`, `contains`, `unevaluatedProperties`, ...), an
    ///   unknown `format` is a plain string (known ones, `date-time`, `date`, `time`, `email`,
    ///   `uuid`, `ipv4`, `ipv6`, `uri`, ..., stay enforced), `oneOf` is compiled as `anyOf`,
    ///   each with one of llguidance's warnings ([`CompiledGrammar::warnings`]);
    /// - `minProperties` / `maxProperties` where llguidance cannot count properties (beside
    ///   optional `properties`): dropped from those schema objects (then from all, if needed).
    ///   Not left to lenient mode, whose fallback there narrows (it refuses `{"a": 1}` under
    ///   `"minProperties": 1` with `a` optional);
    /// - `if`/`then`/`else` with both branches (drafts 7 and later) as the union
    ///   `anyOf: [then, else]`; with one branch missing the union is everything, and lenient
    ///   mode drops the conditional (also the fallback when the union does not compile);
    /// - overlapping `patternProperties` (llguidance needs them disjoint): merged into one
    ///   pattern `(?:p1)|(?:p2)` whose schema is `anyOf` of theirs; if that still overlaps
    ///   (across an `allOf`), `patternProperties` and `additionalProperties` are dropped where
    ///   patterns are;
    /// - a circular `$ref` with sibling keywords: the assertion keywords beside the `$ref`s
    ///   naming the reported target are dropped (then beside every `$ref`, if needed); where
    ///   llguidance still intersects the target while defining it (a named property with the
    ///   `patternProperties` schema its name matches, an `allOf`), `patternProperties` are
    ///   dropped as above, and last the `$ref`s to that target themselves;
    /// - a `pattern` llguidance's regex syntax cannot parse (look-around, backreferences):
    ///   dropped where `regex_syntax` refuses it (then every `pattern`, if needed);
    /// - a number bound llguidance cannot write as a regular expression (`maximum: 1e308`,
    ///   from about 1e20 in magnitude; for integers from about 1e18): dropped, the bound named
    ///   in its message with the largest magnitude first, one per attempt; bounds beyond the
    ///   i64 range, on which llguidance's internal overflow check fails, are dropped, and so
    ///   is a fractional `multipleOf` when that check fails on it (`1e-10`).
    ///
    /// [`CompiledGrammar::relaxed`] names the families relaxed. A schema that no relaxation
    /// makes compilable is refused as in strict mode, with the last attempt's message.
    Relaxed,
}

/// A compiled grammar: a matcher template in its start state. Shared (`Arc`) by the cache and
/// every request that uses it; [`CompiledGrammar::matcher`] gives each request its own
/// independent copy.
pub struct CompiledGrammar {
    kind: GrammarKind,
    template: Mutex<Matcher>,
    env: TokenEnv,
    warnings: Vec<String>,
    relaxed: Vec<String>,
    /// The JSON Schema text as given (JSON Schema grammars only).
    schema: Option<String>,
    /// Built on first use by [`CompiledGrammar::validate_json`].
    validator: OnceLock<Result<SchemaValidator, SchemaValidatorError>>,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar")
            .field("kind", &self.kind)
            .field("warnings", &self.warnings)
            .field("relaxed", &self.relaxed)
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
        GrammarMatcher::new(on_stack(|| template.deep_clone()), self.env.clone())
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

    /// The JSON Schema keyword families relaxed to compile this grammar
    /// ([`JsonSchemaMode::Relaxed`]), sorted and without duplicates: keyword names (`not`,
    /// `oneOf`, `uniqueItems`, `dependencies`, `propertyNames`, `patternProperties`, `$ref`
    /// for a circular reference's siblings, `pattern`, ...), `if/then/else`,
    /// `min/maxProperties`, `minimum/maximum`, `multipleOf`, and `format:<name>` for each
    /// unknown format. Empty when the schema compiled exactly (always
    /// so in strict mode and for regular expressions and Lark grammars).
    pub fn relaxed(&self) -> &[String] {
        &self.relaxed
    }

    /// The JSON Schema text as it was given to [`GrammarCompiler::compile`] (before any
    /// relaxation or `x-guidance` option was applied); `None` for regular expressions and
    /// Lark grammars.
    pub fn original_schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// Validates a finished JSON text exactly against the original schema
    /// ([`original_schema`](Self::original_schema)) with the `jsonschema` crate: see
    /// [`SchemaValidator::validate`] for the verdict and its semantics. The validator is built
    /// on the first call and kept (a build error too). `None` for regular expressions and
    /// Lark grammars.
    ///
    /// Errors: the validator cannot be built for the schema (e.g. a `$ref` to another
    /// document, a `$schema` naming no known draft), or the text nests deeper than
    /// [`MAX_GRAMMAR_DEPTH`]; see [`SchemaValidatorError`].
    pub fn validate_json(
        &self,
        text: &str,
    ) -> Option<std::result::Result<SchemaVerdict, SchemaValidatorError>> {
        let schema = self.schema.as_deref()?;
        let validator = self.validator.get_or_init(|| SchemaValidator::new(schema));
        Some(match validator {
            Ok(v) => v.validate(text),
            Err(e) => Err(e.clone()),
        })
    }
    /// The final verdict on a completion generated under this JSON Schema grammar: `complete`
    /// says whether the grammar could end after the completion's tokens (the engine's
    /// `StepOutput::grammar_complete`). An incomplete completion (cut by a token limit) is
    /// `Invalid` at the root with the message [`INCOMPLETE`], without validating; a complete
    /// one is [`validate_json`](Self::validate_json)'s verdict on `text`. `None` for regular
    /// expressions and Lark grammars.
    ///
    /// Errors: as [`validate_json`](Self::validate_json).
    pub fn check_completion(
        &self,
        text: &str,
        complete: bool,
    ) -> Option<std::result::Result<SchemaVerdict, SchemaValidatorError>> {
        self.schema.as_ref()?;
        if !complete {
            return Some(Ok(SchemaVerdict::Invalid {
                instance_path: String::new(),
                message: INCOMPLETE.to_string(),
            }));
        }
        self.validate_json(text)
    }
}

/// The message of [`CompiledGrammar::check_completion`]'s verdict on a completion that ended
/// (by a token limit) before its grammar could end.
pub const INCOMPLETE: &str = "incomplete";

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
    /// Compilation runs on a thread of its own with a 64 MiB stack, after the grammar's depth
    /// is bounded (see [`MAX_GRAMMAR_DEPTH`]), so no grammar can overflow a stack; the
    /// grammar's first mask is computed once here, so that a grammar that can never produce a
    /// token is a compile error rather than a failure of every request's first step.
    ///
    /// Errors: [`GrammarError::InvalidSchemaJson`] for JSON Schema text that is not JSON;
    /// [`GrammarError::TooDeep`] for a grammar nested deeper than [`MAX_GRAMMAR_DEPTH`];
    /// [`GrammarError::Compile`] with llguidance's message for a grammar it rejects
    /// (unsupported JSON Schema keywords such as `oneOf`, a bad regex, a Lark syntax error,
    /// a grammar too large for llguidance's limits), or one that matches no text at all (a
    /// JSON Schema `{"$ref": "#"}`).
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

    /// Compiles `spec` on a thread of its own whose stack (`COMPILE_STACK_BYTES`, 64 MiB) holds
    /// llguidance's recursion for any grammar within [`MAX_GRAMMAR_DEPTH`], so the caller's
    /// stack (2 MiB on tokio's blocking threads and most spawned threads) does not matter.
    fn compile_uncached(
        &self,
        spec: &GrammarSpec,
        options: &GrammarOptions,
    ) -> Result<CompiledGrammar> {
        let kind = spec.kind();
        std::thread::scope(|scope| {
            let thread = std::thread::Builder::new()
                .name("nucleus-grammar-compile".to_string())
                .stack_size(COMPILE_STACK_BYTES)
                .spawn_scoped(scope, || self.compile_here(spec, options))
                .map_err(|e| GrammarError::Compile {
                    kind,
                    message: format!("cannot start a thread to compile on: {e}"),
                })?;
            thread.join().unwrap_or_else(|_| {
                Err(GrammarError::Compile {
                    kind,
                    message: "internal error: compilation panicked".to_string(),
                })
            })
        })
    }

    /// Checks the depth of `spec`, compiles it with llguidance, and computes its first mask
    /// once, so that a grammar that can never produce a token fails here rather than at every
    /// request's first step.
    fn compile_here(
        &self,
        spec: &GrammarSpec,
        options: &GrammarOptions,
    ) -> Result<CompiledGrammar> {
        let _span = tracing::debug_span!("grammar_compile", kind = %spec.kind()).entered();
        let kind = spec.kind();
        let too_deep = |depth: u64, what: &'static str| GrammarError::TooDeep {
            kind,
            depth,
            limit: MAX_GRAMMAR_DEPTH,
            what,
        };
        let grammar = match spec {
            GrammarSpec::JsonSchema(text) => {
                let nesting = json_text_depth(text.as_bytes());
                if nesting > MAX_GRAMMAR_DEPTH {
                    return Err(too_deep(
                        nesting as u64,
                        "levels of nested JSON arrays and objects",
                    ));
                }
                // Within the bound just checked, so the parser's own limit (128) is not needed.
                let mut de = serde_json::Deserializer::from_str(text);
                de.disable_recursion_limit();
                let schema = serde::Deserialize::deserialize(&mut de)
                    .and_then(|v: Value| de.end().map(|()| v))
                    .map_err(|e| GrammarError::InvalidSchemaJson(e.to_string()))?;
                let depth = schema_depth(&schema);
                if depth > MAX_GRAMMAR_DEPTH as u64 {
                    return Err(too_deep(depth, "levels of nested subschemas and `$ref`s"));
                }
                return self.compile_json(text, schema, options);
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(text) => {
                let depth = lark_depth(text);
                if depth > MAX_GRAMMAR_DEPTH as u64 {
                    return Err(too_deep(depth, "levels of rule references"));
                }
                TopLevelGrammar::from_lark(text.clone())
            }
        };
        let template = self.build(kind, grammar).map_err(Built::into_error)?;
        Ok(self.finish(kind, template, Vec::new(), None))
    }

    /// A [`CompiledGrammar`] around `template`.
    fn finish(
        &self,
        kind: GrammarKind,
        mut template: Matcher,
        relaxed: Vec<String>,
        schema: Option<String>,
    ) -> CompiledGrammar {
        let warnings = template.grammar_warnings();
        CompiledGrammar {
            kind,
            template: Mutex::new(template),
            env: self.env.clone(),
            warnings,
            relaxed,
            schema,
            validator: OnceLock::new(),
        }
    }

    /// Compiles the JSON Schema `schema` (parsed from `text`, its depth checked): exactly
    /// first, then, in [`JsonSchemaMode::Relaxed`] and only if llguidance refused the schema
    /// itself (not its first steps), relaxed as [`JsonSchemaMode::Relaxed`] documents: each
    /// attempt compiles the original schema with lenient mode and the rewrites that the
    /// previous attempts' errors called for, at most [`MAX_RELAXED_ATTEMPTS`] attempts.
    fn compile_json(
        &self,
        text: &str,
        schema: Value,
        options: &GrammarOptions,
    ) -> Result<CompiledGrammar> {
        let kind = GrammarKind::JsonSchema;
        let mut exact = schema.clone();
        apply_json_options(&mut exact, options);
        let mut last = match self.build(kind, TopLevelGrammar::from_json_schema(exact)) {
            Ok(template) => return Ok(self.finish(kind, template, Vec::new(), Some(text.into()))),
            Err(Built::Compile(e)) if options.json_schema_mode == JsonSchemaMode::Relaxed => e,
            Err(e) => return Err(e.into_error()),
        };
        // What the attempts rewrite: if/then/else as a union (only if the schema has such a
        // conditional); patternProperties 0 untouched, 1 merged, 2 dropped; the $ref targets
        // whose siblings are dropped (None: every $ref).
        let mut plan = Plan {
            union: relax::conditionals_as_union(&mut schema.clone()),
            patterns: 0,
            ref_targets: Vec::new(),
            cut_refs: Vec::new(),
            min_max: 0,
            bad_patterns: 0,
            number_bounds: Vec::new(),
            huge_bounds: false,
            multiple_of: false,
        };
        for _ in 0..MAX_RELAXED_ATTEMPTS {
            let mut attempt = plan.apply(&schema);
            if schema_depth(&attempt) > MAX_GRAMMAR_DEPTH as u64 {
                // Only the union and the merge nest deeper; their fallbacks do not.
                if plan.union {
                    plan.union = false;
                } else {
                    plan.patterns = 2;
                }
                continue;
            }
            set_lenient(&mut attempt);
            apply_json_options(&mut attempt, options);
            let error = match self.build(kind, TopLevelGrammar::from_json_schema(attempt)) {
                Ok(mut template) => {
                    let warnings = template.grammar_warnings();
                    if plan.min_max < 2
                        && warnings
                            .iter()
                            .any(|w| w.starts_with(relax::MIN_MAX_WARNING))
                    {
                        // llguidance's lenient fallback here narrows (it rejects `{"a": 1}`
                        // under minProperties 1 with optional properties): drop the keywords
                        // ourselves instead.
                        plan.min_max += 1;
                        continue;
                    }
                    let mut families = plan.families();
                    relax::families_from_warnings(&warnings, &mut families);
                    let relaxed = families.into_iter().collect();
                    return Ok(self.finish(kind, template, relaxed, Some(text.into())));
                }
                Err(e) => e,
            };
            let (Built::Compile(error) | Built::FirstStep(error)) = error;
            let message = match &error {
                GrammarError::Compile { message, .. } => message.clone(),
                other => other.to_string(),
            };
            last = error;
            const CIRCULAR: &str = "circular references with sibling keys are not supported: ";
            if message.contains("patternProperty regexes") && plan.patterns < 2 {
                plan.patterns += 1;
            } else if let Some(i) = message.find(CIRCULAR) {
                let uri = message[i + CIRCULAR.len()..].trim().to_string();
                // Siblings beside the $refs to the target, then beside every $ref; then the
                // intersections llguidance makes of a named property with the
                // patternProperties its name matches (patternProperties dropped); then the
                // $refs to the target themselves.
                match plan.ref_targets.last() {
                    None => plan.ref_targets.push(Some(uri)),
                    Some(Some(_)) => plan.ref_targets.push(None),
                    Some(None) if plan.patterns < 2 => plan.patterns = 2,
                    Some(None) if !plan.cut_refs.contains(&uri) => plan.cut_refs.push(uri),
                    Some(None) => break,
                }
            } else if message.contains("regex parse error") && plan.bad_patterns < 2 {
                // The patterns the regex parser refuses, then every pattern.
                plan.bad_patterns += 1;
            } else if message.contains(relax::NEGATE_OVERFLOW) && !plan.huge_bounds {
                plan.huge_bounds = true;
            } else if message.contains(relax::MULTIPLY_OVERFLOW) && !plan.multiple_of {
                plan.multiple_of = true;
            } else if message.contains(relax::FLOAT_RANGE) || message.contains(relax::INTEGER_RANGE)
            {
                // One bound per attempt, the largest in magnitude first: a range such as
                // [-1e308, 3] keeps its maximum of 3 when dropping the minimum suffices.
                let widest = relax::range_bounds(&message)
                    .into_iter()
                    .filter(|b| !plan.number_bounds.contains(b))
                    .max_by(|a, b| a.abs().total_cmp(&b.abs()));
                match widest {
                    Some(bound) => plan.number_bounds.push(bound),
                    None => break,
                }
            } else if plan.union {
                // The union did not compile (or matched nothing): let lenient mode drop it.
                plan.union = false;
            } else {
                break;
            }
        }
        Err(last)
    }

    /// Compiles `grammar` with llguidance and runs its first steps on a copy.
    fn build(&self, kind: GrammarKind, grammar: TopLevelGrammar) -> Result<Matcher, Built> {
        let compiled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Matcher::new(self.factory.create_parser(grammar))
        }));
        let template = compiled.map_err(|_| {
            Built::Compile(GrammarError::Compile {
                kind,
                message: "llguidance panicked while compiling".to_string(),
            })
        })?;
        if let Some(message) = template.get_error() {
            return Err(Built::Compile(GrammarError::compile(kind, &message)));
        }
        // The first step, on a copy: errors that llguidance only finds when it computes a mask
        // or takes a token (a grammar that matches nothing, a lexer whose states explode, as
        // with `a{1000}{1000}`) belong to the grammar, not to every request's first step.
        // The probe is cancellable: a watchdog cancels it after FIRST_STEP_LIMIT, so a grammar
        // on which llguidance does not settle (it forces bytes forever on `start: A B` with
        // `A: /a+/` and `B: /a+/`) is refused instead of holding its caller, and the memory
        // llguidance grows meanwhile, without bound.
        let mut probe = template.deep_clone().into_cancellable();
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let watchdog = probe.cancellation_handle().map(|handle| {
            std::thread::spawn(move || {
                if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    finished.recv_timeout(FIRST_STEP_LIMIT)
                {
                    handle.cancel();
                }
            })
        });
        let outcome = self.first_steps(kind, &mut probe);
        drop(done);
        if let Some(w) = watchdog {
            let _ = w.join();
        }
        outcome.map_err(Built::FirstStep)?;
        Ok(template)
    }
}

/// The most compile attempts of a relaxed JSON Schema after the exact one (each rewrite step
/// takes one: the union's fallback, two for patternProperties, two for `$ref` siblings, one
/// per `$ref` target cut, two for min/maxProperties, two for patterns, one per number bound
/// dropped, one each for bounds beyond i64 and fractional `multipleOf`).
const MAX_RELAXED_ATTEMPTS: usize = 40;

/// Why [`GrammarCompiler::build`] failed: llguidance refused the grammar, or its first steps
/// failed (a grammar that matches nothing, a lexer limit, no settling in time), which no
/// relaxation is tried for.
enum Built {
    Compile(GrammarError),
    FirstStep(GrammarError),
}

impl Built {
    fn into_error(self) -> GrammarError {
        match self {
            Built::Compile(e) | Built::FirstStep(e) => e,
        }
    }
}

/// The rewrites of a relaxed compile attempt (see [`GrammarCompiler::compile_json`]).
struct Plan {
    union: bool,
    patterns: u8,
    ref_targets: Vec<Option<String>>,
    cut_refs: Vec<String>,
    /// `minProperties` / `maxProperties`: 0 untouched, 1 dropped beside optional properties,
    /// 2 dropped everywhere.
    min_max: u8,
    /// `pattern`: 0 untouched, 1 dropped where the regex parser refuses it, 2 dropped
    /// everywhere.
    bad_patterns: u8,
    /// Number bounds llguidance cannot compile, dropped.
    number_bounds: Vec<f64>,
    /// Bounds beyond the i64 range dropped.
    huge_bounds: bool,
    /// Fractional `multipleOf` dropped.
    multiple_of: bool,
}

impl Plan {
    /// The original `schema` with this plan's rewrites.
    fn apply(&self, schema: &Value) -> Value {
        let mut schema = schema.clone();
        if self.union {
            relax::conditionals_as_union(&mut schema);
        }
        match self.patterns {
            0 => {}
            1 => {
                relax::merge_pattern_properties(&mut schema);
            }
            _ => {
                relax::drop_pattern_properties(&mut schema);
            }
        }
        for target in &self.ref_targets {
            relax::drop_ref_siblings(&mut schema, target.as_deref());
        }
        for target in &self.cut_refs {
            relax::drop_refs(&mut schema, target);
        }
        if self.min_max > 0 {
            relax::drop_property_counts(&mut schema, self.min_max > 1);
        }
        if self.bad_patterns > 0 {
            relax::drop_patterns(&mut schema, self.bad_patterns > 1);
        }
        if !self.number_bounds.is_empty() {
            relax::drop_number_bounds(&mut schema, &self.number_bounds);
        }
        if self.huge_bounds {
            relax::drop_bounds_beyond_i64(&mut schema);
        }
        if self.multiple_of {
            relax::drop_fractional_multiple_of(&mut schema);
        }
        schema
    }

    /// The families this plan's rewrites relax.
    fn families(&self) -> std::collections::BTreeSet<String> {
        let mut families = std::collections::BTreeSet::new();
        if self.union {
            families.insert("if/then/else".to_string());
        }
        if self.patterns > 0 {
            families.insert("patternProperties".to_string());
        }
        if self.min_max > 0 {
            families.insert("min/maxProperties".to_string());
        }
        if !self.ref_targets.is_empty() || !self.cut_refs.is_empty() {
            families.insert("$ref".to_string());
        }
        if self.bad_patterns > 0 {
            families.insert("pattern".to_string());
        }
        if !self.number_bounds.is_empty() || self.huge_bounds {
            families.insert("minimum/maximum".to_string());
        }
        if self.multiple_of {
            families.insert("multipleOf".to_string());
        }
        families
    }
}

/// Sets llguidance's `lenient` JSON option in the schema's top-level `x-guidance` object,
/// unless the schema sets it there itself.
fn set_lenient(schema: &mut Value) {
    if *schema == Value::Bool(true) {
        *schema = Value::Object(Default::default());
    }
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    let guidance = object
        .entry("x-guidance")
        .or_insert_with(|| Value::Object(Default::default()));
    if let Some(guidance) = guidance.as_object_mut() {
        guidance.entry("lenient").or_insert(Value::Bool(true));
    }
}

/// How long a grammar's first steps may take in [`GrammarCompiler::compile`] before the
/// grammar is refused.
pub const FIRST_STEP_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

impl GrammarCompiler {
    /// The first mask, and one token and the mask after it, on `probe`; the errors that
    /// belong to the grammar.
    fn first_steps(&self, kind: GrammarKind, probe: &mut Matcher) -> Result<()> {
        let cancelled = |probe: &Matcher| {
            probe.is_cancelled().then(|| {
                GrammarError::compile(
                    kind,
                    &format!(
                        "llguidance did not settle the grammar's first steps within {} s: two \
                         lexemes that can match the same text in a row (as `start: A B` with \
                         `A: /a+/` and `B: /a+/`, where a greedy lexer never ends A) keep it \
                         forcing bytes",
                        FIRST_STEP_LIMIT.as_secs()
                    ),
                )
            })
        };
        let first = match probe.compute_mask_or_eos() {
            Ok(first) => first,
            Err(e) => {
                return Err(
                    cancelled(probe).unwrap_or_else(|| first_step_error(kind, &e.to_string()))
                )
            }
        };
        let eos = self.env.eos_token_ids();
        if let Some(token) = first.iter().find(|t| !eos.contains(t)) {
            // Only a lexer limit counts here: that one token may lead to a dead end (`ac|b`
            // after `a`, with no token `c`) while others do not.
            let step = probe
                .consume_token(token)
                .and_then(|()| probe.compute_mask_or_eos().map(drop));
            if let Err(e) = step {
                if let Some(e) = cancelled(probe) {
                    return Err(e);
                }
                let message = e.to_string();
                if is_lexer_limit(&message) {
                    return Err(first_step_error(kind, &message));
                }
            }
        }
        Ok(())
    }
}

/// Whether llguidance's error `message` is one of its lexer's limits (derivre's
/// `too many expressions constructed`, `too many states`, a lexer `too complex`).
fn is_lexer_limit(message: &str) -> bool {
    message.contains("too many expressions")
        || message.contains("too many states")
        || message.contains("too complex")
}

/// The compile error for llguidance's error `message` in a grammar's first step.
fn first_step_error(kind: GrammarKind, message: &str) -> GrammarError {
    let message = if message.contains("NoExtensionBias") {
        "the grammar matches no text: no token can begin a text it accepts and the empty text \
         does not match it (e.g. a JSON Schema whose `$ref` leads only back to itself, such as \
         {\"$ref\": \"#\"}, or a grammar that needs characters no token of this vocabulary has)"
            .to_string()
    } else if is_lexer_limit(message) {
        format!(
            "the grammar is too large for llguidance's lexer ({}): counted repetitions of \
             hundreds of thousands of copies, such as `a{{300000}}` or `a{{1000}}{{1000}}`, \
             make more states than it can build",
            message.lines().next().unwrap_or("").trim()
        )
    } else {
        message.to_string()
    };
    GrammarError::compile(kind, &message)
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
