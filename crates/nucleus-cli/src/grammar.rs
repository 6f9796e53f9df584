//! `nucleus grammar validate`: does a text match a JSON Schema, a regular expression or a Lark
//! grammar, tokenised as a model would generate it? And, for a JSON Schema, does the exact
//! validator accept it?
//!
//! The logic is [`nucleus_grammar::validate_text`] (the mask's verdict) and
//! [`nucleus_grammar::CompiledGrammar::validate_json`] (the `jsonschema` crate's, against the
//! schema as given); this module reads the flags and files, builds the tokenizer (a GGUF
//! model's or a `tokenizer.json`), prints the verdicts and picks the exit status.
//!
//! Line 1 is the mask's verdict:
//! - `accepted`: every token is accepted and the grammar may end after the last one;
//! - `rejected at token I (id N, text "...")`: the first token the grammar refuses,
//!   counted from 0, with its id and its text (escaped as a Rust string literal);
//! - `rejected at end of text (the grammar cannot end here)`: every token is accepted
//!   but the text is incomplete.
//!
//! With `--json-schema`, line 2 is the exact validator's: `schema: valid`, or
//! `schema: invalid at /a/0/b: <message>` (`invalid at the root: ...` for the whole text,
//! which is also where text that is not JSON is invalid). A schema compiled in relaxed mode
//! (`--json-schema-mode relaxed`, the default) adds a note on stderr naming what was relaxed.
//!
//! Exit status: 0 when the mask accepts and (with `--json-schema`) the validator too; 1 when
//! either rejects; 2 (grep's convention: every error, since 1 is "rejected") with `error: ...`
//! on stderr: a grammar that does not compile (llguidance's message), a schema the validator
//! cannot build (then line 2 is `schema: cannot validate: ...`), an unreadable file or one
//! larger than `--max-input-bytes` ([`crate::input`]), a tokenizer or model that cannot be
//! loaded, `--max-whitespace` or `--json-schema-mode` without `--json-schema`, a verdict that
//! cannot be written (a full disk; a closed pipe keeps the verdict's status quietly). Bad
//! flags are clap's usage message, also exit 2.
//!
//! Whitespace between JSON tokens is unbounded here by default (`--max-whitespace none`):
//! pretty-printed JSON of any depth validates. Generation keeps its bound of 8
//! (`nucleus generate --max-whitespace`); pass `--max-whitespace 8` to check a text the way
//! generation's mask sees it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, bail, Result};
use clap::{ArgGroup, Args, ValueEnum};
use nucleus_grammar::{
    validate_text, GrammarCompiler, GrammarOptions, GrammarSpec, JsonSchemaMode, SchemaVerdict,
    TokenEnv, Validation, DEFAULT_MAX_WHITESPACE,
};
use serde::Deserialize;

use crate::input::{read_file, read_stdin, shown, shown_path, InputLimit, MaxInputBytes};
use crate::usage::UsageError;

/// The flags of `nucleus grammar validate`.
#[derive(Args, Debug, Clone)]
#[command(group(ArgGroup::new("grammar_source").required(true).args(["json_schema", "regex", "grammar"])))]
pub struct ValidateArgs {
    /// A JSON Schema: the path of a file holding it, or else the schema itself as inline JSON.
    #[arg(long, value_name = "S")]
    pub json_schema: Option<String>,
    /// A regular expression (Rust regex syntax) that the whole text must match.
    #[arg(long, value_name = "RE", allow_hyphen_values = true)]
    pub regex: Option<String>,
    /// A file holding a Lark grammar (llguidance's dialect).
    #[arg(long, value_name = "FILE.lark")]
    pub grammar: Option<PathBuf>,
    /// The text to validate (`-`: stdin). One trailing newline (`\n` or `\r\n`) is dropped.
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// The model whose tokenizer to use (a GGUF file or a Hugging Face model folder). Default:
    /// $NUCLEUS_MODEL, else ggml-org/models tinyllamas/stories260K.gguf from the Hugging Face hub cache (as `generate`).
    #[arg(long, value_name = "PATH", conflicts_with = "tokenizer")]
    pub model: Option<PathBuf>,
    /// A Hugging Face tokenizer.json to use instead of a model's tokenizer.
    #[arg(long, value_name = "tokenizer.json")]
    pub tokenizer: Option<PathBuf>,
    /// JSON Schema only: most whitespace characters in a row between JSON tokens (0: compact
    /// JSON only). Default `none` (unbounded: validation is not bounded like generation, whose
    /// default is 8); an error without --json-schema.
    #[arg(long, value_name = "N", value_parser = parse_max_whitespace)]
    pub max_whitespace: Option<MaxWhitespace>,
    /// JSON Schema only: `relaxed` (the default) compiles a schema llguidance cannot compile
    /// exactly as the narrowest schema it can that contains it; `strict` refuses it.
    #[arg(long, value_enum, value_name = "MODE")]
    pub json_schema_mode: Option<SchemaMode>,
    /// `--max-input-bytes`: most bytes of the --text, --grammar, --json-schema and --tokenizer
    /// files (not of a GGUF model).
    #[command(flatten)]
    pub limit: InputLimit,
    /// `--threads`.
    #[command(flatten)]
    pub threads: crate::threads::Threads,
}

