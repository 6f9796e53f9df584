//! Structured output for nucleus: constrain each generated token to a JSON Schema, a regular
//! expression or a Lark grammar.
//!
//! The grammar engine is [llguidance](https://github.com/guidance-ai/llguidance) (1.9); this
//! crate adapts it to a decode loop that works on token bitmasks, with typed errors and no
//! panics on bad input. Use it between the LM head and the sampler: each step, fill the
//! request's bitmask row, mask the logits of disallowed ids to -inf, sample, commit the token.
//!
//! Key types:
//! - [`TokenEnv`]: the bytes of every token, the vocabulary size (the logits row width) and
//!   the EOS ids, built from a Hugging Face `tokenizers::Tokenizer` (byte-level BPE such as
//!   MiniMind's `tokenizer.json`, or a GGUF SentencePiece tokenizer as nucleus-engine builds
//!   it).
//! - [`GrammarCompiler`]: one per tokenizer; compiles a [`GrammarSpec`] with
//!   [`GrammarOptions`] (JSON whitespace bound, default 8) and caches the result, so one
//!   compilation serves every request with the same grammar.
//! - [`GrammarMatcher`]: one per request; [`fill_bitmask`](GrammarMatcher::fill_bitmask),
//!   [`validate_tokens`](GrammarMatcher::validate_tokens), [`commit`](GrammarMatcher::commit),
//!   [`rollback`](GrammarMatcher::rollback), [`may_end`](GrammarMatcher::may_end),
//!   [`is_ended`](GrammarMatcher::is_ended). [`fill_bitmasks`] fills a batch in parallel.
//! - [`validate_text`]: does a whole text match (`nucleus grammar validate`)?
//!
//! - [`SchemaValidator`], [`validate_json_instance`], [`CompiledGrammar::validate_json`]: the
//!   exact verdict of the `jsonschema` crate on a finished JSON text ([`SchemaVerdict`]).
//!
//! # Strict and relaxed JSON Schemas
//!
//! [`GrammarOptions::json_schema_mode`] says what happens to a JSON Schema llguidance cannot
//! compile exactly (about one real-world schema in eight uses `not`, a non-disjoint `oneOf`,
//! an unknown `format`, `dependencies`, ...). [`JsonSchemaMode::Strict`] (the default) refuses
//! it. [`JsonSchemaMode::Relaxed`] compiles the narrowest schema llguidance supports that
//! contains the original (llguidance's `lenient` option plus this crate's rewrites, each only
//! widening; the list is on [`JsonSchemaMode::Relaxed`]) and names the keyword families
//! relaxed in [`CompiledGrammar::relaxed`]; a schema that compiles exactly is never relaxed.
//! A relaxed mask may let through a text the schema rejects, so check every finished text
//! with [`CompiledGrammar::validate_json`]: the `jsonschema` crate (drafts 4 to 2020-12, the
//! draft from `$schema`, formats asserted, nothing fetched) against the original schema
//! ([`CompiledGrammar::original_schema`]), giving `Valid` or the JSON pointer and message of
//! the first error.
//!
//! Semantics follow seed 001 §05-07 of the project: a token is allowed when appending its bytes
//! keeps the output a prefix of some string of the grammar (a token may span several grammar
//! symbols); EOS is allowed only when the output so far is complete; compiled grammars are
//! shared, each request's state is its own. JSON Schema objects are generated and accepted
//! with their properties in the schema's order (llguidance's rule).
//!
//! Bitmask layout (XGrammar's and llguidance's): token `t` is bit `t % 32` of word `t / 32`,
//! least significant bit first, 1 = allowed.
//!
//! # Example: the yes/no grammar of seed 001
//!
//! ```
//! use nucleus_grammar::{GrammarCompiler, GrammarOptions, GrammarSpec, TokenEnv, GrammarError};
//!
//! // A toy vocabulary: ids 0..=255 are single bytes, 256 is "yes", 257 is the EOS token.
//! let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
//! tokens.push(b"yes".to_vec());
//! tokens.push(b"\xFF<|end|>".to_vec()); // special tokens start with 0xFF
//! let env = TokenEnv::from_token_bytes(tokens, &[257], 258)?;
//! let compiler = GrammarCompiler::new(env)?;
//! let spec = GrammarSpec::Regex("yes|no".to_string());
//! let mut m = compiler.matcher(&spec, &GrammarOptions::default())?;
//!
//! let allowed = |row: &[u32], t: u32| row[t as usize / 32] >> (t % 32) & 1 == 1;
//! let mut row = vec![0u32; 9]; // ceil(258 / 32) words
//! m.fill_bitmask(&mut row)?;
//! assert!(allowed(&row, u32::from(b'y')) && allowed(&row, 256) && !allowed(&row, 257));
//!
//! m.commit(256)?; // "yes"
//! assert!(m.may_end());
//! assert!(matches!(m.commit(u32::from(b'!')), Err(GrammarError::TokenRejected { .. })));
//! m.fill_bitmask(&mut row)?; // only EOS now
//! assert_eq!((0..258).filter(|&t| allowed(&row, t)).collect::<Vec<_>>(), vec![257]);
//! m.commit(257)?;
//! assert!(m.is_ended());
//! m.rollback(2)?; // back to the start
//! assert!(!m.may_end());
//! # Ok::<(), GrammarError>(())
//! ```

mod compiler;
mod depth;
mod error;
mod matcher;
mod relax;
mod schema_validator;
mod tokenizer;
mod validate;

pub use compiler::{
    CompiledGrammar, GrammarCompiler, GrammarKind, GrammarOptions, GrammarSpec, JsonSchemaMode,
    DEFAULT_MAX_WHITESPACE, FIRST_STEP_LIMIT, INCOMPLETE,
};
pub use depth::{json_text_depth, lark_depth, schema_depth, MAX_GRAMMAR_DEPTH};
pub use error::{GrammarError, Result, MAX_MESSAGE_LINE};
pub use matcher::{fill_bitmasks, GrammarMatcher};
pub use schema_validator::{
    validate_json_instance, SchemaValidator, SchemaValidatorError, SchemaVerdict,
};
pub use tokenizer::{TokenEnv, MAX_TOKEN_BYTES, MAX_VOCAB_SIZE, SPECIAL_TOKEN_MARKER};
pub use validate::{validate_text, Validation};
