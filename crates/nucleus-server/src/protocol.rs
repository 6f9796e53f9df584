//! Request bodies of `/v1/completions` and `/v1/chat/completions`, read field by field so
//! that every error names its field (`param`), as OpenAI's and vLLM's do.
//!
//! The fields are OpenAI's, vLLM's extras (`vllm/entrypoints/openai/protocol.py`) and
//! llama.cpp server's flat names for the catalogue's processors (`tools/server/README.md`).
//! An unknown field is a 400 naming it (vLLM only warns; a silently ignored misspelling
//! changes the output behind the user's back). `tools`, `tool_choice` and `best_of` are a
//! 400 `not_supported`.

use std::collections::BTreeMap;

use nucleus_engine::{GrammarOptions, GrammarSpec, Prompt, Request, SamplingParams};
use nucleus_sampling::LogprobsKind;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// Which endpoint a body is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
}

/// Fields both endpoints take.
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "stream",
    "stream_options",
    "user",
    "response_format",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "xtc_probability",
    "xtc_threshold",
    "typical_p",
    "top_n_sigma",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "dynatemp_range",
    "dynatemp_exponent",
    "min_keep",
    "epsilon_cutoff",
    "eta_cutoff",
    "no_repeat_ngram_size",
    "repeat_penalty",
    "samplers",
    "logprobs_mode",
];
/// Fields of `/v1/completions` only.
const COMPLETIONS: &[&str] = &["prompt", "echo"];
/// Fields of `/v1/chat/completions` only.
const CHAT: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "chat_template_kwargs",
    "add_generation_prompt",
];
/// Fields refused with `not_supported`.
const NOT_SUPPORTED: &[(&str, &str)] = &[
    ("tools", "tool calling is not implemented"),
    ("tool_choice", "tool calling is not implemented"),
    ("parallel_tool_calls", "tool calling is not implemented"),
    ("functions", "function calling is not implemented"),
    ("function_call", "function calling is not implemented"),
    ("best_of", "best-of sampling is not implemented; use n"),
    (
        "suffix",
        "insertion (fill-in-the-middle) is not implemented",
    ),
];

/// The prompt of a request, before tokenisation.
#[derive(Clone, Debug)]
pub enum PromptInput {
    /// Completions: the prompts (one choice set per prompt).
    Completions(Vec<Prompt>),
    /// Chat: the messages (OpenAI form), `chat_template_kwargs`, `add_generation_prompt`.
    Chat {
        /// The `messages` value.
        messages: Value,
        /// `chat_template_kwargs`.
        kwargs: Map<String, Value>,
        /// `add_generation_prompt` (default true).
        add_generation_prompt: bool,
    },
}

/// A parsed request: everything but the prompts' token ids.
#[derive(Clone, Debug)]
pub struct Parsed {
    /// The prompt(s).
    pub prompt: PromptInput,
    /// Sampling parameters (`seed` as given).
    pub params: SamplingParams,
    /// `max_tokens` / `max_completion_tokens`, when given.
    pub max_tokens: Option<usize>,
    /// Samples per prompt.
    pub n: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// `stop_token_ids`.
    pub stop_token_ids: Vec<u32>,
    /// `ignore_eos`.
    pub ignore_eos: bool,
    /// The grammar of `response_format` / `structured_outputs` / `guided_*`.
    pub grammar: Option<GrammarSpec>,
    /// The field the grammar came from (for errors).
    pub grammar_field: &'static str,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Completions `logprobs: N` / chat `top_logprobs: N` with `logprobs: true`: how many
    /// alternatives per token (0: only the chosen token's).
    pub logprobs: Option<usize>,
    /// `echo` (completions).
    pub echo: bool,
    /// `model`, when given.
    pub model: Option<String>,
    /// `dry_sequence_breakers` as strings (tokenised by the caller), when given.
    pub dry_sequence_breakers: Option<Vec<String>>,
    /// `include_stop_str_in_output`.
    pub include_stop_str_in_output: bool,
    /// `skip_special_tokens` (default true).
    pub skip_special_tokens: bool,
    /// llama.cpp's `samplers`: the order of the filters, canonical names.
    pub samplers: Option<Vec<&'static str>>,
}

