//! The HTTP routes and the OpenAI response shapes.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request as HttpRequest, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use nucleus_engine::{messages_from_openai, FinishReason, Prompt, RenderOptions, StepOutput};
use nucleus_grammar::{CompiledGrammar, SchemaVerdict};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::protocol::{self, Endpoint, Parsed, PromptInput};
use crate::worker::{Event, Job};
use crate::AppState;

/// The router: every route, the API-key check, panics caught as 500s.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(on_panic))
        .with_state(state)
}

fn on_panic(panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let message = crate::worker::panic_message(&panic);
    tracing::error!("a request handler panicked: {message}");
    ApiError::internal(format!("the server failed on this request: {message}")).into_response()
}

async fn not_found(req: HttpRequest) -> ApiError {
    ApiError {
        code: Some("not_found".into()),
        ..ApiError::not_found(
            format!("no route {} {}", req.method(), req.uri().path()),
            None,
        )
    }
}

async fn method_not_allowed(req: HttpRequest) -> ApiError {
    ApiError {
        status: axum::http::StatusCode::METHOD_NOT_ALLOWED,
        kind: "invalid_request_error",
        message: format!("{} is not allowed on {}", req.method(), req.uri().path()),
        param: None,
        code: Some("method_not_allowed".into()),
    }
}

/// With an API key: everything but `/health`, `/v1/models` and `/` needs `Authorization:
/// Bearer KEY` (or llama.cpp's `X-Api-Key: KEY`).
async fn auth(State(state): State<Arc<AppState>>, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        let public = matches!(req.uri().path(), "/health" | "/v1/models" | "/");
        if !public {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
            if !given.is_some_and(|g| same(g.as_bytes(), key.as_bytes())) {
                return ApiError::unauthorized().into_response();
            }
        }
    }
    next.run(req).await
}

/// Constant-time comparison (for the API key).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The page at `/` (src/page/index.html): a completion and chat box that streams the text and
/// shows, for each token, the candidates it was drawn from. One file, no external fetches.
const PAGE: &str = include_str!("page/index.html");

async fn index() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // The page loads nothing from elsewhere and talks to this server only.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
                 frame-ancestors 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        PAGE,
    )
        .into_response()
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.config.served_model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "nucleus",
            "root": state.root,
            "parent": null,
            "max_model_len": state.config.max_model_len,
        }],
    }))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

/// The body as JSON, within `--max-body-bytes`.
async fn read_json(state: &AppState, req: HttpRequest) -> Result<Value, ApiError> {
    let limit = state.config.max_body_bytes;
    let over = || {
        ApiError::bad_request(
            format!("the request body is over --max-body-bytes ({limit} bytes)"),
            None,
        )
    };
    // A declared length over the limit is refused before anything is read.
    if let Some(len) = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if len > limit as u64 {
            return Err(over());
        }
    }
    let read = axum::body::to_bytes(req.into_body(), limit);
    let bytes = match tokio::time::timeout(BODY_READ_LIMIT, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(_)) => return Err(over()),
        Err(_) => {
            return Err(ApiError::bad_request(
                format!(
                    "the request body did not arrive within {} s",
                    BODY_READ_LIMIT.as_secs()
                ),
                None,
            ))
        }
    };
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}"), None))
}

/// How long a client may take to send its request body.
const BODY_READ_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A random-looking id with `prefix`.
fn new_id(prefix: &str) -> String {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{prefix}-{:016x}{:08x}", t ^ 0x9e37_79b9_7f4a_7c15, n)
}