/// The value of `--max-whitespace`: a bound, or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxWhitespace(pub Option<usize>);

impl Default for MaxWhitespace {
    fn default() -> Self {
        MaxWhitespace(Some(DEFAULT_MAX_WHITESPACE))
    }
}

/// The value of `--json-schema-mode` (`nucleus generate`, `nucleus grammar validate`,
/// `nucleus serve`): what to do with a JSON Schema llguidance cannot compile exactly
/// ([`nucleus_grammar::JsonSchemaMode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum SchemaMode {
    /// Compile the narrowest schema llguidance supports that contains the original (`not`,
    /// `uniqueItems`, `dependencies`, `propertyNames`, unknown formats ignored; `oneOf` as
    /// `anyOf`; `if`/`then`/`else` as the union of its branches; ...), report what was
    /// relaxed, and validate every completion exactly against the original.
    #[default]
    Relaxed,
    /// Refuse such a schema (llguidance's message), as before relaxed mode existed.
    Strict,
}

impl From<SchemaMode> for JsonSchemaMode {
    fn from(mode: SchemaMode) -> Self {
        match mode {
            SchemaMode::Relaxed => JsonSchemaMode::Relaxed,
            SchemaMode::Strict => JsonSchemaMode::Strict,
        }
    }
}

/// The `--json-schema-mode` to use: the given one or the default (relaxed).
///
/// # Errors
/// A [`UsageError`] when it was given without `--json-schema` (`json_schema`), where it would
/// have no effect.
pub fn json_schema_mode_for(given: Option<SchemaMode>, json_schema: bool) -> Result<SchemaMode> {
    match given {
        Some(_) if !json_schema => {
            Err(UsageError::new("--json-schema-mode has no effect without --json-schema").into())
        }
        given => Ok(given.unwrap_or_default()),
    }
}

/// The largest `--max-whitespace` bound (llguidance's regex repetition counts are limited).
pub const MAX_WHITESPACE_BOUND: usize = 1_000;

/// Parses `--max-whitespace`: a number of characters up to [`MAX_WHITESPACE_BOUND`], or
/// `none`.
pub fn parse_max_whitespace(s: &str) -> Result<MaxWhitespace, String> {
    if s.eq_ignore_ascii_case("none") {
        return Ok(MaxWhitespace(None));
    }
    match s.parse::<usize>() {
        Ok(n) if n <= MAX_WHITESPACE_BOUND => Ok(MaxWhitespace(Some(n))),
        Ok(_) => Err(format!(
            "at most {MAX_WHITESPACE_BOUND} (use `none` for unbounded), got `{s}`"
        )),
        Err(_) => Err(format!(
            "expected a number of characters or `none`, got `{s}`"
        )),
    }
}

/// End tokens recognised by name when the tokenizer does not say which is its EOS.
const END_TOKEN_NAMES: [&str; 8] = [
    "<|im_end|>",
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<eos>",
    "<end_of_turn>",
    "<|end|>",
];

/// The verdicts of `nucleus grammar validate`: the mask's, and with a JSON Schema the exact
/// validator's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdicts {
    /// The mask's verdict (line 1).
    pub mask: Validation,
    /// With `--json-schema`: the exact validator's verdict (line 2), or why it gave none.
    pub schema: Option<std::result::Result<SchemaVerdict, String>>,
    /// With `--json-schema`: the keyword families relaxed to compile it (empty when it
    /// compiled exactly).
    pub relaxed: Vec<String>,
}

impl Verdicts {
    /// The exit status: 0 when every verdict accepts, 1 when one rejects, 2 when the
    /// validator could give no verdict.
    pub fn status(&self) -> u8 {
        match &self.schema {
            Some(Err(_)) => 2,
            Some(Ok(v)) if !v.is_valid() => 1,
            _ if !self.mask.is_accepted() => 1,
            _ => 0,
        }
    }

    /// The lines printed on stdout.
    pub fn lines(&self) -> String {
        match &self.schema {
            None => format!("{}\n", self.mask),
            Some(Ok(v)) => format!("{}\nschema: {v}\n", self.mask),
            Some(Err(e)) => format!("{}\nschema: cannot validate: {e}\n", self.mask),
        }
    }
}