/// Reads one body.
///
/// # Errors
/// A 400 naming the field: not a JSON object, an unknown field, a value of the wrong type or
/// outside its range, a `not_supported` field.
pub fn parse(endpoint: Endpoint, body: &Value) -> Result<Parsed, ApiError> {
    let Value::Object(obj) = body else {
        return Err(ApiError::bad_request(
            "the body must be a JSON object",
            None,
        ));
    };
    for key in obj.keys() {
        if let Some((_, why)) = NOT_SUPPORTED.iter().find(|(k, _)| k == key) {
            if !obj[key].is_null() {
                return Err(ApiError::not_supported(key, why));
            }
            continue;
        }
        let own = match endpoint {
            Endpoint::Completions => COMPLETIONS,
            Endpoint::Chat => CHAT,
        };
        if !COMMON.contains(&key.as_str()) && !own.contains(&key.as_str()) {
            return Err(ApiError::bad_request(
                format!("unknown field `{key}`"),
                Some(key),
            ));
        }
    }
    let f = Fields(obj);
    let base = SamplingParams::default();
    let samplers = match obj.get("samplers").filter(|v| !v.is_null()) {
        None => None,
        Some(v) => Some(sampler_order(v)?),
    };
    let mut params = SamplingParams {
        temperature: f.f64("temperature")?.unwrap_or(base.temperature),
        top_p: f.f64("top_p")?.unwrap_or(base.top_p),
        top_k: f.i64("top_k")?.unwrap_or(base.top_k),
        min_p: f.f64("min_p")?.unwrap_or(base.min_p),
        repetition_penalty: match (f.f64("repetition_penalty")?, f.f64("repeat_penalty")?) {
            (Some(_), Some(_)) => {
                return Err(ApiError::bad_request(
                    "give one of `repetition_penalty` (vLLM) and `repeat_penalty` (llama.cpp)",
                    Some("repeat_penalty"),
                ))
            }
            (Some(r), None) | (None, Some(r)) => r,
            (None, None) => base.repetition_penalty,
        },
        presence_penalty: f.f64("presence_penalty")?.unwrap_or(0.0),
        frequency_penalty: f.f64("frequency_penalty")?.unwrap_or(0.0),
        logit_bias: f.logit_bias()?,
        min_tokens: f.usize("min_tokens")?.unwrap_or(0),
        seed: f.seed()?,
        typical_p: f.f64("typical_p")?.unwrap_or(base.typical_p),
        top_n_sigma: f.f64("top_n_sigma")?.unwrap_or(base.top_n_sigma),
        epsilon_cutoff: f.f64("epsilon_cutoff")?.unwrap_or(base.epsilon_cutoff),
        eta_cutoff: f.f64("eta_cutoff")?.unwrap_or(base.eta_cutoff),
        xtc_threshold: f.f64("xtc_threshold")?.unwrap_or(base.xtc_threshold),
        xtc_probability: f.f64("xtc_probability")?.unwrap_or(base.xtc_probability),
        min_keep: f.usize("min_keep")?.unwrap_or(base.min_keep),
        dynatemp_range: f.f64("dynatemp_range")?.unwrap_or(base.dynatemp_range),
        dynatemp_exponent: f
            .f64("dynatemp_exponent")?
            .unwrap_or(base.dynatemp_exponent),
        mirostat: match f.usize("mirostat")? {
            None => base.mirostat,
            Some(m) if m <= 2 => m as u8,
            Some(m) => {
                return Err(ApiError::bad_request(
                    format!("mirostat must be 0, 1 or 2, got {m}"),
                    Some("mirostat"),
                ))
            }
        },
        mirostat_tau: f.f64("mirostat_tau")?.unwrap_or(base.mirostat_tau),
        mirostat_eta: f.f64("mirostat_eta")?.unwrap_or(base.mirostat_eta),
        dry_multiplier: f.f64("dry_multiplier")?.unwrap_or(base.dry_multiplier),
        dry_base: f.f64("dry_base")?.unwrap_or(base.dry_base),
        dry_allowed_length: f
            .usize("dry_allowed_length")?
            .unwrap_or(base.dry_allowed_length),
        dry_penalty_last_n: f
            .i64("dry_penalty_last_n")?
            .unwrap_or(base.dry_penalty_last_n),
        no_repeat_ngram_size: f
            .usize("no_repeat_ngram_size")?
            .unwrap_or(base.no_repeat_ngram_size),
        ..base
    };
    // `top_k: -1` and `0` are off in vLLM; nucleus takes -1 and 0 as off too.
    let n = f.usize("n")?.unwrap_or(1);
    if !(1..=nucleus_engine::MAX_SAMPLES_PER_REQUEST).contains(&n) {
        return Err(ApiError::bad_request(
            format!(
                "n must be in 1..={}, got {n}",
                nucleus_engine::MAX_SAMPLES_PER_REQUEST
            ),
            Some("n"),
        ));
    }
    let max_tokens = match endpoint {
        Endpoint::Completions => f.usize("max_tokens")?,
        Endpoint::Chat => match (f.usize("max_completion_tokens")?, f.usize("max_tokens")?) {
            (Some(m), _) => Some(m),
            (None, m) => m,
        },
    };
    if max_tokens == Some(0) {
        let field = if obj.contains_key("max_completion_tokens") {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        return Err(ApiError::bad_request(
            format!("{field} must be at least 1"),
            Some(field),
        ));
    }
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                ApiError::bad_request("stop must be a string or a list of strings", Some("stop"))
            })?,
        Some(_) => {
            return Err(ApiError::bad_request(
                "stop must be a string or a list of strings",
                Some("stop"),
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad_request(
            "an empty stop string never matches",
            Some("stop"),
        ));
    }
    let stop_token_ids = f.ids("stop_token_ids")?.unwrap_or_default();
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::bad_request(
                    "stream_options is only allowed with stream: true",
                    Some("stream_options"),
                ));
            }
            if o.get("continuous_usage_stats") == Some(&Value::Bool(true)) {
                return Err(ApiError::not_supported(
                    "stream_options",
                    "continuous_usage_stats (usage in every chunk) is not implemented",
                ));
            }
            for k in o.keys() {
                if k != "include_usage" && k != "continuous_usage_stats" {
                    return Err(ApiError::bad_request(
                        format!("unknown field `stream_options.{k}`"),
                        Some("stream_options"),
                    ));
                }
            }
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::bad_request(
                        "stream_options.include_usage must be a boolean",
                        Some("stream_options"),
                    ))
                }
            }
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "stream_options must be an object",
                Some("stream_options"),
            ))
        }
    };
    let logprobs = match endpoint {
        Endpoint::Completions => f.usize("logprobs")?,
        Endpoint::Chat => {
            let on = f.bool("logprobs")?.unwrap_or(false);
            let top = f.usize("top_logprobs")?;
            match (on, top) {
                (false, Some(_)) => {
                    return Err(ApiError::bad_request(
                        "top_logprobs needs logprobs: true",
                        Some("top_logprobs"),
                    ))
                }
                (false, None) => None,
                (true, top) => Some(top.unwrap_or(0)),
            }
        }
    };
    if let Some(k) = logprobs {
        // OpenAI allows up to 20; vLLM up to its --max-logprobs (20).
        if k > 20 {
            let field = match endpoint {
                Endpoint::Completions => "logprobs",
                Endpoint::Chat => "top_logprobs",
            };
            return Err(ApiError::bad_request(
                format!("{field} must be at most 20, got {k}"),
                Some(field),
            ));
        }
        params.logprobs = Some(k);
        params.logprobs_kind = LogprobsKind::Raw;
    }
    // A nucleus extension: vLLM's server-wide `--logprobs-mode`, per request. The processed
    // kind is the distribution the token was drawn from (after the grammar, penalties,
    // temperature and filters), which is what the page at `/` shows.
    match f.get("logprobs_mode") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) if m == "raw_logprobs" => {}
        Some(Value::String(m)) if m == "processed_logprobs" => {
            params.logprobs_kind = LogprobsKind::Processed;
        }
        Some(Value::String(m)) if m == "raw_logits" || m == "processed_logits" => {
            return Err(ApiError::not_supported(
                "logprobs_mode",
                "logits are not reported; use raw_logprobs or processed_logprobs",
            ))
        }
        Some(other) => {
            return Err(ApiError::bad_request(
                format!(
                    "logprobs_mode must be \"raw_logprobs\" or \"processed_logprobs\", got {other}"
                ),
                Some("logprobs_mode"),
            ))
        }
    }
    if logprobs.is_none() && f.get("logprobs_mode").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad_request(
            "logprobs_mode has no effect without logprobs",
            Some("logprobs_mode"),
        ));
    }
    let echo = f.bool("echo")?.unwrap_or(false);
    if echo && logprobs.is_some() {
        return Err(ApiError::not_supported(
            "echo",
            "echo with logprobs needs the prompt's log-probabilities, which are not computed",
        ));
    }
    if echo && stream {
        return Err(ApiError::not_supported(
            "echo",
            "echo with stream is not implemented",
        ));
    }
    let skip_special_tokens = f.bool("skip_special_tokens")?.unwrap_or(true);
    let include_stop_str_in_output = f.bool("include_stop_str_in_output")?.unwrap_or(false);
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    if let Some(u) = obj.get("user") {
        if !u.is_string() && !u.is_null() {
            return Err(ApiError::bad_request("user must be a string", Some("user")));
        }
    }
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "model must be a string",
                Some("model"),
            ))
        }
    };
    let dry_sequence_breakers = match obj.get("dry_sequence_breakers") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "dry_sequence_breakers must be a list of strings",
                        Some("dry_sequence_breakers"),
                    )
                })?,
        ),
        Some(_) => {
            return Err(ApiError::bad_request(
                "dry_sequence_breakers must be a list of strings",
                Some("dry_sequence_breakers"),
            ))
        }
    };
    let (grammar, grammar_field) = match grammar(obj)? {
        Some((field, g)) => (Some(g), field),
        None => (None, "response_format"),
    };
    if grammar.is_some() && ignore_eos {
        return Err(ApiError::bad_request(
            "ignore_eos cannot be used with structured output: the end-of-generation token is \
             where the grammar ends",
            Some("ignore_eos"),
        ));
    }
    if let Some(max) = max_tokens {
        if params.min_tokens > max {
            return Err(ApiError::bad_request(
                format!(
                    "min_tokens {} is more than max_tokens {max}",
                    params.min_tokens
                ),
                Some("min_tokens"),
            ));
        }
    }
    params
        .validate()
        .map_err(|e| ApiError::bad_request(e.to_string(), param_of(&e.to_string())))?;
    let prompt = match endpoint {
        Endpoint::Completions => PromptInput::Completions(prompts(obj.get("prompt"))?),
        Endpoint::Chat => {
            let messages = obj
                .get("messages")
                .filter(|v| !v.is_null())
                .cloned()
                .ok_or_else(|| ApiError::bad_request("messages is required", Some("messages")))?;
            if messages.as_array().is_some_and(Vec::is_empty) {
                return Err(ApiError::bad_request(
                    "messages is empty: give at least one message",
                    Some("messages"),
                ));
            }
            let kwargs = template_kwargs(obj)?;
            PromptInput::Chat {
                messages,
                kwargs,
                add_generation_prompt: f.bool("add_generation_prompt")?.unwrap_or(true),
            }
        }
    };
    Ok(Parsed {
        prompt,
        params,
        max_tokens,
        n,
        stop,
        stop_token_ids,
        ignore_eos,
        grammar,
        grammar_field,
        stream,
        include_usage,
        logprobs,
        echo,
        model,
        dry_sequence_breakers,
        include_stop_str_in_output,
        skip_special_tokens,
        samplers,
    })
}