async fn completions(State(state): State<Arc<AppState>>, body: HttpRequest) -> Response {
    generate(state, Endpoint::Completions, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(State(state): State<Arc<AppState>>, body: HttpRequest) -> Response {
    generate(state, Endpoint::Chat, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// A request ready for the engine, and what the answer needs.
struct Prepared {
    parsed: Parsed,
    /// Per prompt: the token ids and the text shown by `echo`.
    prompts: Vec<(Vec<u32>, String)>,
    /// The request's JSON Schema compiled (its other grammars: `None`), to validate each
    /// choice.
    schema: Option<Arc<CompiledGrammar>>,
}

/// Parse, apply the model's defaults, tokenise and check lengths.
fn prepare(state: &AppState, endpoint: Endpoint, body: &Value) -> Result<Prepared, ApiError> {
    let mut parsed = protocol::parse(endpoint, body)?;
    if let Some(model) = &parsed.model {
        if model != &state.config.served_model_name {
            return Err(ApiError::not_found(
                format!(
                    "the model `{model}` does not exist; this server serves `{}`",
                    state.config.served_model_name
                ),
                Some("model"),
            ));
        }
    }
    // generation_config.json's defaults for the fields the request leaves out, as vLLM.
    let given = |k: &str| body.get(k).is_some_and(|v| !v.is_null());
    let d = &state.defaults;
    if !given("temperature") {
        if let Some(t) = d.temperature {
            parsed.params.temperature = t;
        }
    }
    if !given("top_k") {
        if let Some(k) = d.top_k {
            parsed.params.top_k = k;
        }
    }
    if !given("top_p") {
        if let Some(p) = d.top_p {
            parsed.params.top_p = p;
        }
    }
    if !given("min_p") {
        if let Some(p) = d.min_p {
            parsed.params.min_p = p;
        }
    }
    if !given("repetition_penalty") && !given("repeat_penalty") {
        if let Some(r) = d.repetition_penalty {
            parsed.params.repetition_penalty = r;
        }
    }
    let tok = &state.tokenizer;
    let prompts: Vec<(Vec<u32>, String)> = match &parsed.prompt {
        PromptInput::Completions(list) => list
            .iter()
            .map(|p| match p {
                Prompt::Text(t) => tok
                    .encode(t, true, true)
                    .map(|ids| (ids, t.clone()))
                    .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt"))),
                Prompt::Tokens(ids) => {
                    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= state.vocab_size) {
                        return Err(ApiError::bad_request(
                            format!(
                                "prompt token id {bad} is outside the vocabulary (0 to {})",
                                state.vocab_size - 1
                            ),
                            Some("prompt"),
                        ));
                    }
                    // `echo` shows the prompt as the completion's text is shown: without
                    // special tokens unless `skip_special_tokens` is false.
                    let text = tok
                        .decode(ids, parsed.skip_special_tokens)
                        .unwrap_or_default();
                    Ok((ids.clone(), text))
                }
            })
            .collect::<Result<_, _>>()?,
        PromptInput::Chat {
            messages,
            kwargs,
            add_generation_prompt,
        } => {
            let template = state.chat_template.as_ref().ok_or_else(|| {
                ApiError::bad_request(
                    "this model has no chat template: use /v1/completions",
                    Some("messages"),
                )
            })?;
            let msgs = messages_from_openai(messages).map_err(|e| {
                ApiError::bad_request(state.without_paths(&e.to_string()), Some("messages"))
            })?;
            let opts = RenderOptions {
                add_generation_prompt: *add_generation_prompt,
                bos_token: tok.bos_token.clone(),
                eos_token: tok.eos_token.clone(),
                tools: None,
                kwargs: kwargs.clone(),
            };
            let text = template.render(&msgs, &opts).map_err(|e| {
                ApiError::bad_request(state.without_paths(&e.to_string()), Some("messages"))
            })?;
            let ids = tok.encode(&text, false, true).map_err(|e| {
                ApiError::bad_request(state.without_paths(&e.to_string()), Some("messages"))
            })?;
            vec![(ids, text)]
        }
    };
    let prompt_field = match endpoint {
        Endpoint::Completions => "prompt",
        Endpoint::Chat => "messages",
    };
    let max_len = state.config.max_model_len;
    for (ids, _) in &prompts {
        if ids.is_empty() {
            return Err(ApiError::bad_request(
                "the prompt has no tokens",
                Some(prompt_field),
            ));
        }
        if ids.len() >= max_len {
            return Err(ApiError::bad_request(
                format!(
                    "the prompt has {} tokens; this model's maximum context length is {max_len} \
                     tokens (prompt and completion together)",
                    ids.len()
                ),
                Some(prompt_field),
            ));
        }
        if let Some(m) = parsed.max_tokens {
            // Saturating: max_tokens may be as large as a u64.
            if ids.len().saturating_add(m) > max_len {
                let field = if body.get("max_completion_tokens").is_some() {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                };
                return Err(ApiError::bad_request(
                    format!(
                        "this model's maximum context length is {max_len} tokens; the prompt has \
                         {} and {field} asks for {m} more",
                        ids.len()
                    ),
                    Some(field),
                ));
            }
        }
    }
    for &id in &parsed.stop_token_ids {
        if id as usize >= state.vocab_size {
            return Err(ApiError::bad_request(
                format!("stop token id {id} is outside the vocabulary"),
                Some("stop_token_ids"),
            ));
        }
    }
    if let Some(&id) = parsed
        .params
        .logit_bias
        .keys()
        .find(|&&id| id as usize >= state.vocab_size)
    {
        return Err(ApiError::bad_request(
            format!("logit_bias names token {id}, outside the vocabulary"),
            Some("logit_bias"),
        ));
    }
    // The grammar is compiled here, off the engine thread (the engine finds it in the
    // shared cache): a compilation that takes seconds does not pause the running requests,
    // and its error names the field it came from.
    let mut schema = None;
    if let (Some(spec), Some(compiler)) = (&parsed.grammar, &state.grammars) {
        let compiled = compiler
            .compile(spec, &grammar_options(state))
            .map_err(|e| {
                ApiError::bad_request(
                    format!("the grammar does not compile: {e}"),
                    Some(parsed.grammar_field),
                )
            })?;
        if compiled.original_schema().is_some() {
            // The validator is built here too, off the async runtime (once per grammar: it
            // compiles the schema's patterns); a schema it cannot take gives `valid: null`.
            let _ = compiled.validate_json("null");
            schema = Some(compiled);
        }
    }
    Ok(Prepared {
        parsed,
        prompts,
        schema,
    })
}

/// The grammar options of every request: the default whitespace bound, the server's
/// `--json-schema-mode`.
fn grammar_options(state: &AppState) -> nucleus_engine::GrammarOptions {
    nucleus_engine::GrammarOptions {
        json_schema_mode: state.config.json_schema_mode,
        ..nucleus_engine::GrammarOptions::default()
    }
}

/// The `nucleus_schema` object of a choice generated under a JSON Schema: `valid` (`false`
/// with the message `incomplete` for a choice cut by `max_tokens` or a stop string before its
/// grammar could end; `null` when the validator could give no verdict or the choice failed),
/// `error` (`{"instance_path", "message"}` or `null`), `relaxed` (the keyword families
/// relaxed to compile the schema).
fn schema_report(compiled: &CompiledGrammar, choice: &Choice) -> Value {
    if choice.error.is_some() {
        return json!({"valid": null, "relaxed": compiled.relaxed(), "error":
            {"instance_path": "", "message": "not validated: the completion failed"}});
    }
    let (valid, error) = match compiled.check_completion(&choice.text, choice.grammar_complete) {
        None | Some(Ok(SchemaVerdict::Valid)) => (json!(true), Value::Null),
        Some(Ok(SchemaVerdict::Invalid {
            instance_path,
            message,
        })) => (
            json!(false),
            json!({"instance_path": instance_path, "message": message}),
        ),
        Some(Err(e)) => (
            Value::Null,
            json!({"instance_path": "", "message": e.to_string()}),
        ),
    };
    json!({"valid": valid, "error": error, "relaxed": compiled.relaxed()})
}

/// Holds one place of the admission count until dropped.
struct Admission(Arc<crate::worker::Counts>, bool);

impl Drop for Admission {
    fn drop(&mut self) {
        // The engine thread releases the place once the job reached it; before, this does.
        if self.1 {
            self.0.in_system.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

async fn generate(
    state: Arc<AppState>,
    endpoint: Endpoint,
    body: HttpRequest,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body = read_json(&state, body).await?;
    let st = state.clone();
    let prepared = tokio::task::spawn_blocking(move || prepare(&st, endpoint, &body))
        .await
        .map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))??;
    let Prepared {
        parsed,
        prompts,
        schema,
    } = prepared;
    let max_len = state.config.max_model_len;
    let with_max: Vec<(Vec<u32>, usize)> = prompts
        .iter()
        .map(|(ids, _)| {
            let room = max_len - ids.len();
            let m = parsed
                .max_tokens
                .or(state.defaults.max_new_tokens.map(|d| d.min(room)))
                .unwrap_or(room);
            (ids.clone(), m)
        })
        .collect();
    let breakers = match &parsed.dry_sequence_breakers {
        Some(b) if parsed.params.dry_multiplier > 0.0 => Some(
            state
                .tokenizer
                .dry_sequence_breakers(b)
                .map_err(|e| ApiError::bad_request(e.to_string(), Some("dry_sequence_breakers")))?,
        ),
        None if parsed.params.dry_multiplier > 0.0 && parsed.params.dry_penalty_last_n != 0 => {
            Some(
                state
                    .tokenizer
                    .dry_sequence_breakers(&nucleus_sampling::chain::DRY_DEFAULT_SEQUENCE_BREAKERS)
                    .map_err(|e| ApiError::internal(e.to_string()))?,
            )
        }
        _ => None,
    };
    let requests = protocol::engine_requests(&parsed, with_max, breakers, grammar_options(&state))?;
    let samples = prompts.len() * parsed.n;
    if samples > state.config.max_num_seqs {
        return Err(ApiError::bad_request(
            format!(
                "the request asks for {samples} sequences ({} prompts, n = {}); this server runs \
                 at most --max-num-seqs {} at once",
                prompts.len(),
                parsed.n,
                state.config.max_num_seqs
            ),
            Some("n"),
        ));
    }

    // Admission: at most max_num_seqs running and max_queue waiting.
    // Saturating: --max-queue may be as large as a usize.
    let capacity = state
        .config
        .max_num_seqs
        .saturating_add(state.config.max_queue);
    let before = state.counts.in_system.fetch_add(1, Ordering::SeqCst);
    let mut admission = Admission(state.counts.clone(), true);
    if before >= capacity {
        state.metrics.rejected.inc();
        return Err(ApiError::overloaded(format!(
            "the server is at capacity ({} running, {} waiting); retry later",
            state.config.max_num_seqs, state.config.max_queue
        )));
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let job = Job {
        requests,
        events: tx,
        arrived,
    };
    let sent = state
        .jobs
        .lock()
        .map_err(|_| ApiError::internal("the engine channel is poisoned"))?
        .send(job);
    if sent.is_err() {
        return Err(ApiError::internal("the engine has stopped"));
    }
    // From here the engine thread releases the place.
    admission.1 = false;
    drop(admission);
    let infos = match rx.recv().await {
        Some(Event::Started(infos)) => infos,
        Some(Event::Failed(e)) => return Err(e),
        Some(Event::Step { .. }) | None => {
            return Err(ApiError::internal(
                "the engine ended the request before it started",
            ))
        }
    };
    let meta = Meta {
        id: new_id(match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        }),
        created: now_secs(),
        model: state.config.served_model_name.clone(),
        endpoint,
        n: parsed.n,
        logprobs: parsed.logprobs,
        prompt_tokens: infos.iter().map(|i| i.prompt_ids.len()).sum(),
        last_prompt_ids: infos.iter().map(|i| i.prompt_ids.last().copied()).collect(),
    };
    if parsed.stream {
        let stream = sse_stream(state.clone(), meta, rx, parsed.include_usage, schema);
        return Ok(Sse::new(stream).into_response());
    }
    // Non-streaming: gather every sample. A client that goes away drops this future and
    // with it `rx`: the engine aborts the job.
    let choices_n = prompts.len() * parsed.n;
    let mut acc: Vec<Choice> = (0..choices_n).map(|_| Choice::default()).collect();
    let mut done = 0;
    while done < choices_n {
        match rx.recv().await {
            Some(Event::Step { prompt, output }) => {
                let index = prompt * parsed.n + output.sample_index as usize;
                let Some(c) = acc.get_mut(index) else {
                    continue;
                };
                if c.push(&state, &meta, prompt, &output) {
                    done += 1;
                }
            }
            Some(Event::Failed(e)) => return Err(e),
            Some(Event::Started(_)) => {}
            None => return Err(ApiError::internal("the engine stopped during the request")),
        }
    }
    if let Some(e) = acc.iter().find_map(|c| c.error.clone()) {
        return Err(generation_error(&e, parsed.grammar_field));
    }
    let completion_tokens: usize = acc.iter().map(|c| c.ids.len()).sum();
    let choices: Vec<Value> = acc
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let prompt = i / parsed.n;
            let finish = c.finish;
            let report = schema.as_deref().map(|g| schema_report(g, &c));
            let mut choice = match endpoint {
                Endpoint::Completions => {
                    let text = if parsed.echo {
                        format!("{}{}", prompts[prompt].1, c.text)
                    } else {
                        c.text.clone()
                    };
                    json!({
                        "index": i,
                        "text": text,
                        "logprobs": parsed.logprobs.map(|_| completion_logprobs(&c.logprobs, 0)),
                        "finish_reason": finish,
                        "stop_reason": Value::Null,
                    })
                }
                Endpoint::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": parsed.logprobs.map(|_| chat_logprobs(&c.logprobs)),
                    "finish_reason": finish,
                    "stop_reason": Value::Null,
                }),
            };
            if let Some(report) = report {
                choice["nucleus_schema"] = report;
            }
            choice
        })
        .collect();
    let object = match endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion",
    };
    Ok(Json(json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage(meta.prompt_tokens, completion_tokens),
    }))
    .into_response())
}

