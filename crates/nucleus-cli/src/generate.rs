//! `nucleus generate`: text from a model, every token chosen by nucleus-sampling.
//!
//! The flags expose the whole sampling contract (`SamplingParams`); defaults a request does not
//! set come from the model's generation_config.json as vLLM takes them
//! ([`nucleus_engine::GenerationDefaults`], `--generation-config auto|vllm|DIR`). Prompts come
//! from `--prompt` (repeatable; `-` reads stdin), `--prompt-file` (one per line, or the whole
//! file with `--whole-file`), or in chat mode (`--chat`) are user messages rendered with the
//! model's chat template (`--messages FILE.json`: one whole conversation in the OpenAI format).
//!
//! Output: text (one completion streamed as it is generated; several printed whole, each
//! headed `--- request R sample S ---`), or `--format json`: one JSON object per completion
//! ([`Completion`]). Several completions print in request / sample order, each as soon as all
//! before it are printed.
//!
//! Under `--json-schema` every completion is validated exactly against the schema as given
//! ([`SchemaCheck`]; README "Strict and relaxed JSON Schemas"): `--json-schema-mode relaxed`
//! (the default) compiles schemas llguidance cannot enforce exactly as the narrowest schema it
//! can that contains them, and `--json-schema-retry N` draws a rejected completion again on
//! sample index `n * r + j` ([`nucleus_engine::Engine::add_request_with_sample_offset`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use clap::{ArgGroup, Args, ValueEnum};
use nucleus_engine::{
    load_model, Engine, EngineConfig, EngineError, FinishReason, GenerationDefaults,
    GrammarOptions, ModelTokenizer, Prompt, Request, SamplingParams,
};
use nucleus_sampling::{Logprobs, LogprobsKind};
use serde::Serialize;

use crate::input::{read_file, read_stdin, InputLimit};
use crate::report::{self, Output};
use crate::usage::UsageError;

/// The default `--max-tokens` when neither the flag nor the model's generation_config.json
/// sets it.
pub const DEFAULT_MAX_TOKENS: usize = 256;

/// How completions are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// The text (one completion streamed, several headed `--- request R sample S ---`).
    Text,
    /// One JSON object per line and completion.
    Json,
}

/// Which distribution `--logprobs` reports (vLLM's `--logprobs-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogprobsMode {
    /// The model's own distribution: log-softmax of the raw logits (vLLM's default,
    /// `raw_logprobs`).
    Raw,
    /// The distribution the token was drawn from, after penalties, temperature and filters
    /// (vLLM's `processed_logprobs`).
    Processed,
}