/// Runs `nucleus grammar validate`: prints the verdicts on stdout (or `error: ...` on stderr)
/// and returns the exit status (0 accepted, 1 rejected, 2 error). A closed stdout (`| true`)
/// keeps the verdicts' status quietly; any other failure to write them is an error (2,
/// `error: writing the output: ...`).
pub fn validate_command(args: &ValidateArgs) -> ExitCode {
    match validate(args) {
        Ok(verdicts) => {
            if !verdicts.relaxed.is_empty() {
                crate::report::note(&format!(
                    "the JSON Schema was relaxed to compile ({}); line 2 is the exact \
                     verdict against the schema as given",
                    verdicts.relaxed.join(", ")
                ));
            }
            let status = ExitCode::from(verdicts.status());
            if let Some(Err(e)) = &verdicts.schema {
                crate::report::error(&format!("the schema cannot be validated: {e}"));
            }
            let mut out = std::io::stdout().lock();
            match out
                .write_all(verdicts.lines().as_bytes())
                .and_then(|()| out.flush())
            {
                Ok(()) => status,
                // The reader went away (`| true`): the verdict stands, quietly.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => status,
                Err(e) => {
                    crate::report::error(&format!("writing the output: {e}"));
                    ExitCode::from(2)
                }
            }
        }
        Err(e) => {
            crate::report::error(&crate::usage::message(&e));
            ExitCode::from(2)
        }
    }
}

/// The verdicts of `nucleus grammar validate` for `args`.
///
/// Errors: `--max-whitespace` or `--json-schema-mode` without `--json-schema` (a
/// [`UsageError`]), unreadable files or ones larger than `--max-input-bytes`, a tokenizer or
/// model that cannot be loaded, a grammar that does not compile (with llguidance's message).
pub fn validate(args: &ValidateArgs) -> Result<Verdicts> {
    let json_schema = args.json_schema.is_some();
    // Validation is not bounded like generation: unbounded whitespace unless given.
    max_whitespace_for(args.max_whitespace, json_schema)?;
    let max_whitespace = args.max_whitespace.unwrap_or(MaxWhitespace(None));
    let mode = json_schema_mode_for(args.json_schema_mode, json_schema)?;
    let limit = args.limit.max_input_bytes;
    let spec = grammar_spec(args, limit)?;
    let text = read_text(&args.text, limit)?;
    let env = token_env(args)?;
    let compiler = GrammarCompiler::new(env)?;
    let options = GrammarOptions {
        max_whitespace: max_whitespace.0,
        json_schema_mode: mode.into(),
    };
    let mask = validate_text(&compiler, &spec, &options, &text)?;
    // The grammar is in the compiler's cache now: this is the same compilation.
    let compiled = compiler.compile(&spec, &options)?;
    let schema = compiled
        .validate_json(&text)
        .map(|r| r.map_err(|e| e.message));
    Ok(Verdicts {
        mask,
        schema,
        relaxed: compiled.relaxed().to_vec(),
    })
}

/// The `--max-whitespace` bound to use: the given one or the default (8).
///
/// # Errors
/// A [`UsageError`] when it was given without `--json-schema` (`json_schema`), where it would
/// have no effect.
pub fn max_whitespace_for(
    given: Option<MaxWhitespace>,
    json_schema: bool,
) -> Result<MaxWhitespace> {
    match given {
        Some(_) if !json_schema => Err(UsageError::new(
            "--max-whitespace has no effect without --json-schema (it bounds the whitespace between JSON tokens)",
        )
        .into()),
        given => Ok(given.unwrap_or_default()),
    }
}

fn grammar_spec(args: &ValidateArgs, limit: MaxInputBytes) -> Result<GrammarSpec> {
    grammar_spec_from(
        args.json_schema.as_deref(),
        args.regex.as_deref(),
        args.grammar.as_deref(),
        limit,
    )?
    .ok_or_else(|| anyhow!("one of --json-schema, --regex or --grammar is required"))
}