/// The answer to a sample that failed while generating: what the request asked for and the
/// logits could not give (a penalty or temperature that takes a logit out of the f32 range,
/// a grammar past llguidance's limits) is a 400 naming the field; anything else a 500.
fn generation_error(message: &str, grammar_field: &'static str) -> ApiError {
    let message = format!("generation failed: {message}");
    if message.contains("grammar") {
        ApiError::bad_request(message, Some(grammar_field))
    } else if message.contains("out of the f32 range")
        || message.contains("invalid sampling parameter")
    {
        let param = protocol::param_of(&message);
        ApiError::bad_request(message, param)
    } else {
        ApiError::internal(message)
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

/// What every answer of one request shares.
struct Meta {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
    n: usize,
    logprobs: Option<usize>,
    prompt_tokens: usize,
    last_prompt_ids: Vec<Option<u32>>,
}

/// One token's logprobs: its text, logprob, and the alternatives.
#[derive(Clone, Debug)]
struct TokenLp {
    token: String,
    logprob: f64,
    top: Vec<(String, f64)>,
}

/// One choice being gathered.
#[derive(Default)]
struct Choice {
    text: String,
    ids: Vec<u32>,
    logprobs: Vec<TokenLp>,
    finish: Option<&'static str>,
    error: Option<String>,
    /// The engine's `grammar_complete` on the finishing step (false without a grammar).
    grammar_complete: bool,
}

impl Choice {
    /// Adds a step; returns whether the choice finished.
    fn push(&mut self, state: &AppState, meta: &Meta, prompt: usize, output: &StepOutput) -> bool {
        if let Some(token) = output.token {
            let before = self.ids.last().copied().or(meta
                .last_prompt_ids
                .get(prompt)
                .copied()
                .flatten());
            if let Some(lp) = &output.logprobs {
                self.logprobs.push(token_lp(state, before, token, lp));
            }
            self.ids.push(token);
        }
        self.text.push_str(&output.text);
        match &output.finish {
            None => false,
            Some(reason) => {
                self.finish = Some(finish_reason(reason));
                self.grammar_complete = output.grammar_complete.unwrap_or(false);
                if let FinishReason::Error(e) = reason {
                    self.error = Some(e.clone());
                }
                true
            }
        }
    }
}

fn finish_reason(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Error(_) => "error",
    }
}

/// A token's text after the token `before` ([`nucleus_engine::ModelTokenizer::token_text_after`]).
fn token_text(state: &AppState, before: Option<u32>, id: u32) -> String {
    state.tokenizer.token_text_after(before, id)
}

fn token_lp(
    state: &AppState,
    before: Option<u32>,
    id: u32,
    lp: &nucleus_sampling::Logprobs,
) -> TokenLp {
    TokenLp {
        token: token_text(state, before, id),
        logprob: lp.sampled.first().copied().unwrap_or(f64::NAN),
        top: lp
            .top
            .iter()
            .map(|t| (token_text(state, before, t.token_id), t.logprob))
            .collect(),
    }
}

/// A finite logprob, or OpenAI's floor for `-inf` (vLLM writes -9999.0).
fn finite(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

/// The legacy completions logprobs object; `offset` is where the first token's text starts,
/// in characters (OpenAI's and vLLM's `text_offset` count characters, not bytes). Each
/// `top_logprobs` entry holds the sampled token too, as vLLM's does (up to `logprobs + 1`
/// entries).
fn completion_logprobs(lps: &[TokenLp], offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(lps.len());
    let mut at = offset;
    for t in lps {
        text_offset.push(at);
        at += t.token.chars().count();
    }
    json!({
        "tokens": lps.iter().map(|t| t.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|t| finite(t.logprob)).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|t| {
            let mut m = Map::new();
            for (s, l) in &t.top {
                m.entry(s.clone()).or_insert(json!(finite(*l)));
            }
            m.entry(t.token.clone()).or_insert(json!(finite(t.logprob)));
            Value::Object(m)
        }).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// The chat logprobs object.
fn chat_logprobs(lps: &[TokenLp]) -> Value {
    let entry = |s: &str, l: f64| json!({"token": s, "logprob": finite(l), "bytes": s.as_bytes()});
    json!({
        "content": lps.iter().map(|t| {
            let mut e = entry(&t.token, t.logprob);
            e["top_logprobs"] = Value::Array(t.top.iter().map(|(s, l)| entry(s, *l)).collect());
            e
        }).collect::<Vec<_>>(),
    })
}

/// The SSE stream of a request: a chunk per step with text (and the role first, for chat),
/// a final chunk per choice with its finish reason, the usage chunk when asked, `[DONE]`.
fn sse_stream(
    state: Arc<AppState>,
    meta: Meta,
    rx: UnboundedReceiver<Event>,
    include_usage: bool,
    schema: Option<Arc<CompiledGrammar>>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    struct S {
        state: Arc<AppState>,
        meta: Meta,
        rx: UnboundedReceiver<Event>,
        include_usage: bool,
        schema: Option<Arc<CompiledGrammar>>,
        choices: BTreeMap<usize, Choice>,
        open: Option<usize>,
        started: bool,
        completion_tokens: usize,
        finished: bool,
    }
    let total = meta.last_prompt_ids.len() * meta.n;
    let s = S {
        state,
        meta,
        rx,
        include_usage,
        schema,
        choices: BTreeMap::new(),
        open: Some(total),
        started: false,
        completion_tokens: 0,
        finished: false,
    };
    stream::unfold(s, |mut s| async move {
        if s.finished {
            return None;
        }
        let mut events: Vec<SseEvent> = Vec::new();
        let object = match s.meta.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        let chunk = |meta: &Meta, choices: Vec<Value>| {
            let mut c = json!({
                "id": meta.id,
                "object": object,
                "created": meta.created,
                "model": meta.model,
                "choices": choices,
            });
            if s.include_usage {
                c["usage"] = Value::Null;
            }
            SseEvent::default().data(c.to_string())
        };
        if !s.started && s.meta.endpoint == Endpoint::Chat {
            s.started = true;
            let total = s.meta.last_prompt_ids.len() * s.meta.n;
            let first: Vec<Value> = (0..total)
                .map(|i| {
                    json!({"index": i, "delta": {"role": "assistant", "content": ""},
                           "logprobs": null, "finish_reason": null})
                })
                .collect();
            events.push(chunk(&s.meta, first));
            return Some((stream::iter(events.into_iter().map(Ok)), s));
        }
        match s.rx.recv().await {
            Some(Event::Step { prompt, output }) => {
                let index = prompt * s.meta.n + output.sample_index as usize;
                let state = s.state.clone();
                let c = s.choices.entry(index).or_default();
                let (text_before, lps_before) = (c.text.len(), c.logprobs.len());
                let chars_before = c.text.chars().count();
                let finished = c.push(&state, &s.meta, prompt, &output);
                if output.token.is_some() {
                    s.completion_tokens += 1;
                }
                let delta_text = c.text[text_before..].to_string();
                let new_lps = c.logprobs[lps_before..].to_vec();
                let lp = s.meta.logprobs.map(|_| match s.meta.endpoint {
                    Endpoint::Completions => completion_logprobs(&new_lps, chars_before),
                    Endpoint::Chat => chat_logprobs(&new_lps),
                });
                let finish = if finished { c.finish } else { None };
                let error = if finished { c.error.clone() } else { None };
                // The last chunk of a choice under a JSON Schema carries its verdict.
                let report = match (&s.schema, finished) {
                    (Some(g), true) => Some(schema_report(g, c)),
                    _ => None,
                };
                if !delta_text.is_empty() || lp.is_some() || finish.is_some() {
                    let mut choice = match s.meta.endpoint {
                        Endpoint::Completions => json!({
                            "index": index, "text": delta_text, "logprobs": lp,
                            "finish_reason": finish,
                        }),
                        Endpoint::Chat => {
                            let delta = if delta_text.is_empty() {
                                json!({})
                            } else {
                                json!({"content": delta_text})
                            };
                            json!({"index": index, "delta": delta, "logprobs": lp,
                                   "finish_reason": finish})
                        }
                    };
                    if let Some(report) = report {
                        choice["nucleus_schema"] = report;
                    }
                    events.push(chunk(&s.meta, vec![choice]));
                }
                if let Some(e) = error {
                    let err = ApiError::internal(format!("generation failed: {e}"));
                    events.push(SseEvent::default().data(err.body().to_string()));
                }
                if finished {
                    s.choices.remove(&index);
                    s.open = s.open.map(|o| o.saturating_sub(1));
                }
                if s.open == Some(0) {
                    if s.include_usage {
                        let u = json!({
                            "id": s.meta.id, "object": object, "created": s.meta.created,
                            "model": s.meta.model, "choices": [],
                            "usage": usage(s.meta.prompt_tokens, s.completion_tokens),
                        });
                        events.push(SseEvent::default().data(u.to_string()));
                    }
                    events.push(SseEvent::default().data("[DONE]"));
                    s.finished = true;
                }
            }
            Some(Event::Failed(e)) => {
                events.push(SseEvent::default().data(e.body().to_string()));
                events.push(SseEvent::default().data("[DONE]"));
                s.finished = true;
            }
            Some(Event::Started(_)) => {}
            None => {
                let e = ApiError::internal("the engine stopped during the request");
                events.push(SseEvent::default().data(e.body().to_string()));
                events.push(SseEvent::default().data("[DONE]"));
                s.finished = true;
            }
        }
        Some((stream::iter(events.into_iter().map(Ok)), s))
    })
    .flatten()
}

/// `POST /tokenize` as vLLM has it: `{"prompt", "add_special_tokens"}` or `{"messages",
/// "add_generation_prompt"}` -> `{"count", "max_model_len", "tokens"}`.
async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: HttpRequest,
) -> Result<Json<Value>, ApiError> {
    let obj = &read_object(
        &state,
        body,
        &[
            "model",
            "prompt",
            "messages",
            "add_special_tokens",
            "add_generation_prompt",
            "chat_template_kwargs",
            "return_token_strs",
        ],
    )
    .await?;
    let flag = |k: &str, default: bool| -> Result<bool, ApiError> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::bad_request(
                format!("{k} must be a boolean"),
                Some(k),
            )),
        }
    };
    let tok = &state.tokenizer;
    let ids = match (obj.get("prompt"), obj.get("messages")) {
        (Some(Value::String(p)), None) => tok
            .encode(p, flag("add_special_tokens", true)?, true)
            .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt")))?,
        (None, Some(m)) => {
            let template = state.chat_template.as_ref().ok_or_else(|| {
                ApiError::bad_request("this model has no chat template", Some("messages"))
            })?;
            let msgs = messages_from_openai(m).map_err(|e| {
                ApiError::bad_request(state.without_paths(&e.to_string()), Some("messages"))
            })?;
            let kwargs = protocol::template_kwargs(obj)?;
            let text = template
                .render(
                    &msgs,
                    &RenderOptions {
                        add_generation_prompt: flag("add_generation_prompt", true)?,
                        bos_token: tok.bos_token.clone(),
                        eos_token: tok.eos_token.clone(),
                        tools: None,
                        kwargs,
                    },
                )
                .map_err(|e| {
                    ApiError::bad_request(state.without_paths(&e.to_string()), Some("messages"))
                })?;
            tok.encode(&text, flag("add_special_tokens", false)?, true)
                .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))?
        }
        (Some(_), None) => {
            return Err(ApiError::bad_request(
                "prompt must be a string",
                Some("prompt"),
            ))
        }
        _ => {
            return Err(ApiError::bad_request(
                "give one of prompt and messages",
                Some("prompt"),
            ))
        }
    };
    let mut out = json!({
        "count": ids.len(),
        "max_model_len": state.config.max_model_len,
        "tokens": ids,
    });
    if flag("return_token_strs", false)? {
        out["token_strs"] = ids
            .iter()
            .map(|&id| tok.tokenizer.id_to_token(id).unwrap_or_default())
            .collect::<Vec<_>>()
            .into();
    }
    Ok(Json(out))
}