/// The flags of `nucleus generate`.
#[derive(Args, Debug)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "prompt_file", "messages"])))]
pub struct GenerateArgs {
    /// A prompt (repeat the flag for several requests that run together; `-` reads stdin
    /// whole). "" is BOS alone (an error for a tokenizer that adds no BOS, as Qwen's). With
    /// --chat, the text of one user message.
    #[arg(long, allow_hyphen_values = true)]
    pub prompt: Vec<String>,
    /// Prompts from a file (`-`: stdin): one per line (a trailing "\r" is dropped), or the whole
    /// file with --whole-file.
    #[arg(long, value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,
    /// With --prompt-file: the whole file is one prompt.
    #[arg(long)]
    pub whole_file: bool,
    /// Chat: each prompt is one user message, rendered with the model's chat template (or
    /// --chat-template) and a generation prompt.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: a system message before each user message.
    #[arg(long, value_name = "TEXT", allow_hyphen_values = true)]
    pub system: Option<String>,
    /// One whole conversation instead of --prompt: a JSON list of OpenAI-format messages (or
    /// an object with `messages` and `tools`); list-of-parts content is joined as vLLM does.
    /// Implies --chat.
    #[arg(long, value_name = "FILE.json")]
    pub messages: Option<PathBuf>,
    /// With --chat: a Jinja template file (or a JSON file with `chat_template`) instead of the
    /// model's.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// With --chat: variables the template reads, as a JSON object (Qwen3's
    /// `{"enable_thinking": false}`, MiniMind's `{"open_thinking": true}`).
    #[arg(long, value_name = "JSON")]
    pub chat_template_kwargs: Option<String>,
    /// The model: a GGUF file (arch llama, qwen2, qwen3, qwen3moe), a Hugging Face model
    /// folder (model_type llama, qwen2, qwen3, qwen3_moe, minimind), a hub id (`OWNER/NAME`,
    /// `OWNER/NAME@REVISION`), or a GGUF in a hub repository (`REPO:FILE.gguf`,
    /// `REPO:Q4_K_M`). Default: $NUCLEUS_MODEL, else ggml-org/models
    /// tinyllamas/stories260K.gguf from the Hugging Face hub.
    #[arg(long, value_name = "M")]
    pub model: Option<String>,
    /// Where request defaults come from: `auto` (the model's generation_config.json), `vllm`
    /// (none: nucleus's own defaults), or a folder holding a generation_config.json.
    #[arg(long, value_name = "auto|vllm|DIR", default_value = "auto")]
    pub generation_config: String,
    /// Most tokens to generate per completion. Default: the model's generation_config
    /// `max_new_tokens`, else 256.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Softmax temperature; 0 is greedy. Default: the model's generation_config, else 1.
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f64>,
    /// Keep the k most likely tokens (0 or -1: off). Default: the model's generation_config,
    /// else off.
    #[arg(long, allow_negative_numbers = true)]
    pub top_k: Option<i64>,
    /// Keep the smallest set of tokens whose probability reaches p (1: off). Default: the
    /// model's generation_config, else off.
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f64>,
    /// Keep tokens whose probability is at least min_p times the largest (0: off). Default:
    /// the model's generation_config, else off.
    #[arg(long, allow_negative_numbers = true)]
    pub min_p: Option<f64>,
    /// Repetition penalty over prompt and generated tokens (1: off). Default: the model's
    /// generation_config, else off.
    #[arg(long, allow_negative_numbers = true)]
    pub repetition_penalty: Option<f64>,
    /// Subtracted once from the logit of every token already generated (-2 to 2; OpenAI's).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f64,
    /// Subtracted from the logit of a token once per time it was generated (-2 to 2; OpenAI's).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f64,
    /// Locally typical sampling's mass (llama.cpp `typical`; 1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub typical_p: f64,
    /// Top-n-sigma: keep logits at least max - N standard deviations (llama.cpp; <= 0: off).
    #[arg(long, default_value_t = -1.0, allow_negative_numbers = true)]
    pub top_n_sigma: f64,
    /// Epsilon sampling: remove tokens below this probability (Hugging Face; 0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub epsilon_cutoff: f64,
    /// Eta sampling's epsilon (Hugging Face; 0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub eta_cutoff: f64,
    /// XTC: with probability --xtc-probability, remove every token above this probability but
    /// the least likely of them (llama.cpp; above 0.5: off).
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    pub xtc_threshold: f64,
    /// XTC's probability (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub xtc_probability: f64,
    /// The fewest tokens every filter keeps (Hugging Face's min_tokens_to_keep).
    #[arg(long, default_value_t = 1)]
    pub min_keep: usize,
    /// Dynamic temperature: the temperature ranges over [T - R, T + R] by the entropy of the
    /// distribution (llama.cpp; 0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub dynatemp_range: f64,
    /// Dynamic temperature's exponent.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub dynatemp_exponent: f64,
    /// Mirostat: 0 off, 1 or 2 (llama.cpp); replaces min-p, top-k, top-p and the other filters.
    #[arg(long, default_value_t = 0)]
    pub mirostat: u8,
    /// Mirostat's target surprise (tau).
    #[arg(long, default_value_t = 5.0, allow_negative_numbers = true)]
    pub mirostat_tau: f64,
    /// Mirostat's learning rate (eta).
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    pub mirostat_eta: f64,
    /// DRY ("don't repeat yourself") multiplier (llama.cpp; 0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub dry_multiplier: f64,
    /// DRY's base.
    #[arg(long, default_value_t = 1.75, allow_negative_numbers = true)]
    pub dry_base: f64,
    /// DRY: repeats up to this many tokens long are not penalised.
    #[arg(long, default_value_t = 2)]
    pub dry_allowed_length: usize,
    /// DRY: how many of the last tokens are scanned (-1: all, 0: off).
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub dry_penalty_last_n: i64,
    /// DRY sequence breaker, a string resolved with the model's tokenizer as llama.cpp does
    /// (repeatable; default "\n", ":", "\"", "*"; `--dry-sequence-breaker none` for none).
    #[arg(long, value_name = "TEXT", allow_hyphen_values = true)]
    pub dry_sequence_breaker: Vec<String>,
    /// Ban any token that would repeat an n-gram of this size from the prompt or the
    /// completion (Hugging Face's no_repeat_ngram_size; 0: off).
    #[arg(long, default_value_t = 0)]
    pub no_repeat_ngram_size: usize,
    /// Add BIAS to the last token of the sequence IDS (comma-separated ids) when the sequence
    /// so far ends with the others (repeatable; Hugging Face's sequence_bias).
    #[arg(long, value_name = "IDS=BIAS", value_parser = parse_sequence_bias, allow_hyphen_values = true)]
    pub sequence_bias: Vec<(Vec<u32>, f64)>,
    /// Add BIAS to the logit of token ID (repeatable; clamped to [-100, 100] as OpenAI does).
    #[arg(long, value_name = "ID=BIAS", value_parser = parse_logit_bias, allow_hyphen_values = true)]
    pub logit_bias: Vec<(u32, f64)>,
    /// The end-of-generation and stop ids are banned until this many tokens are generated.
    #[arg(long, default_value_t = 0)]
    pub min_tokens: usize,
    /// Do not stop at the model's end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and the N most likely tokens (0: the
    /// chosen token's only).
    #[arg(long, value_name = "N")]
    pub logprobs: Option<usize>,
    /// With --logprobs: the model's distribution (`raw`, vLLM's default) or the one sampled
    /// from (`processed`).
    #[arg(long, value_enum, value_name = "MODE")]
    pub logprobs_mode: Option<LogprobsMode>,
    /// Stop when this token id is generated (repeatable; the token is not in the text).
    #[arg(long, value_name = "ID")]
    pub stop_token_id: Vec<u32>,
    /// Seed of every request's random stream (default: drawn from the OS per request).
    #[arg(long, allow_negative_numbers = true)]
    pub seed: Option<u64>,
    /// Completions per prompt; sample j uses sample index j of the seed's stream.
    #[arg(long, default_value_t = 1)]
    pub n: usize,
    /// Stop when this text is generated (not printed); repeat for several.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print the prompt (with --chat: the rendered conversation) before its completion.
    #[arg(long)]
    pub echo: bool,
    /// Structured output: the completion is JSON valid under this JSON Schema (the path of a
    /// file holding it, else the schema itself as inline JSON).
    #[arg(long, value_name = "S", conflicts_with_all = ["regex", "grammar"])]
    pub json_schema: Option<String>,
    /// Structured output: the whole completion matches this regular expression.
    #[arg(
        long,
        value_name = "RE",
        conflicts_with = "grammar",
        allow_hyphen_values = true
    )]
    pub regex: Option<String>,
    /// Structured output: the completion matches this Lark grammar (llguidance's dialect).
    #[arg(long, value_name = "FILE.lark")]
    pub grammar: Option<PathBuf>,
    /// With --json-schema: most whitespace characters in a row between JSON tokens (0: compact
    /// JSON; `none`: unbounded). Default 8; an error without --json-schema.
    #[arg(long, value_name = "N", value_parser = crate::grammar::parse_max_whitespace)]
    pub max_whitespace: Option<crate::grammar::MaxWhitespace>,
    /// With --json-schema: `relaxed` (the default) compiles a schema llguidance cannot compile
    /// exactly as the narrowest schema it can that contains it (what was relaxed is reported,
    /// and every completion is validated exactly against the schema as given); `strict`
    /// refuses such a schema. An error without --json-schema.
    #[arg(long, value_enum, value_name = "MODE")]
    pub json_schema_mode: Option<crate::grammar::SchemaMode>,
    /// With --json-schema: draw a completion again, up to N times, while the exact validator
    /// rejects it (retry r of sample j draws sample index n * r + j of the seed's stream, so it
    /// is deterministic). Completions cut by --max-tokens are not retried. Default 0; at most
    /// 100; an error without --json-schema.
    #[arg(long, value_name = "N")]
    pub json_schema_retry: Option<u32>,
    /// How completions are printed: `text`, or `json` (one object per completion and line).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Nothing on stderr but errors.
    #[arg(long)]
    pub quiet: bool,
    /// `--max-input-bytes`: most bytes of a --json-schema, --grammar, --prompt-file or stdin
    /// prompt (not of the model).
    #[command(flatten)]
    pub limit: InputLimit,
    /// The KV cache's element type: `f16` (the default, as llama.cpp's; half the memory) or
    /// `f32` (keys and values exactly as computed).
    #[arg(long, value_name = "DTYPE", default_value = "f16", value_parser = crate::model::parse_kv_cache_dtype)]
    pub kv_cache_dtype: nucleus_engine::KvCacheDtype,
    /// `--threads`.
    #[command(flatten)]
    pub threads: crate::threads::Threads,
}

/// `IDS=BIAS` of `--sequence-bias`: comma-separated token ids, `=`, a number.
fn parse_sequence_bias(s: &str) -> std::result::Result<(Vec<u32>, f64), String> {
    let (ids, bias) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("`{s}`: expected IDS=BIAS, e.g. 12,7=-2.5"))?;
    let ids = ids
        .split(',')
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .map_err(|e| format!("`{s}`: token id `{t}`: {e}"))
        })
        .collect::<std::result::Result<Vec<u32>, String>>()?;
    let bias: f64 = bias
        .trim()
        .parse()
        .map_err(|e| format!("`{s}`: bias `{bias}`: {e}"))?;
    if !bias.is_finite() {
        return Err(format!("`{s}`: the bias must be finite"));
    }
    Ok((ids, bias))
}