/// llama.cpp's sampler names (`common/sampling.cpp`, `common_sampler_types_from_names`,
/// with its aliases) -> the canonical name.
const SAMPLER_NAMES: &[(&str, &str)] = &[
    ("penalties", "penalties"),
    ("dry", "dry"),
    ("top_n_sigma", "top_n_sigma"),
    ("top-n-sigma", "top_n_sigma"),
    ("top_k", "top_k"),
    ("top-k", "top_k"),
    ("typ_p", "typ_p"),
    ("typ-p", "typ_p"),
    ("typ", "typ_p"),
    ("typical_p", "typ_p"),
    ("typical-p", "typ_p"),
    ("typical", "typ_p"),
    ("top_p", "top_p"),
    ("top-p", "top_p"),
    ("nucleus", "top_p"),
    ("min_p", "min_p"),
    ("min-p", "min_p"),
    ("xtc", "xtc"),
    ("temperature", "temperature"),
    ("temp", "temperature"),
];

/// `samplers`: a list of llama.cpp sampler names (or one string of them separated by `;`),
/// each at most once.
fn sampler_order(v: &Value) -> Result<Vec<&'static str>, ApiError> {
    let bad = |m: String| ApiError::bad_request(m, Some("samplers"));
    let names: Vec<String> = match v {
        Value::String(s) => s.split(';').map(str::to_string).collect(),
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("samplers must be a list of sampler names".into()))?,
        _ => return Err(bad("samplers must be a list of sampler names".into())),
    };
    let mut out: Vec<&'static str> = Vec::new();
    for name in names {
        let Some(&(_, canonical)) = SAMPLER_NAMES.iter().find(|(n, _)| *n == name) else {
            if name == "infill" {
                return Err(ApiError::not_supported(
                    "samplers",
                    "the infill sampler is not implemented",
                ));
            }
            return Err(bad(format!(
                "unknown sampler {name:?}: known are penalties, dry, top_n_sigma, top_k, \
                 typ_p, top_p, min_p, xtc, temperature (llama.cpp's names)"
            )));
        };
        if out.contains(&canonical) {
            return Err(bad(format!("sampler {canonical:?} is given twice")));
        }
        out.push(canonical);
    }
    Ok(out)
}