/// `POST /detokenize` as vLLM has it: `{"tokens": [ids]}` -> `{"prompt": text}`.
async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: HttpRequest,
) -> Result<Json<Value>, ApiError> {
    let obj = &read_object(&state, body, &["model", "tokens"]).await?;
    let ids: Vec<u32> = obj
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|a| {
            a.iter()
                .map(|x| x.as_u64().and_then(|i| u32::try_from(i).ok()))
                .collect()
        })
        .ok_or_else(|| {
            ApiError::bad_request("tokens must be a list of token ids", Some("tokens"))
        })?;
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= state.vocab_size) {
        return Err(ApiError::bad_request(
            format!("token id {bad} is outside the vocabulary"),
            Some("tokens"),
        ));
    }
    let text = state
        .tokenizer
        .decode(&ids, true)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("tokens")))?;
    Ok(Json(json!({"prompt": text})))
}

/// `model`, when given, must name the served model (404 otherwise).
fn check_model(state: &AppState, obj: &Map<String, Value>) -> Result<(), ApiError> {
    match obj.get("model") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(m)) if *m == state.config.served_model_name => Ok(()),
        Some(Value::String(m)) => Err(ApiError::not_found(
            format!(
                "the model `{m}` does not exist; this server serves `{}`",
                state.config.served_model_name
            ),
            Some("model"),
        )),
        Some(_) => Err(ApiError::bad_request(
            "model must be a string",
            Some("model"),
        )),
    }
}

impl AppState {
    /// `message` with the model's path replaced by `<model>` (a chat template's errors name
    /// the file they come from).
    pub(crate) fn without_paths(&self, message: &str) -> String {
        if self.root.is_empty() {
            return message.to_string();
        }
        message.replace(&self.root, "<model>")
    }
}

/// The body of `/tokenize` or `/detokenize`: a JSON object ([`read_json`]) of `known` fields
/// only, whose `model`, when given, is the served one.
async fn read_object(
    state: &AppState,
    req: HttpRequest,
    known: &[&str],
) -> Result<Map<String, Value>, ApiError> {
    let Value::Object(obj) = read_json(state, req).await? else {
        return Err(ApiError::bad_request(
            "the body must be a JSON object",
            None,
        ));
    };
    only_fields(&obj, known)?;
    check_model(state, &obj)?;
    Ok(obj)
}

/// A 400 naming the first field of `obj` not in `known`.
fn only_fields(obj: &Map<String, Value>, known: &[&str]) -> Result<(), ApiError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(ApiError::bad_request(
            format!("unknown field `{k}`"),
            Some(k),
        )),
        None => Ok(()),
    }
}