/// `ID=BIAS` of `--logit-bias`.
fn parse_logit_bias(s: &str) -> std::result::Result<(u32, f64), String> {
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("expected ID=BIAS, got {:?}", crate::input::shown(s)))?;
    let id = id
        .trim()
        .parse::<u32>()
        .map_err(|e| format!("token id {:?}: {e}", crate::input::shown(id)))?;
    let bias = bias
        .trim()
        .parse::<f64>()
        .map_err(|e| format!("bias {:?}: {e}", crate::input::shown(bias)))?;
    if !bias.is_finite() {
        return Err(format!("bias {bias} is not finite"));
    }
    Ok((id, bias))
}

/// Where request defaults come from (`--generation-config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GenerationConfigSource {
    /// The model's own (`auto`): its folder's generation_config.json; a GGUF file has none.
    Auto,
    /// None (`vllm`): nucleus's defaults.
    Vllm,
    /// This folder's generation_config.json, which must exist.
    Dir(PathBuf),
}

impl GenerationConfigSource {
    /// Parses the flag's value: `auto`, `vllm`, a folder, or a generation_config.json file (its
    /// folder).
    ///
    /// # Errors
    /// A [`UsageError`] for `""`, and for a path that is neither a folder nor a file named
    /// generation_config.json.
    pub fn parse(value: &str) -> Result<Self> {
        let file = nucleus_engine::generation_config::GENERATION_CONFIG_FILE;
        match value {
            "auto" => Ok(Self::Auto),
            "vllm" => Ok(Self::Vllm),
            "" => Err(
                UsageError::new("--generation-config \"\": expected auto, vllm or a folder").into(),
            ),
            path => {
                let path = PathBuf::from(path);
                if path.is_dir() {
                    Ok(Self::Dir(path))
                } else if path.is_file() && path.file_name().is_some_and(|n| n == file) {
                    Ok(Self::Dir(
                        path.parent()
                            .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
                    ))
                } else {
                    Err(UsageError::new(format!(
                        "--generation-config {}: not a folder (nor its {file}); expected auto, \
                         vllm or a folder holding a {file}",
                        crate::input::shown_path(&path)
                    ))
                    .into())
                }
            }
        }
    }

    /// The defaults for the model at `model` (a GGUF file or a folder), and the file they came
    /// from (`None` when there was none).
    ///
    /// # Errors
    /// For `Dir`, a folder without generation_config.json; a malformed file.
    pub fn defaults(&self, model: &Path) -> Result<(GenerationDefaults, Option<PathBuf>)> {
        let dir = match self {
            Self::Vllm => return Ok((GenerationDefaults::default(), None)),
            Self::Auto if model.is_dir() => model.to_path_buf(),
            Self::Auto => return Ok((GenerationDefaults::default(), None)),
            Self::Dir(dir) => {
                let file = dir.join(nucleus_engine::generation_config::GENERATION_CONFIG_FILE);
                if !file.is_file() {
                    anyhow::bail!(
                        "--generation-config {}: no generation_config.json there",
                        crate::input::shown_path(dir)
                    );
                }
                dir.clone()
            }
        };
        let file = dir.join(nucleus_engine::generation_config::GENERATION_CONFIG_FILE);
        let defaults = GenerationDefaults::from_dir(&dir).map_err(|e| match self {
            Self::Dir(_) => anyhow::Error::new(e).context("--generation-config"),
            _ => anyhow::Error::new(e),
        })?;
        let found = file.is_file().then_some(file);
        Ok((defaults, found))
    }
}

/// One completion as `--format json` prints it.
#[derive(Debug, Serialize)]
pub struct Completion {
    /// The request's index (the prompt's, from 0).
    pub request: usize,
    /// The sample's index within the request (from 0 to `--n` - 1).
    pub sample: u32,
    /// The generated text (stop strings and end-of-generation tokens not included).
    pub text: String,
    /// Every generated token id, the end-of-generation or stop token included (as vLLM's
    /// `CompletionOutput.token_ids`).
    pub token_ids: Vec<u32>,
    /// `eos`, `stop`, `length` or `error`.
    pub finish_reason: &'static str,
    /// The seed of the request's random stream.
    pub seed: u64,
    /// Token counts: prompt (BOS included), completion (`token_ids`), total.
    pub usage: Usage,
    /// With `--logprobs N`: one entry per generated token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprobs>>,
    /// For a failed completion: what went wrong.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<CompletionError>,
    /// With `--json-schema`: the exact validator's verdict (`schema_valid`, `schema_error`,
    /// `relaxed`, `schema_retries`, flattened into the object).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub schema: Option<SchemaCheck>,
}

/// The most `--json-schema-retry`.
pub const MAX_JSON_SCHEMA_RETRY: u32 = 100;

/// The exact validation of a [`Completion`] generated under `--json-schema`
/// ([`nucleus_grammar::CompiledGrammar::check_completion`]: the `jsonschema` crate against the
/// schema as given, formats asserted).
#[derive(Debug, Serialize, Clone, PartialEq, Eq)]
pub struct SchemaCheck {
    /// Whether the text is valid under the schema: `false` for a completion cut (by
    /// `--max-tokens` or a `--stop` string) before its grammar could end (message
    /// `incomplete`); `null` when the validator could give no verdict, or the completion failed
    /// (`schema_error` says why).
    pub schema_valid: Option<bool>,
    /// Why it is not valid: the JSON pointer of the first invalid value (`""` for the whole
    /// text) and the validator's message; `null` when valid.
    pub schema_error: Option<SchemaError>,
    /// The keyword families relaxed to compile the schema (`--json-schema-mode relaxed`;
    /// empty when it compiled exactly), sorted.
    pub relaxed: Vec<String>,
    /// How many times this sample was drawn again because the validator rejected it
    /// (`--json-schema-retry`): the text is that of sample index `n * schema_retries + sample`.
    pub schema_retries: u32,
}

/// `{"instance_path", "message"}` of a [`SchemaCheck`].
#[derive(Debug, Serialize, Clone, PartialEq, Eq)]
pub struct SchemaError {
    /// The JSON pointer (RFC 6901) of the first invalid value; `""` for the whole text.
    pub instance_path: String,
    /// What is wrong (`incomplete` for a cut completion).
    pub message: String,
}