/// The processor chain of a request with `samplers`: logit bias and `min_tokens` first (as
/// llama.cpp applies the bias before its samplers), then each named sampler, in order, with
/// the request's values (one that is off adds nothing), then the selection: greedy at
/// temperature 0, mirostat 1 / 2 when set (llama.cpp's mirostat replaces the tail of its
/// chain), else a draw from the request's stream. `dry_breakers` are the DRY sequence
/// breakers as token ids.
///
/// # Errors
/// A 400 naming `samplers` when a field has no place in the order (fixed-path only:
/// `epsilon_cutoff`, `eta_cutoff`, `no_repeat_ngram_size`) or the chain is refused.
pub fn sampler_chain(
    params: &SamplingParams,
    order: &[&str],
    dry_breakers: &[Vec<u32>],
) -> Result<nucleus_sampling::chain::SamplerChain, ApiError> {
    use serde_json::json;
    let bad = |m: String| ApiError::bad_request(m, Some("samplers"));
    for (set, field) in [
        (params.epsilon_cutoff > 0.0, "epsilon_cutoff"),
        (params.eta_cutoff > 0.0, "eta_cutoff"),
        (params.no_repeat_ngram_size > 0, "no_repeat_ngram_size"),
    ] {
        if set {
            return Err(bad(format!(
                "{field} has no place in a samplers order (llama.cpp has no such sampler); \
                 leave samplers out to use the fixed order"
            )));
        }
    }
    let mut configs: Vec<Value> = Vec::new();
    if !params.logit_bias.is_empty() {
        let bias: Map<String, Value> = params
            .logit_bias
            .iter()
            .map(|(id, b)| (id.to_string(), json!(b)))
            .collect();
        configs.push(json!({"logit_bias": {"bias": bias}}));
    }
    if params.min_tokens > 0 {
        configs.push(json!({"min_tokens": {"min_tokens": params.min_tokens}}));
    }
    let min_keep = params.min_keep;
    let greedy = params.is_greedy();
    for &name in order {
        match name {
            "penalties" => {
                if params.repetition_penalty != 1.0 {
                    configs.push(
                        json!({"repetition_penalty": {"penalty": params.repetition_penalty}}),
                    );
                }
                if params.frequency_penalty != 0.0 {
                    configs
                        .push(json!({"frequency_penalty": {"penalty": params.frequency_penalty}}));
                }
                if params.presence_penalty != 0.0 {
                    configs.push(json!({"presence_penalty": {"penalty": params.presence_penalty}}));
                }
            }
            "dry" if params.dry_multiplier > 0.0 => configs.push(json!({"dry": {
                "multiplier": params.dry_multiplier, "base": params.dry_base,
                "allowed_length": params.dry_allowed_length,
                "penalty_last_n": params.dry_penalty_last_n,
                "sequence_breakers": dry_breakers,
            }})),
            "top_n_sigma" if params.top_n_sigma > 0.0 => {
                configs.push(json!({"top_n_sigma": {"n": params.top_n_sigma}}))
            }
            "top_k" if params.top_k > 0 => {
                configs.push(json!({"top_k": {"k": params.top_k, "min_keep": min_keep}}))
            }
            "typ_p" if params.typical_p < 1.0 => {
                configs.push(json!({"typical": {"p": params.typical_p, "min_keep": min_keep}}))
            }
            "top_p" if params.top_p < 1.0 => {
                configs.push(json!({"top_p": {"p": params.top_p, "min_keep": min_keep}}))
            }
            "min_p" if params.min_p > 0.0 => {
                configs.push(json!({"min_p": {"p": params.min_p, "min_keep": min_keep}}))
            }
            "xtc" if params.xtc_probability > 0.0 => configs.push(json!({"xtc": {
                "threshold": params.xtc_threshold, "probability": params.xtc_probability,
                "min_keep": min_keep,
            }})),
            "temperature" if !greedy => {
                if params.dynatemp_range > 0.0 {
                    configs.push(json!({"dynatemp": {"t": params.temperature,
                        "range": params.dynatemp_range, "exponent": params.dynatemp_exponent}}));
                } else if params.temperature != 1.0 {
                    configs.push(json!({"temperature": {"t": params.temperature}}));
                }
            }
            _ => {}
        }
    }
    let kind = match params.logprobs_kind {
        LogprobsKind::Raw => "raw",
        LogprobsKind::Processed => "processed",
    };
    let mut selection = if greedy {
        json!({"greedy": {}})
    } else {
        match params.mirostat {
            1 => json!({"mirostat": {"tau": params.mirostat_tau, "eta": params.mirostat_eta}}),
            2 => json!({"mirostat_v2": {"tau": params.mirostat_tau, "eta": params.mirostat_eta}}),
            _ => json!({"sample": {}}),
        }
    };
    if let Some(Value::Object(sel)) = selection
        .as_object_mut()
        .and_then(|o| o.values_mut().next())
    {
        if let Some(k) = params.logprobs {
            sel.insert("logprobs".into(), json!(k));
            sel.insert("logprobs_kind".into(), json!(kind));
        }
        if !greedy {
            if let Some(seed) = params.seed {
                sel.insert("seed".into(), json!(seed));
            }
        }
    }
    configs.push(selection);
    let configs: Vec<nucleus_sampling::chain::ProcessorConfig> = configs
        .into_iter()
        .map(serde_json::from_value)
        .collect::<Result<_, _>>()
        .map_err(|e| bad(format!("building the chain: {e}")))?;
    nucleus_sampling::chain::SamplerChain::from_config(&configs)
        .map_err(|e| bad(format!("the samplers' chain: {e}")))
}