/// A file given by `flag`, read within `limit` as UTF-8 text, a leading byte-order mark
/// removed (editors on Windows write one).
fn read_text_file(flag: &str, path: &Path, limit: MaxInputBytes) -> Result<String> {
    let bytes = read_file(flag, path, limit)?;
    let text = String::from_utf8(bytes)
        .map_err(|e| anyhow!("{flag} {} is not UTF-8: {e}", shown_path(path)))?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

/// The grammar named by `--json-schema S` (the path of an existing file holding the schema,
/// else the schema itself as inline JSON), `--regex RE` or `--grammar FILE.lark`, the first
/// one given; `None` when none is. Files are read within `limit`.
///
/// Errors: inline `--json-schema` text that is not JSON (a [`UsageError`]); an unreadable
/// schema or grammar file, a directory, or one larger than `limit`.
pub fn grammar_spec_from(
    json_schema: Option<&str>,
    regex: Option<&str>,
    grammar: Option<&Path>,
    limit: MaxInputBytes,
) -> Result<Option<GrammarSpec>> {
    if let Some(schema) = json_schema {
        let path = Path::new(schema);
        // An existing path is a file to read (a pipe such as `<(cat s.json)` included; a
        // directory is an error), whatever it looks like; anything else is inline JSON.
        let text = if path.exists() {
            read_text_file("--json-schema", path, limit)?
        } else if let Err(e) = check_json(schema) {
            let message = format!(
                "--json-schema \"{}\" is neither an existing file nor valid JSON ({e})",
                shown(schema)
            );
            // Text that starts like a JSON object is a flag value outside its type (exit
            // status 2); anything else is taken for a file that is missing (1).
            if schema.trim_start().starts_with('{') {
                return Err(UsageError::new(message).into());
            }
            bail!(message);
        } else {
            schema.to_string()
        };
        Ok(Some(GrammarSpec::JsonSchema(text)))
    } else if let Some(rx) = regex {
        Ok(Some(GrammarSpec::Regex(rx.to_string())))
    } else if let Some(path) = grammar {
        Ok(Some(GrammarSpec::Lark(read_text_file(
            "--grammar",
            path,
            limit,
        )?)))
    } else {
        Ok(None)
    }
}

/// Whether `text` is one JSON value. Nesting is not limited here (serde_json's own limit of
/// 128 levels would call a deeply nested schema invalid JSON): text nested deeper than
/// [`nucleus_grammar::MAX_GRAMMAR_DEPTH`] passes, for the compiler to refuse as too deep.
fn check_json(text: &str) -> serde_json::Result<()> {
    if nucleus_grammar::json_text_depth(text.as_bytes()) > nucleus_grammar::MAX_GRAMMAR_DEPTH {
        return Ok(());
    }
    let mut de = serde_json::Deserializer::from_str(text);
    de.disable_recursion_limit();
    serde::de::IgnoredAny::deserialize(&mut de)?;
    de.end()
}

/// The text to validate (read within `limit`), without one trailing newline.
fn read_text(path: &Path, limit: MaxInputBytes) -> Result<String> {
    let bytes = if path.as_os_str() == "-" {
        read_stdin("--text", limit)?
    } else {
        read_file("--text", path, limit)?
    };
    let mut text = String::from_utf8(bytes)
        .map_err(|e| anyhow!("the text {} is not UTF-8: {e}", shown_path(path)))?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

/// The token environment of `--tokenizer`, else of `--model` (or the default model).
fn token_env(args: &ValidateArgs) -> Result<TokenEnv> {
    if let Some(path) = &args.tokenizer {
        let bytes = read_file("--tokenizer", path, args.limit.max_input_bytes)?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| anyhow!("cannot load the tokenizer {}: {e}", shown_path(path)))?;
        drop(bytes);
        let eos = end_tokens(&tokenizer, &[]);
        if eos.is_empty() {
            bail!(
                "the tokenizer {} has none of the end tokens {END_TOKEN_NAMES:?}",
                path.display()
            );
        }
        let vocab = tokenizer
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        return Ok(TokenEnv::from_tokenizer(&tokenizer, &eos, vocab)?);
    }
    let path = nucleus_engine::hub::resolve_model(args.model.as_deref())?;
    // A Hugging Face folder's tokenizer is read without its weights; a GGUF file holds both.
    let (model_tokenizer, vocab) = if path.is_dir() {
        nucleus_engine::load_hf_tokenizer(&path)?
    } else {
        let loaded = nucleus_engine::load_model(&path, &nucleus_engine::Device::Cpu)?;
        for warning in &loaded.warnings {
            crate::report::warning(&warning.to_string());
        }
        let vocab = loaded.model.config().vocab_size;
        (loaded.tokenizer, vocab)
    };
    let tokenizer = &model_tokenizer.tokenizer;
    let eos = end_tokens(tokenizer, &model_tokenizer.eos_token_ids);
    if eos.is_empty() {
        bail!(
            "the model {} has no EOS id and none of the end tokens {END_TOKEN_NAMES:?}",
            path.display()
        );
    }
    Ok(TokenEnv::from_tokenizer(tokenizer, &eos, vocab)?)
}

/// The EOS ids: `declared` first, then the special tokens named like end tokens.
fn end_tokens(tokenizer: &tokenizers::Tokenizer, declared: &[u32]) -> Vec<u32> {
    let mut ids: Vec<u32> = declared.to_vec();
    let mut named: Vec<u32> = tokenizer
        .get_added_tokens_decoder()
        .iter()
        .filter(|(_, t)| t.special && END_TOKEN_NAMES.contains(&t.content.as_str()))
        .map(|(&id, _)| id)
        .collect();
    named.sort_unstable();
    for id in named {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}