impl SchemaCheck {
    /// The check of `text` under `compiled` (a JSON Schema grammar), `complete` as the
    /// engine's `grammar_complete`, after `retries` redraws.
    fn of(
        compiled: &nucleus_grammar::CompiledGrammar,
        text: &str,
        complete: bool,
        retries: u32,
    ) -> Self {
        let (schema_valid, schema_error) = match compiled.check_completion(text, complete) {
            None | Some(Ok(nucleus_grammar::SchemaVerdict::Valid)) => (Some(true), None),
            Some(Ok(nucleus_grammar::SchemaVerdict::Invalid {
                instance_path,
                message,
            })) => (
                Some(false),
                Some(SchemaError {
                    instance_path,
                    message,
                }),
            ),
            Some(Err(e)) => (
                None,
                Some(SchemaError {
                    instance_path: String::new(),
                    message: e.to_string(),
                }),
            ),
        };
        SchemaCheck {
            schema_valid,
            schema_error,
            relaxed: compiled.relaxed().to_vec(),
            schema_retries: retries,
        }
    }

    /// The check of a completion that failed (finish reason `error`): no verdict.
    fn failed(compiled: &nucleus_grammar::CompiledGrammar, retries: u32) -> Self {
        SchemaCheck {
            schema_valid: None,
            schema_error: Some(SchemaError {
                instance_path: String::new(),
                message: "not validated: the completion failed".to_string(),
            }),
            relaxed: compiled.relaxed().to_vec(),
            schema_retries: retries,
        }
    }

    /// Whether a redraw may help: the validator rejected a complete text (the caller also
    /// leaves out texts cut by `--max-tokens`).
    fn retryable(&self) -> bool {
        self.schema_valid == Some(false)
            && self
                .schema_error
                .as_ref()
                .is_some_and(|e| e.message != nucleus_grammar::INCOMPLETE)
    }

    /// `schema invalid at /a/b: ...` (`at the root` for `""`), or `None` when valid or not
    /// checked.
    fn invalid_line(&self) -> Option<String> {
        let e = self.schema_error.as_ref()?;
        if self.schema_valid != Some(false) {
            return None;
        }
        let at = if e.instance_path.is_empty() {
            "the root"
        } else {
            e.instance_path.as_str()
        };
        Some(format!("schema invalid at {at}: {}", e.message))
    }
}