/// The field a [`SamplingParams::validate`] message names (its first word).
pub(crate) fn param_of(message: &str) -> Option<&'static str> {
    COMMON
        .iter()
        .chain(CHAT)
        .copied()
        .filter(|f| message.contains(f))
        .max_by_key(|f| f.len())
}

/// `chat_template_kwargs`: an object of extra template variables (none when absent).
pub(crate) fn template_kwargs(obj: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(o)) => Ok(o.clone()),
        Some(_) => Err(ApiError::bad_request(
            "chat_template_kwargs must be an object",
            Some("chat_template_kwargs"),
        )),
    }
}

/// `prompt`: a string, a list of strings, a list of ids, or a list of lists of ids.
fn prompts(v: Option<&Value>) -> Result<Vec<Prompt>, ApiError> {
    let bad = || {
        ApiError::bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of \
             lists of token ids",
            Some("prompt"),
        )
    };
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter()
            .map(|x| x.as_u64().and_then(|i| u32::try_from(i).ok()))
            .collect()
    };
    let out = match v {
        None | Some(Value::Null) => {
            return Err(ApiError::bad_request("prompt is required", Some("prompt")))
        }
        Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
        Some(Value::Array(a)) if a.is_empty() => return Err(bad()),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => a
            .iter()
            .map(|s| Prompt::Text(s.as_str().unwrap_or_default().to_string()))
            .collect(),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => {
            vec![Prompt::Tokens(ids(a).ok_or_else(bad)?)]
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_array) => a
            .iter()
            .map(|x| {
                x.as_array()
                    .and_then(|x| ids(x))
                    .map(Prompt::Tokens)
                    .ok_or_else(bad)
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad()),
    };
    if out.iter().any(|p| {
        matches!(p, Prompt::Tokens(t) if t.is_empty())
            || matches!(p, Prompt::Text(t) if t.is_empty())
    }) {
        return Err(ApiError::bad_request("a prompt is empty", Some("prompt")));
    }
    Ok(out)
}