/// Token counts of a [`Completion`], as the OpenAI API's `usage`.
#[derive(Debug, Serialize, Clone, Copy)]
pub struct Usage {
    /// Tokens of the prompt (BOS included).
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

/// A generated token's log-probability and the most likely alternatives.
#[derive(Debug, Serialize, Clone)]
pub struct TokenLogprobs {
    /// The token id.
    pub id: u32,
    /// Its text (special tokens spelled out).
    pub token: String,
    /// Its natural-log probability.
    pub logprob: f64,
    /// The `--logprobs N` most likely tokens, most likely first (ties toward the lower id).
    pub top_logprobs: Vec<TopLogprob>,
}

/// One of [`TokenLogprobs::top_logprobs`].
#[derive(Debug, Serialize, Clone)]
pub struct TopLogprob {
    /// The token id.
    pub id: u32,
    /// Its text.
    pub token: String,
    /// Its natural-log probability (`null` in JSON for -inf: a token that cannot be chosen).
    pub logprob: Option<f64>,
}

/// `{"kind", "message"}` of a failed [`Completion`].
#[derive(Debug, Serialize, Clone)]
pub struct CompletionError {
    /// `grammar`, `tokenizer` or `sampling`.
    pub kind: &'static str,
    /// What went wrong.
    pub message: String,
}

/// The JSON name of a finish reason, and the error of a failed one.
fn finish_fields(reason: &FinishReason) -> (&'static str, Option<CompletionError>) {
    match reason {
        FinishReason::Eos => ("eos", None),
        FinishReason::Stop => ("stop", None),
        FinishReason::Length => ("length", None),
        FinishReason::Error(message) => {
            // The engine's sample errors are led by what failed (engine.rs `step`).
            let kind = if message.starts_with("grammar:") {
                "grammar"
            } else if message.starts_with("tokenizer") {
                "tokenizer"
            } else {
                "sampling"
            };
            (
                "error",
                Some(CompletionError {
                    kind,
                    message: message.clone(),
                }),
            )
        }
    }
}

/// The flags checked before anything is read or loaded: values outside their domain and flags
/// without effect in the given combination are [`UsageError`]s (exit 2).
fn check_flags(args: &GenerateArgs) -> Result<()> {
    let usage = |m: String| -> Result<()> { Err(UsageError::new(m).into()) };
    if args.whole_file && args.prompt_file.is_none() {
        return usage("--whole-file has no effect without --prompt-file".into());
    }
    let chat = args.chat || args.messages.is_some();
    if !chat {
        for (set, flag) in [
            (args.system.is_some(), "--system"),
            (args.chat_template.is_some(), "--chat-template"),
            (
                args.chat_template_kwargs.is_some(),
                "--chat-template-kwargs",
            ),
        ] {
            if set {
                return usage(format!(
                    "{flag} has no effect without --chat (or --messages)"
                ));
            }
        }
    }
    if args.system.is_some() && args.messages.is_some() {
        return usage(
            "--system has no effect with --messages: put the system message in the \
             conversation"
                .into(),
        );
    }
    if args.max_tokens == Some(0) {
        return usage("--max-tokens must be at least 1".into());
    }
    if let Some(max) = args.max_tokens {
        if args.min_tokens > max {
            return usage(format!(
                "--min-tokens {} is more than --max-tokens {max}",
                args.min_tokens
            ));
        }
    }
    if !(1..=nucleus_engine::MAX_SAMPLES_PER_REQUEST).contains(&args.n) {
        return usage(format!(
            "--n must be in 1..={}, got {}",
            nucleus_engine::MAX_SAMPLES_PER_REQUEST,
            args.n
        ));
    }
    if args.stop.iter().any(String::is_empty) {
        return usage("--stop \"\": an empty stop string never matches".into());
    }
    if args.ignore_eos
        && (args.json_schema.is_some() || args.regex.is_some() || args.grammar.is_some())
    {
        return usage(
            "--ignore-eos cannot be used with structured output: the end-of-generation token \
             is where the grammar ends"
                .into(),
        );
    }
    if args.json_schema.is_none() && args.json_schema_retry.is_some() {
        return usage("--json-schema-retry has no effect without --json-schema".into());
    }
    if let Some(retry) = args
        .json_schema_retry
        .filter(|&r| r > MAX_JSON_SCHEMA_RETRY)
    {
        return usage(format!(
            "--json-schema-retry must be at most {MAX_JSON_SCHEMA_RETRY}, got {retry}"
        ));
    }
    if args.logprobs_mode.is_some() && args.logprobs.is_none() {
        return usage("--logprobs-mode has no effect without --logprobs".into());
    }
    if args.logprobs.is_some() && args.quiet && args.format == Format::Text {
        return usage(
            "--logprobs prints to stderr in text output, which --quiet silences: use \
             --format json"
                .into(),
        );
    }
    if args.echo && args.format == Format::Json {
        return usage("--echo has no effect with --format json".into());
    }
    let mut seen = std::collections::BTreeSet::new();
    for &(id, _) in &args.logit_bias {
        if !seen.insert(id) {
            return usage(format!("--logit-bias gives token {id} twice"));
        }
    }
    if args.prompt.iter().filter(|p| *p == "-").count() > 1 {
        return usage("--prompt - (stdin) given more than once".into());
    }
    Ok(())
}

/// The prompts as given: `--prompt` values (`-` read from stdin) or the lines of
/// `--prompt-file` (the whole file with `--whole-file`).
fn read_prompts(args: &GenerateArgs) -> Result<Vec<String>> {
    let limit = args.limit.max_input_bytes;
    let utf8 = |bytes: Vec<u8>, what: &str| {
        String::from_utf8(bytes).map_err(|e| anyhow::anyhow!("{what} is not UTF-8: {e}"))
    };
    if let Some(path) = &args.prompt_file {
        let text = utf8(
            if path.as_os_str() == "-" {
                read_stdin("--prompt-file", limit)?
            } else {
                read_file("--prompt-file", path, limit)?
            },
            &format!("--prompt-file {}", crate::input::shown_path(path)),
        )?;
        if args.whole_file {
            return Ok(vec![text]);
        }
        let prompts: Vec<String> = text
            .split_terminator('\n')
            .map(|l| l.strip_suffix('\r').unwrap_or(l).to_string())
            .collect();
        if prompts.is_empty() {
            anyhow::bail!(
                "--prompt-file {} holds no lines",
                crate::input::shown_path(path)
            );
        }
        return Ok(prompts);
    }
    args.prompt
        .iter()
        .map(|p| {
            if p == "-" {
                utf8(read_stdin("--prompt", limit)?, "--prompt - (stdin)")
            } else {
                Ok(p.clone())
            }
        })
        .collect()
}

/// The flags that name token ids or counts of them, checked against the model's vocabulary
/// once it is loaded (rather than failing every completion): a [`UsageError`] naming the flag
/// and the vocabulary size.
fn check_vocab_ids(args: &GenerateArgs, vocab_size: usize) -> Result<()> {
    let bad = |flag: &str, what: String| -> Result<()> {
        Err(UsageError::new(format!(
            "{flag} {what}: the model's vocabulary has {vocab_size} ids (0 to {})",
            vocab_size.saturating_sub(1)
        ))
        .into())
    };
    if let Some(&(id, _)) = args
        .logit_bias
        .iter()
        .find(|(id, _)| *id as usize >= vocab_size)
    {
        return bad("--logit-bias", format!("names token {id}"));
    }
    if let Some(&id) = args
        .stop_token_id
        .iter()
        .find(|&&id| id as usize >= vocab_size)
    {
        return bad("--stop-token-id", format!("{id}"));
    }
    if let Some(n) = args.logprobs.filter(|&n| n > vocab_size) {
        return bad(
            "--logprobs",
            format!("{n} asks for more tokens than there are"),
        );
    }
    Ok(())
}

/// `--dry-sequence-breaker` resolved with the model's tokenizer: llama.cpp's defaults when
/// none is given, none for `none` alone.
fn dry_breakers(args: &GenerateArgs, tokenizer: &ModelTokenizer) -> Result<Vec<Vec<u32>>> {
    let given = &args.dry_sequence_breaker;
    if given.len() == 1 && given[0] == "none" {
        return Ok(Vec::new());
    }
    let strings: Vec<&str> = if given.is_empty() {
        nucleus_sampling::chain::DRY_DEFAULT_SEQUENCE_BREAKERS.to_vec()
    } else {
        given.iter().map(String::as_str).collect()
    };
    tokenizer
        .dry_sequence_breakers(&strings)
        .map_err(|e| UsageError::new(format!("--dry-sequence-breaker: {e}")).into())
}

/// How errors name request `index`: by the flag it came from, and its index.
fn request_label(args: &GenerateArgs, index: usize) -> String {
    if args.messages.is_some() {
        "--messages (request 0)".to_string()
    } else if args.prompt_file.is_some() && !args.whole_file {
        format!("--prompt-file line {} (request {index})", index + 1)
    } else if args.prompt_file.is_some() {
        format!("--prompt-file (request {index})")
    } else {
        format!("--prompt {index} (request {index})")
    }
}

/// The sampling parameters of every request: each flag given, else the model's default, else
/// nucleus's. Returns them, `--max-tokens`, and the defaults taken (for the note).
fn sampling_params(
    args: &GenerateArgs,
    defaults: &GenerationDefaults,
) -> (SamplingParams, usize, Vec<String>) {
    let base = SamplingParams::default();
    let mut taken = GenerationDefaults::default();
    fn pick<T: Copy>(flag: Option<T>, default: Option<T>, taken: &mut Option<T>, base: T) -> T {
        match (flag, default) {
            (Some(v), _) => v,
            (None, Some(d)) => {
                *taken = Some(d);
                d
            }
            (None, None) => base,
        }
    }
    let params = SamplingParams {
        temperature: pick(
            args.temperature,
            defaults.temperature,
            &mut taken.temperature,
            base.temperature,
        ),
        top_k: pick(args.top_k, defaults.top_k, &mut taken.top_k, base.top_k),
        top_p: pick(args.top_p, defaults.top_p, &mut taken.top_p, base.top_p),
        min_p: pick(args.min_p, defaults.min_p, &mut taken.min_p, base.min_p),
        repetition_penalty: pick(
            args.repetition_penalty,
            defaults.repetition_penalty,
            &mut taken.repetition_penalty,
            base.repetition_penalty,
        ),
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        logit_bias: args.logit_bias.iter().copied().collect(),
        min_tokens: args.min_tokens,
        seed: args.seed,
        logprobs: args.logprobs,
        logprobs_kind: match args.logprobs_mode.unwrap_or(LogprobsMode::Raw) {
            LogprobsMode::Raw => LogprobsKind::Raw,
            LogprobsMode::Processed => LogprobsKind::Processed,
        },
        typical_p: args.typical_p,
        top_n_sigma: args.top_n_sigma,
        epsilon_cutoff: args.epsilon_cutoff,
        eta_cutoff: args.eta_cutoff,
        xtc_threshold: args.xtc_threshold,
        xtc_probability: args.xtc_probability,
        min_keep: args.min_keep,
        dynatemp_range: args.dynatemp_range,
        dynatemp_exponent: args.dynatemp_exponent,
        mirostat: args.mirostat,
        mirostat_tau: args.mirostat_tau,
        mirostat_eta: args.mirostat_eta,
        dry_multiplier: args.dry_multiplier,
        dry_base: args.dry_base,
        dry_allowed_length: args.dry_allowed_length,
        dry_penalty_last_n: args.dry_penalty_last_n,
        no_repeat_ngram_size: args.no_repeat_ngram_size,
        sequence_bias: args.sequence_bias.clone(),
        ..base
    };
    let max_tokens = pick(
        args.max_tokens,
        defaults.max_new_tokens,
        &mut taken.max_new_tokens,
        DEFAULT_MAX_TOKENS,
    );
    (params, max_tokens, taken.describe())
}

/// A completion being generated.
#[derive(Default)]
struct Pending {
    text: String,
    token_ids: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
}

/// Prints finished completions in (request, sample) order, each as soon as all before it are
/// printed.
struct InOrder {
    n: u32,
    next: (usize, u32),
    done: BTreeMap<(usize, u32), Completion>,
}

impl InOrder {
    fn push(&mut self, c: Completion) {
        self.done.insert((c.request, c.sample), c);
    }