/// The grammar of `response_format`, `structured_outputs` or the legacy `guided_*` fields
/// (at most one of them).
fn grammar(obj: &Map<String, Value>) -> Result<Option<(&'static str, GrammarSpec)>, ApiError> {
    let mut found: Vec<(&str, GrammarSpec)> = Vec::new();
    if let Some(rf) = obj.get("response_format").filter(|v| !v.is_null()) {
        let bad = |m: &str| ApiError::bad_request(m.to_string(), Some("response_format"));
        let kind = rf
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("response_format needs a string `type`"))?;
        if let Some(o) = rf.as_object() {
            for k in o.keys() {
                if k != "type" && !(k == "json_schema" && kind == "json_schema") {
                    return Err(bad(&format!(
                        "unknown field `response_format.{k}` for type {kind:?}"
                    )));
                }
            }
        }
        match kind {
            "text" => {}
            "json_object" => found.push((
                "response_format",
                GrammarSpec::JsonSchema(r#"{"type":"object"}"#.into()),
            )),
            "json_schema" => {
                let js = rf
                    .get("json_schema")
                    .and_then(Value::as_object)
                    .ok_or_else(|| {
                        bad("response_format json_schema needs a `json_schema` object")
                    })?;
                for k in js.keys() {
                    if !["name", "schema", "strict", "description"].contains(&k.as_str()) {
                        return Err(bad(&format!("unknown field `json_schema.{k}`")));
                    }
                }
                if let Some(s) = js.get("strict") {
                    if !s.is_boolean() && !s.is_null() {
                        return Err(bad("json_schema.strict must be a boolean"));
                    }
                }
                let schema = js
                    .get("schema")
                    .filter(|v| v.is_object() || v.is_boolean())
                    .ok_or_else(|| bad("response_format json_schema needs a `schema` object"))?;
                // Schemas are always compiled exactly (llguidance refuses what it cannot
                // enforce), so `strict: true` and `false` behave alike: a schema that does not
                // compile is a 400.
                found.push((
                    "response_format",
                    GrammarSpec::JsonSchema(schema.to_string()),
                ));
            }
            other => {
                return Err(bad(&format!(
                    "response_format type must be text, json_object or json_schema, got {other:?}"
                )))
            }
        }
    }
    let mut structured = |field: &'static str, key: &str, v: &Value| -> Result<(), ApiError> {
        let bad = |m: String| ApiError::bad_request(m, Some(field));
        let spec = match key {
            "json" => match v {
                Value::String(s) => GrammarSpec::JsonSchema(s.clone()),
                Value::Object(_) | Value::Bool(_) => GrammarSpec::JsonSchema(v.to_string()),
                _ => return Err(bad(format!("{field}: json must be a schema"))),
            },
            "json_object" => match v {
                Value::Bool(true) => GrammarSpec::JsonSchema(r#"{"type":"object"}"#.into()),
                Value::Bool(false) => return Ok(()),
                _ => return Err(bad(format!("{field}: json_object must be a boolean"))),
            },
            "regex" => GrammarSpec::Regex(
                v.as_str()
                    .ok_or_else(|| bad(format!("{field}: regex must be a string")))?
                    .to_string(),
            ),
            "choice" => {
                let choices: Vec<&str> = v
                    .as_array()
                    .and_then(|a| a.iter().map(Value::as_str).collect())
                    .filter(|c: &Vec<&str>| !c.is_empty())
                    .ok_or_else(|| {
                        bad(format!(
                            "{field}: choice must be a non-empty list of strings"
                        ))
                    })?;
                GrammarSpec::Regex(
                    choices
                        .iter()
                        .map(|c| regex_escape(c))
                        .collect::<Vec<_>>()
                        .join("|"),
                )
            }
            "grammar" => {
                let text = v
                    .as_str()
                    .ok_or_else(|| bad(format!("{field}: grammar must be a string")))?;
                if text.contains("::=") {
                    return Err(bad(format!(
                        "{field}: this grammar looks like GBNF (`::=`); nucleus takes Lark \
                         grammars (llguidance's dialect: `start: ...`)"
                    )));
                }
                GrammarSpec::Lark(text.to_string())
            }
            other => return Err(bad(format!("unknown field `{field}.{other}`"))),
        };
        found.push((field, spec));
        Ok(())
    };
    if let Some(so) = obj.get("structured_outputs").filter(|v| !v.is_null()) {
        let o = so.as_object().ok_or_else(|| {
            ApiError::bad_request(
                "structured_outputs must be an object",
                Some("structured_outputs"),
            )
        })?;
        for (k, v) in o {
            if !v.is_null() {
                structured("structured_outputs", k, v)?;
            }
        }
    }
    for (field, key) in [
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ] {
        if let Some(v) = obj.get(field).filter(|v| !v.is_null()) {
            structured(field, key, v)?;
        }
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ if found[0].0 == found[1].0 => Err(ApiError::bad_request(
            format!(
                "give one kind of structured output in {}: one of json, regex, choice, grammar, \
                 json_object",
                found[0].0
            ),
            Some(found[0].0),
        )),
        _ => Err(ApiError::bad_request(
            format!(
                "give one kind of structured output, not {}",
                found
                    .iter()
                    .map(|(f, _)| *f)
                    .collect::<Vec<_>>()
                    .join(" and ")
            ),
            Some(found[1].0),
        )),
    }
}