    /// The completions now printable, in order.
    fn ready(&mut self) -> Vec<Completion> {
        let mut out = Vec::new();
        while let Some(c) = self.done.remove(&self.next) {
            out.push(c);
            self.next = if self.next.1 + 1 == self.n {
                (self.next.0 + 1, 0)
            } else {
                (self.next.0, self.next.1 + 1)
            };
        }
        out
    }
}

/// A token's text for logprobs ([`ModelTokenizer::token_text_after`]).
fn token_text(tokenizer: &ModelTokenizer, before: Option<u32>, id: u32) -> String {
    tokenizer.token_text_after(before, id)
}

/// The logprobs entry of one generated token, `before` the token before it.
fn token_logprobs(
    tokenizer: &ModelTokenizer,
    before: Option<u32>,
    id: u32,
    lp: &Logprobs,
) -> TokenLogprobs {
    TokenLogprobs {
        id,
        token: token_text(tokenizer, before, id),
        logprob: lp.sampled.first().copied().unwrap_or(f64::NAN),
        top_logprobs: lp
            .top
            .iter()
            .map(|t| TopLogprob {
                id: t.token_id,
                token: token_text(tokenizer, before, t.token_id),
                logprob: t.logprob.is_finite().then_some(t.logprob),
            })
            .collect(),
    }
}

/// Runs `nucleus generate`. Exit status 0 when every completion finished (eos, stop, length),
/// 1 when any failed or the model, a grammar file or a prompt cannot be used; 2 (a
/// [`UsageError`]) for a flag value outside its domain or a flag without effect, checked
/// before the model is loaded.
pub fn run(args: GenerateArgs) -> Result<ExitCode> {
    report::set_quiet(args.quiet);
    check_flags(&args)?;
    // Sampling values outside their domain are usage errors before the model loads (the
    // model's own defaults are checked when read).
    let (flag_params, _, _) = sampling_params(&args, &GenerationDefaults::default());
    flag_params
        .validate()
        .map_err(|e| UsageError::new(format!("{e}")))?;
    let max_whitespace =
        crate::grammar::max_whitespace_for(args.max_whitespace, args.json_schema.is_some())?;
    let grammar = crate::grammar::grammar_spec_from(
        args.json_schema.as_deref(),
        args.regex.as_deref(),
        args.grammar.as_deref(),
        args.limit.max_input_bytes,
    )?;
    let schema_mode =
        crate::grammar::json_schema_mode_for(args.json_schema_mode, args.json_schema.is_some())?;
    let grammar_options = GrammarOptions {
        max_whitespace: max_whitespace.0,
        json_schema_mode: schema_mode.into(),
    };
    let generation_config = GenerationConfigSource::parse(&args.generation_config)?;
    let chat = crate::chat::ChatInput::from_args(&args)?;
    let prompts = if args.messages.is_some() {
        Vec::new()
    } else {
        read_prompts(&args)?
    };

    let path = crate::model::resolve(args.model.as_deref())?;
    let loaded = load_model(&path, &candle_device())?;
    for warning in &loaded.warnings {
        report::warning(&warning.to_string());
    }
    let (defaults, defaults_file) = generation_config.defaults(&path)?;
    let (mut params, max_tokens, taken) = sampling_params(&args, &defaults);
    if let (Some(file), false) = (&defaults_file, taken.is_empty()) {
        report::note(&format!(
            "defaults from {}: {}",
            crate::input::shown_path(file),
            taken.join(", ")
        ));
    }
    if params.min_tokens > max_tokens {
        let whose = if defaults.max_new_tokens.is_some() {
            "the model's generation_config max_new_tokens"
        } else {
            "the default --max-tokens"
        };
        return Err(UsageError::new(format!(
            "--min-tokens {} is more than {whose}, {max_tokens}; pass --max-tokens",
            params.min_tokens
        ))
        .into());
    }
    check_vocab_ids(&args, loaded.model.config().vocab_size)?;
    if args.dry_multiplier > 0.0 && args.dry_penalty_last_n != 0 {
        params.dry_sequence_breakers = dry_breakers(&args, &loaded.tokenizer)?;
    }
    let config = loaded.model.config().clone();
    let tokenizer = loaded.tokenizer.clone();
    let mut engine = Engine::new(
        loaded.model,
        loaded.tokenizer,
        EngineConfig {
            kv_cache_dtype: args.kv_cache_dtype,
            ..EngineConfig::default()
        },
    );

    // (shown prompt text, engine prompt) per request.
    let requests: Vec<(String, Prompt)> = match &chat {
        Some(chat) => chat.prompts(&path, &tokenizer, &prompts)?,
        None => prompts
            .iter()
            .map(|p| (p.clone(), Prompt::Text(p.clone())))
            .collect(),
    };

    let retry = args.json_schema_retry.unwrap_or(0);
    // Retries print whole: a streamed text could not be taken back.
    let streaming = requests.len() == 1 && args.n == 1 && args.format == Format::Text && retry == 0;
    let several = requests.len() > 1 || args.n > 1;
    let request_for = |prompt: &Prompt, params: SamplingParams, n: usize| Request {
        prompt: prompt.clone(),
        params,
        max_tokens,
        stop_token_ids: args.stop_token_id.clone(),
        stop_strings: args.stop.clone(),
        n,
        ignore_eos: args.ignore_eos,
        grammar: grammar.clone(),
        grammar_options,
        include_stop_str_in_output: false,
        skip_special_tokens: true,
        chain: None,
    };
    // Engine request id -> the request's index (retries are engine requests of their own).
    let mut owner: BTreeMap<u64, usize> = BTreeMap::new();
    let mut seeds = Vec::new();
    let mut prompt_lens = Vec::new();
    let mut last_prompt_id = Vec::new();
    for (index, (_, prompt)) in requests.iter().enumerate() {
        let info = engine
            .add_request(request_for(prompt, params.clone(), args.n))
            .map_err(|e| match e {
                // One grammar and one set of flags for every prompt: their errors are not the
                // prompt's.
                EngineError::Grammar(_) => anyhow::Error::new(e),
                e => anyhow::Error::new(e).context(request_label(&args, index)),
            })?;
        owner.insert(info.request_id, index);
        seeds.push(info.seed);
        prompt_lens.push(info.prompt_ids.len());
        last_prompt_id.push(info.prompt_ids.last().copied());
    }
    // Before the first step: a run whose KV caches the machine cannot hold is refused here,
    // not aborted midway (a retry takes the place of the sample it redraws).
    check_kv_cache(
        &config,
        &prompt_lens,
        args.n,
        max_tokens,
        args.kv_cache_dtype,
    )?;
    // The JSON Schema's compilation, from the engine's cache (add_request compiled it).
    let schema = match (&grammar, args.json_schema.is_some()) {
        (Some(spec), true) => Some(engine.grammar_compiler()?.compile(spec, &grammar_options)?),
        _ => None,
    };
    if let Some(compiled) = &schema {
        if !compiled.relaxed().is_empty() {
            report::note(&format!(
                "the JSON Schema was relaxed to compile ({}): every completion is validated \
                 against the schema as given",
                compiled.relaxed().join(", ")
            ));
        }
        // The validator is built here, once: a schema it cannot take is said before
        // generating.
        if let Some(Err(e)) = compiled.validate_json("null") {
            report::warning(&format!(
                "{e}; completions are not validated (schema_valid null)"
            ));
        }
    }

    let stdout = std::io::stdout();
    let mut out = Output(stdout.lock());
    if streaming && args.echo {
        write!(out, "{}", requests[0].0)?;
        out.flush()?;
    }
    let mut pending: BTreeMap<(usize, u32), Pending> = BTreeMap::new();
    let mut order = InOrder {
        n: args.n as u32,
        next: (0, 0),
        done: BTreeMap::new(),
    };
    let n = args.n as u32;
    let mut finished: Vec<(usize, u32, FinishReason, usize, u32)> = Vec::new();
    while engine.has_unfinished() {
        for step in engine.step()? {
            let index = owner.get(&step.request_id).copied().unwrap_or(0);
            // Sample index n * r + j: retry r of sample j.
            let (sample, attempt) = (step.sample_index % n, step.sample_index / n);
            let key = (index, sample);
            let entry = pending.entry(key).or_default();
            if let Some(token) = step.token {
                let before = entry.token_ids.last().copied().or(last_prompt_id[index]);
                entry.token_ids.push(token);
                if let Some(lp) = &step.logprobs {
                    let t = token_logprobs(&tokenizer, before, token, lp);
                    if args.format == Format::Text {
                        report::note(&logprob_line(
                            index,
                            sample,
                            attempt,
                            entry.token_ids.len() - 1,
                            &t,
                        ));
                    }
                    entry.logprobs.push(t);
                }
            }
            if streaming {
                write!(out, "{}", step.text)?;
                out.flush()?;
            }
            // Kept when streamed too: the schema's validator reads the whole text.
            entry.text.push_str(&step.text);
            let Some(reason) = step.finish else { continue };
            let done = pending.remove(&key).unwrap_or_default();
            let failed = matches!(reason, FinishReason::Error(_));
            let check = schema.as_ref().map(|compiled| {
                if failed {
                    SchemaCheck::failed(compiled, attempt)
                } else {
                    let complete = step.grammar_complete.unwrap_or(false);
                    SchemaCheck::of(compiled, &done.text, complete, attempt)
                }
            });
            if let Some(check) = &check {
                // A text cut by --max-tokens is not drawn again, even where it could end.
                let truncated = matches!(reason, FinishReason::Length);
                if attempt < retry && check.retryable() && !truncated {
                    let next = attempt + 1;
                    // At most 1024 * 100 + 1023: no overflow.
                    let sample_index = n * next + sample;
                    report::note(&format!(
                        "request {index} sample {sample}: {}; retry {next} of {retry} \
                         (sample index {sample_index})",
                        check.invalid_line().unwrap_or_default()
                    ));
                    let mut redraw = params.clone();
                    redraw.seed = Some(seeds[index]);
                    let info = engine.add_request_with_sample_offset(
                        request_for(&requests[index].1, redraw, 1),
                        sample_index,
                    )?;
                    owner.insert(info.request_id, index);
                    continue;
                }
                if args.format == Format::Text {
                    if let Some(line) = check.invalid_line() {
                        // Shown even with --quiet: the text is not what the schema asks for.
                        report::always(&format!("request {index} sample {sample}: {line}"));
                    }
                }
            }
            finished.push((index, sample, reason.clone(), done.token_ids.len(), attempt));
            if streaming {
                continue;
            }
            let (finish_reason, error) = finish_fields(&reason);
            let completion_tokens = done.token_ids.len();
            order.push(Completion {
                request: index,
                sample,
                text: done.text,
                token_ids: done.token_ids,
                finish_reason,
                seed: seeds[index],
                usage: Usage {
                    prompt_tokens: prompt_lens[index],
                    completion_tokens,
                    total_tokens: prompt_lens[index] + completion_tokens,
                },
                logprobs: args.logprobs.map(|_| done.logprobs),
                error,
                schema: check,
            });
            for c in order.ready() {
                match args.format {
                    Format::Json => {
                        crate::answer::write_json(&c, &mut out)?;
                        writeln!(out)?;
                    }
                    Format::Text => {
                        if several {
                            writeln!(out, "--- request {} sample {} ---", c.request, c.sample)?;
                        }
                        if args.echo {
                            write!(out, "{}", requests[c.request].0)?;
                        }
                        writeln!(out, "{}", c.text)?;
                    }
                }
                out.flush()?;
            }
        }
    }
    if streaming {
        writeln!(out)?;
    }
    let m = engine.metrics();
    let rate = |n: usize, t: std::time::Duration| {
        if t.as_secs_f64() > 0.0 {
            n as f64 / t.as_secs_f64()
        } else {
            0.0
        }
    };
    report::note(&format!(
        "prefill: {} tokens in {:.3} s ({:.1} tokens/s)",
        m.prefill_tokens,
        m.prefill_time.as_secs_f64(),
        rate(m.prefill_tokens, m.prefill_time)
    ));
    report::note(&format!(
        "decode: {} token(s) in {:.3} s ({:.1} tokens/s); {} token(s) generated in all",
        m.decode_tokens,
        m.decode_time.as_secs_f64(),
        rate(m.decode_tokens, m.decode_time),
        m.generated_tokens
    ));
    for (index, seed) in seeds.iter().enumerate() {
        report::note(&format!("request {index}: seed {seed}"));
    }
    finished.sort_by_key(|f| (f.0, f.1));
    let mut failed = false;
    for (index, sample, reason, tokens, retries) in finished {
        let plural = if tokens == 1 { "" } else { "s" };
        let redrawn = match retries {
            0 => String::new(),
            1 => " (drawn again once for the schema)".to_string(),
            r => format!(" (drawn again {r} times for the schema)"),
        };
        let line = format!(
            "request {index} sample {sample}: finish reason {reason}, {tokens} token{plural}{redrawn}"
        );
        if matches!(reason, FinishReason::Error(_)) {
            failed = true;
            // A failure is an error, shown even with --quiet.
            if report::is_quiet() {
                report::error(&line);
                continue;
            }
        }
        report::note(&line);
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// One `--logprobs` line on stderr in text output; a draw of `--json-schema-retry` is
/// `sample J retry R`.
fn logprob_line(
    request: usize,
    sample: u32,
    retry: u32,
    position: usize,
    t: &TokenLogprobs,
) -> String {
    let sample = match retry {
        0 => sample.to_string(),
        r => format!("{sample} retry {r}"),
    };
    let shown = |lp: Option<f64>| lp.map_or("-inf".to_string(), |v| format!("{v:.6}"));
    let top: Vec<String> = t
        .top_logprobs
        .iter()
        .map(|e| format!("{} {:?} {}", e.id, e.token, shown(e.logprob)))
        .collect();
    format!(
        "logprobs: request {request} sample {sample} token {position}: {} {:?} {}{}",
        t.id,
        t.token,
        shown(Some(t.logprob).filter(|v| v.is_finite())),
        if top.is_empty() {
            String::new()
        } else {
            format!(" | top: {}", top.join(", "))
        }
    )
}

/// The positions a sequence's KV cache has room for at its largest, when it starts with
/// `prompt` tokens and grows to `final_len`: nucleus-engine's `KvCache` allocates the prompt's
/// length (at least 16) at prefill, then doubles (at least to the needed length, at most the
/// context length).
fn kv_capacity(prompt: usize, final_len: usize, context: usize) -> usize {
    let mut capacity = prompt.max(16).min(context);
    while capacity < final_len {
        capacity = capacity.saturating_mul(2).min(context);
    }
    capacity
}

/// Refuses a run whose memory the machine cannot hold, before any step: the KV caches of
/// every sequence (prompts x `--n`) at their largest, each `positions x n_layer x 2 (K and V)
/// x n_kv_head x head_dim` values of `kv_dtype` (nucleus-engine's `KvCache` layout; positions: the
/// capacity that holds `min(prompt tokens + --max-tokens, context length)`), one sequence's
/// cache once more (the old storage while it is reallocated), and each sequence's logits row
/// and attention scores, with a margin; checked by reserving that many bytes at once
/// ([`crate::memory::can_allocate`], the benchmarks' check).
///
/// # Errors
/// One message with the numbers, when the bytes cannot be had.
pub fn check_kv_cache(
    config: &nucleus_engine::ModelConfig,
    prompt_lens: &[usize],
    n: usize,
    max_tokens: usize,
    kv_dtype: nucleus_engine::KvCacheDtype,
) -> Result<()> {
    use crate::memory::{can_allocate_checked, gib, with_margin};
    let context = config.context_length;
    let value_bytes = kv_dtype.size_in_bytes();
    let per_position = [
        config.n_layer,
        2,
        config.n_kv_head,
        config.head_dim,
        value_bytes,
    ]
    .iter()
    .try_fold(1usize, |p, &f| p.checked_mul(f));
    let capacities: Vec<usize> = prompt_lens
        .iter()
        .map(|&p| kv_capacity(p, p.saturating_add(max_tokens).min(context), context))
        .collect();
    let positions = capacities
        .iter()
        .try_fold(0usize, |sum, &c| sum.checked_add(c.checked_mul(n)?));
    let sequences = prompt_lens.len().saturating_mul(n);
    let largest = capacities.iter().copied().max().unwrap_or(0);
    let cache = positions
        .and_then(|p| p.checked_add(largest))
        .zip(per_position)
        .and_then(|(p, b)| p.checked_mul(b));
    let per_sequence = [config.vocab_size, config.n_head.saturating_mul(context)]
        .iter()
        .try_fold(0usize, |sum, &v| sum.checked_add(v.checked_mul(4)?));
    // An MoE layer's routing buffers for the largest forward: every prompt's prefill at once,
    // or one decode row per sequence (one layer's at a time: they are reused).
    let rows = prompt_lens.iter().sum::<usize>().max(sequences);
    let moe = match &config.moe {
        Some(m) => m.routing_bytes(rows, config.hidden_size),
        None => Some(0),
    };
    let bytes = cache
        .zip(per_sequence.and_then(|b| b.checked_mul(sequences)))
        .and_then(|(c, s)| c.checked_add(s))
        .zip(moe)
        .and_then(|(c, m)| c.checked_add(m))
        .map(with_margin);
    if can_allocate_checked(bytes) {
        return Ok(());
    }
    let shown = |b: Option<usize>| match b {
        Some(b) => format!("{b} bytes ({})", gib(b)),
        None => "more bytes than this machine can address".to_string(),
    };
    let moe_part = match (&config.moe, moe) {
        (Some(m), Some(b)) if b > 0 => format!(
            "; its largest forward ({rows} rows) also needs {} for an MoE layer's routing \
             ({} experts per token, {} experts)",
            shown(Some(b)),
            m.num_experts_per_tok,
            m.num_experts
        ),
        (Some(_), None) => {
            "; its MoE routing needs more bytes than this machine can address".to_string()
        }
        _ => String::new(),
    };
    anyhow::bail!(
        "the KV cache of this run needs {}, which cannot be allocated here: {sequences} \
         sequences ({} prompt(s) x --n {n}), each of up to {largest} positions (its prompt \
         tokens + --max-tokens {max_tokens}, within the model's context of {context}) of {} \
         bytes ({} layers x 2 (K and V) x {} KV heads x {} values x {value_bytes} bytes, \
         --kv-cache-dtype {kv_dtype}){moe_part}; {} with the logits, the MoE routing (if any) \
         and a margin. Lower --n, --max-tokens or the number of prompts",
        shown(cache),
        prompt_lens.len(),
        per_position.unwrap_or(usize::MAX),
        config.n_layer,
        config.n_kv_head,
        config.head_dim,
        shown(bytes),
    )
}

/// The device models run on.
pub fn candle_device() -> nucleus_engine::Device {
    nucleus_engine::Device::Cpu
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_bias_parses_id_equals_bias() {
        assert_eq!(parse_logit_bias("42=-3.5"), Ok((42, -3.5)));
        assert_eq!(parse_logit_bias(" 7 = 100 "), Ok((7, 100.0)));
        for bad in ["42", "x=1", "1=y", "1=inf", "1=NaN", "-1=2"] {
            assert!(parse_logit_bias(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn completions_print_in_request_then_sample_order() {
        let c = |request, sample| Completion {
            request,
            sample,
            text: String::new(),
            token_ids: vec![],
            finish_reason: "length",
            seed: 0,
            usage: Usage {
                prompt_tokens: 0,
                completion_tokens: 0,
                total_tokens: 0,
            },
            logprobs: None,
            error: None,
            schema: None,
        };
        let mut order = InOrder {
            n: 2,
            next: (0, 0),
            done: BTreeMap::new(),
        };
        let keys = |v: Vec<Completion>| v.iter().map(|c| (c.request, c.sample)).collect::<Vec<_>>();
        order.push(c(1, 0));
        assert!(order.ready().is_empty());
        order.push(c(0, 1));
        assert!(order.ready().is_empty());
        order.push(c(0, 0));
        assert_eq!(keys(order.ready()), [(0, 0), (0, 1), (1, 0)]);
        order.push(c(1, 1));
        assert_eq!(keys(order.ready()), [(1, 1)]);
    }
}