/// `s` as a regular expression matching exactly `s`.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    format!("({out})")
}

/// Typed reads of optional fields, each error naming its field.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn f64(&self, key: &str) -> Result<Option<f64>, ApiError> {
        self.get(key)
            .map(|v| {
                v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| {
                    ApiError::bad_request(format!("{key} must be a number"), Some(key))
                })
            })
            .transpose()
    }

    fn i64(&self, key: &str) -> Result<Option<i64>, ApiError> {
        self.get(key)
            .map(|v| {
                v.as_i64().ok_or_else(|| {
                    ApiError::bad_request(
                        format!("{key} must be an integer from -2^63 to 2^63 - 1, got {v}"),
                        Some(key),
                    )
                })
            })
            .transpose()
    }

    fn usize(&self, key: &str) -> Result<Option<usize>, ApiError> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .ok_or_else(|| {
                        ApiError::bad_request(
                            format!("{key} must be a non-negative integer, got {v}"),
                            Some(key),
                        )
                    })
            })
            .transpose()
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        self.get(key)
            .map(|v| {
                v.as_bool().ok_or_else(|| {
                    ApiError::bad_request(format!("{key} must be a boolean"), Some(key))
                })
            })
            .transpose()
    }

    fn ids(&self, key: &str) -> Result<Option<Vec<u32>>, ApiError> {
        self.get(key)
            .map(|v| {
                v.as_array()
                    .and_then(|a| {
                        a.iter()
                            .map(|x| x.as_u64().and_then(|i| u32::try_from(i).ok()))
                            .collect()
                    })
                    .ok_or_else(|| {
                        ApiError::bad_request(
                            format!("{key} must be a list of token ids"),
                            Some(key),
                        )
                    })
            })
            .transpose()
    }

    fn seed(&self) -> Result<Option<u64>, ApiError> {
        self.get("seed")
            .map(|v| {
                v.as_u64().ok_or_else(|| {
                    ApiError::bad_request(
                        format!("seed must be an integer in 0..=18446744073709551615, got {v}"),
                        Some("seed"),
                    )
                })
            })
            .transpose()
    }

    /// `logit_bias`: token id (as a string) -> bias, clamped to [-100, 100] as vLLM does.
    fn logit_bias(&self) -> Result<BTreeMap<u32, f64>, ApiError> {
        let Some(v) = self.get("logit_bias") else {
            return Ok(BTreeMap::new());
        };
        let bad = |m: String| ApiError::bad_request(m, Some("logit_bias"));
        let o = v
            .as_object()
            .ok_or_else(|| bad("logit_bias must be an object of token id -> bias".into()))?;
        o.iter()
            .map(|(k, b)| {
                // The canonical decimal only: "01" or "+1" would alias "1", and of two keys
                // for one id the second would silently replace the first.
                let id: u32 = k
                    .parse()
                    .ok()
                    .filter(|id: &u32| id.to_string() == *k)
                    .ok_or_else(|| {
                        bad(format!(
                            "logit_bias key {k:?} is not a token id (a decimal integer without \
                             sign or leading zeros)"
                        ))
                    })?;
                let b = b
                    .as_f64()
                    .filter(|b| b.is_finite())
                    .ok_or_else(|| bad(format!("logit_bias[{k:?}] must be a number")))?;
                Ok((id, b.clamp(-100.0, 100.0)))
            })
            .collect()
    }
}

/// The engine requests of a parsed body: one per prompt, every one with the same
/// parameters; `prompts` the token ids, `max_tokens` per prompt resolved by the caller.
///
/// # Errors
/// A 400 naming `samplers` when its chain cannot be built ([`sampler_chain`]).
pub fn engine_requests(
    parsed: &Parsed,
    prompts: Vec<(Vec<u32>, usize)>,
    dry_sequence_breakers: Option<Vec<Vec<u32>>>,
    grammar_options: GrammarOptions,
) -> Result<Vec<Request>, ApiError> {
    let mut params = parsed.params.clone();
    if let Some(b) = dry_sequence_breakers {
        params.dry_sequence_breakers = b;
    }
    let chain = match &parsed.samplers {
        Some(order) => {
            // The chain draws from the request's stream: its seed is fixed here.
            if params.seed.is_none() {
                params.seed = Some(nucleus_sampling::os_seed().map_err(|e| {
                    ApiError::internal(format!("no seed could be drawn from the OS: {e}"))
                })?);
            }
            Some(sampler_chain(
                &params,
                order,
                &params.dry_sequence_breakers,
            )?)
        }
        None => None,
    };
    Ok(prompts
        .into_iter()
        .map(|(ids, max_tokens)| Request {
            prompt: Prompt::Tokens(ids),
            params: params.clone(),
            max_tokens,
            stop_token_ids: parsed.stop_token_ids.clone(),
            stop_strings: parsed.stop.clone(),
            n: parsed.n,
            ignore_eos: parsed.ignore_eos,
            grammar: parsed.grammar.clone(),
            grammar_options,
            include_stop_str_in_output: parsed.include_stop_str_in_output,
            skip_special_tokens: parsed.skip_special_tokens,
            chain: chain.clone(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(endpoint: Endpoint, body: Value) -> ApiError {
        match parse(endpoint, &body) {
            Err(e) => e,
            Ok(_) => panic!("{body} parsed"),
        }
    }

    #[test]
    fn unknown_and_unsupported_fields_are_named() {
        let e = err(
            Endpoint::Completions,
            json!({"prompt": "a", "temprature": 1}),
        );
        assert_eq!(e.param.as_deref(), Some("temprature"));
        let e = err(Endpoint::Chat, json!({"messages": [], "tools": []}));
        assert_eq!(e.code.as_deref(), Some("not_supported"));
        assert_eq!(e.param.as_deref(), Some("tools"));
        let e = err(Endpoint::Completions, json!({"prompt": "a", "best_of": 2}));
        assert_eq!(e.param.as_deref(), Some("best_of"));
        // `messages` is not a completions field.
        let e = err(
            Endpoint::Completions,
            json!({"prompt": "a", "messages": []}),
        );
        assert_eq!(e.param.as_deref(), Some("messages"));
    }

    #[test]
    fn values_out_of_range_name_their_field() {
        for (field, value) in [
            ("temperature", json!(-1)),
            ("top_p", json!(0)),
            ("top_p", json!(1.5)),
            ("min_p", json!(2)),
            ("n", json!(0)),
            ("max_tokens", json!(0)),
            ("seed", json!(-3)),
            ("logprobs", json!(21)),
            ("stop", json!(3)),
        ] {
            let mut body = json!({"prompt": "a"});
            body[field] = value.clone();
            let e = err(Endpoint::Completions, body);
            assert_eq!(
                e.param.as_deref(),
                Some(field),
                "{field} = {value}: {}",
                e.message
            );
        }
    }

    #[test]
    fn prompts_in_every_form() {
        let p = |v: Value| match parse(Endpoint::Completions, &json!({"prompt": v})) {
            Ok(Parsed {
                prompt: PromptInput::Completions(p),
                ..
            }) => p,
            other => panic!("{other:?}"),
        };
        assert_eq!(p(json!("hi")), vec![Prompt::Text("hi".into())]);
        assert_eq!(p(json!(["a", "b"])).len(), 2);
        assert_eq!(p(json!([1, 2, 3])), vec![Prompt::Tokens(vec![1, 2, 3])]);
        assert_eq!(
            p(json!([[1], [2, 3]])),
            vec![Prompt::Tokens(vec![1]), Prompt::Tokens(vec![2, 3])]
        );
        let e = err(Endpoint::Completions, json!({"prompt": [1, "a"]}));
        assert_eq!(e.param.as_deref(), Some("prompt"));
    }

    #[test]
    fn structured_outputs_in_every_spelling() {
        let g = |body: Value| parse(Endpoint::Chat, &body).map(|p| p.grammar);
        let m = json!([{"role": "user", "content": "x"}]);
        assert!(matches!(
            g(json!({"messages": m, "response_format": {"type": "json_object"}})),
            Ok(Some(GrammarSpec::JsonSchema(_)))
        ));
        assert!(matches!(
            g(json!({"messages": m, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}, "strict": true}}})),
            Ok(Some(GrammarSpec::JsonSchema(s))) if s == r#"{"type":"integer"}"#
        ));
        assert!(matches!(
            g(json!({"messages": m, "structured_outputs": {"regex": "a+"}})),
            Ok(Some(GrammarSpec::Regex(s))) if s == "a+"
        ));
        assert!(matches!(
            g(json!({"messages": m, "guided_choice": ["yes", "no."]})),
            Ok(Some(GrammarSpec::Regex(s))) if s == r"(yes)|(no\.)"
        ));
        let e = err(
            Endpoint::Chat,
            json!({"messages": m, "structured_outputs": {"grammar": "root ::= \"a\""}}),
        );
        assert!(e.message.contains("GBNF"), "{}", e.message);
        let e = err(
            Endpoint::Chat,
            json!({"messages": m, "guided_regex": "a", "guided_json": {}}),
        );
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
    }

    #[test]
    fn chat_logprobs_and_limits() {
        let m = json!([{"role": "user", "content": "x"}]);
        let e = err(Endpoint::Chat, json!({"messages": m, "top_logprobs": 2}));
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let p = parse(
            Endpoint::Chat,
            &json!({"messages": m, "logprobs": true, "top_logprobs": 3, "max_completion_tokens": 5}),
        )
        .expect("parses");
        assert_eq!((p.logprobs, p.max_tokens), (Some(3), Some(5)));
        let bias = parse(
            Endpoint::Completions,
            &json!({"prompt": "a", "logit_bias": {"7": 300, "8": -2.5}}),
        )
        .expect("parses")
        .params
        .logit_bias;
        assert_eq!(bias, BTreeMap::from([(7, 100.0), (8, -2.5)]));
    }
}
