//! `nucleus bench serve`: a load test of `nucleus serve` over loopback (README.md, "nucleus
//! bench serve"; BENCHMARKS.md, "Serving").
//!
//! It starts `nucleus serve` (this same binary) as a child process on `127.0.0.1`, a free
//! port, and runs up to three phases against it, each bounded in requests or seconds:
//!
//! - **load**: `--requests` streamed requests at each `--concurrency` level;
//! - **faults**: `--fault-requests` at `--fault-concurrency`, of which a
//!   `--disconnect-fraction` hang up mid-stream; the rest must complete, and the server's
//!   `nucleus:num_requests_running` and `num_requests_waiting` must be back at 0;
//! - **soak**: `--soak-seconds` of requests at `--soak-concurrency`, the server's resident
//!   memory (`VmRSS` of `/proc/PID/status`) sampled every `--rss-interval` seconds.
//!
//! Every request asks for `--max-tokens` tokens with `ignore_eos`, `stream: true` and
//! `stream_options.include_usage`, a seed of its own and temperature 1. What is measured
//! follows vLLM's `vllm bench serve` (`vllm/benchmarks/lib/endpoint_request_func.py` and
//! `vllm/benchmarks/serve.py`): time to first token is from sending the request to the first
//! chunk with text; inter-token latency is the time between two chunks with text, pooled over
//! requests; throughput is completed requests and generated tokens (`usage.completion_tokens`)
//! over the phase's wall time.
//!
//! Every request is counted once: 200 complete (the stream ended with `[DONE]` after the usage
//! chunk), 4xx, 503, 5xx, or lost (a transport error, a timeout, or a stream that ended early).
//! The run fails (exit status 1) when a request is lost, a 4xx or 5xx comes back (the requests
//! are valid), a completed request has fewer tokens than asked, the server does not return to
//! 0 running after the faults, or the soak's memory grows beyond `--max-rss-growth-mib`.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use crate::ParamError;

/// Which OpenAI route the requests use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/completions` with the prompt as text.
    Completions,
    /// `POST /v1/chat/completions` with the prompt as one user message (the model needs a
    /// chat template).
    Chat,
}

/// What `nucleus bench serve` runs. The ranges the `nucleus` tool's flags enforce by parsing
/// (`soak_seconds` at most a week, `rss_interval` in `1..=302_400`, `max_num_seqs` in
/// `1..=4096`, `threads` in `1..=1024`, `request_timeout` in `1..=86_400`) are the caller's;
/// the rest is checked by [`run`].
#[derive(Debug, Clone)]
pub struct Config {
    /// The `nucleus` binary whose `serve` subcommand is started.
    pub server_binary: PathBuf,
    /// The model to serve, as `nucleus serve --model` takes it (a resolved path).
    pub model: PathBuf,
    /// The route the requests use.
    pub endpoint: Route,
    /// The prompt of every request.
    pub prompt: String,
    /// Tokens generated per request (`max_tokens`, with `ignore_eos`; at least 1).
    pub max_tokens: usize,
    /// The load phase's concurrent streams: one run per value.
    pub concurrency: Vec<usize>,
    /// Requests of each load run (0: no load phase).
    pub requests: usize,
    /// Requests of the fault phase (0: no fault phase).
    pub fault_requests: usize,
    /// Concurrent streams of the fault phase.
    pub fault_concurrency: usize,
    /// The share of the fault phase's requests that hang up mid-stream (in `[0, 1]`, spread
    /// evenly: 0.2 is every fifth), each after 1 to max_tokens/2 chunks of text (so the fault
    /// phase needs `max_tokens` 8 or more).
    pub disconnect_fraction: f64,
    /// Seconds of the soak phase (0: no soak phase).
    pub soak_seconds: u64,
    /// Concurrent streams of the soak phase.
    pub soak_concurrency: usize,
    /// Seconds between two samples of the server's resident memory in the soak (at most half
    /// the soak).
    pub rss_interval: u64,
    /// The most the server's resident memory may grow in the soak, in MiB: the largest sample
    /// against the first sample at or after the warm-up (a sixth of the soak, at most 60 s).
    pub max_rss_growth_mib: u64,
    /// The server's `--max-num-seqs`.
    pub max_num_seqs: u32,
    /// The server's `--max-queue`.
    pub max_queue: usize,
    /// The server's `--threads` (`None`: its own default).
    pub threads: Option<u32>,
    /// Seconds one request may take before it counts as lost.
    pub request_timeout: u64,
}

/// Where the run goes: told once the server listens, before the first phase.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Started {
    /// The model, as given to the server.
    pub model: String,
    /// The route's path (`/v1/completions`).
    pub path: &'static str,
    /// The server's address (`http://127.0.0.1:PORT`).
    pub base: String,
}

/// One phase's (or one load run's) counts and latencies.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseRow {
    /// `load`, `faults` or `soak`.
    pub phase: &'static str,
    /// Concurrent streams.
    pub streams: usize,
    /// Requests sent.
    pub sent: usize,
    /// 200 and complete.
    pub ok: usize,
    /// 4xx answers.
    pub c4xx: usize,
    /// 503 answers (the queue full).
    pub c503: usize,
    /// Other 5xx answers.
    pub c5xx: usize,
    /// Lost: a transport error, a timeout, or a stream that ended early.
    pub lost: usize,
    /// Hung up by the client on purpose.
    pub hung_up: usize,
    /// Completed requests per second of the phase's wall time.
    pub requests_per_s: f64,
    /// Generated tokens (`usage.completion_tokens`) per second of the phase's wall time.
    pub tokens_per_s: f64,
    /// Time to first token, median, in seconds (numpy's linear interpolation; `NaN` when no
    /// request got a token).
    pub ttft_p50: f64,
    /// Time to first token, 99th percentile, in seconds (as `ttft_p50`).
    pub ttft_p99: f64,
    /// Inter-token latency pooled over requests, median, in seconds (`NaN` when there is
    /// none).
    pub itl_p50: f64,
    /// Inter-token latency, 99th percentile, in seconds (as `itl_p50`).
    pub itl_p99: f64,
}

/// What [`run`] tells as it goes.
#[derive(Clone, Debug, PartialEq)]
pub enum ServeEvent {
    /// The server listens.
    Started(Started),
    /// A phase (or one load run) ended.
    Phase(PhaseRow),
}

/// The fault phase's outcome, where the server's metrics could be read.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultSummary {
    /// Requests that hung up mid-stream.
    pub hung_up: usize,
    /// Requests sent.
    pub sent: usize,
    /// Requests of the others that completed.
    pub completed: usize,
    /// Requests that were not meant to hang up.
    pub others: usize,
    /// Requests the server counted as aborted (`nucleus:request_aborted_total`'s growth).
    pub aborted: usize,
    /// Seconds from the last answer until the server was back at 0 running and 0 waiting.
    pub drained_s: f64,
}

/// The soak's memory, in MiB, where `/proc` can be read.
#[derive(Clone, Debug, PartialEq)]
pub struct SoakMemory {
    /// Seconds of the soak.
    pub seconds: u64,
    /// Concurrent streams.
    pub streams: usize,
    /// Requests sent.
    pub requests: usize,
    /// The first sample.
    pub start_mib: f64,
    /// The warm-up's seconds.
    pub warm_up_s: f64,
    /// The first sample at or after the warm-up.
    pub after_warm_up_mib: f64,
    /// The largest sample.
    pub highest_mib: f64,
    /// The last sample.
    pub last_mib: f64,
    /// The largest sample from the end of the warm-up on, less the sample there.
    pub growth_mib: f64,
    /// [`Config::max_rss_growth_mib`].
    pub bound_mib: u64,
    /// Every sample: (seconds since the soak started, MiB).
    pub samples: Vec<(f64, f64)>,
}

/// What a whole run found.
#[derive(Clone, Debug, PartialEq)]
pub struct ServeReport {
    /// The fault phase's outcome (`None`: no fault phase, or its metrics failed: then a
    /// failure says why).
    pub faults: Option<FaultSummary>,
    /// The soak's memory: `None` without a soak; `Some(None)` where the server's resident
    /// memory cannot be read (no /proc).
    pub soak: Option<Option<SoakMemory>>,
    /// Every check that failed, one sentence each; empty when all passed.
    pub failures: Vec<String>,
}

/// Runs the load test: starts the server, runs the phases, tells `on_event` where it goes
/// and each phase's row, and returns what it found.
///
/// # Errors
/// Parameters out of range (a [`ParamError`]); the server does not start; an error of
/// `on_event`.
pub fn run(
    config: &Config,
    on_event: &mut dyn FnMut(ServeEvent) -> Result<()>,
) -> Result<ServeReport> {
    check(config)?;
    let model = config.model.display().to_string();
    let mut server = ServerProcess::start(&model, config)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the client's runtime")?;
    let result = runtime.block_on(phases(config, &server, &model, on_event));
    let died = server.exited();
    server.stop();
    let mut report = result?;
    if let Some(status) = died {
        report.failures.push(format!(
            "the server process ended during the run ({status}); its last words: {}",
            server.tail()
        ));
    }
    Ok(report)
}

fn check(args: &Config) -> Result<()> {
    let usage = |m: String| -> Result<()> { Err(ParamError::new(m).into()) };
    if args.max_tokens == 0 {
        return usage("--max-tokens must be at least 1".into());
    }
    if args.requests > 0 && (args.concurrency.is_empty() || args.concurrency.contains(&0)) {
        return usage("--concurrency needs values of at least 1".into());
    }
    if args.fault_requests > 0 && args.fault_concurrency == 0 {
        return usage("--fault-concurrency must be at least 1".into());
    }
    // A hang-up after at most half the tokens leaves the server 4 or more tokens in which to
    // notice it, so that every hang-up is an abort.
    if args.fault_requests > 0 && args.max_tokens < 8 {
        return usage(format!(
            "the fault phase needs --max-tokens 8 or more (its clients hang up after at most \
             half of them), got {}",
            args.max_tokens
        ));
    }
    if !(0.0..=1.0).contains(&args.disconnect_fraction) {
        return usage(format!(
            "--disconnect-fraction must be in [0, 1], got {}",
            args.disconnect_fraction
        ));
    }
    if args.soak_seconds > 0 && args.soak_concurrency == 0 {
        return usage("--soak-concurrency must be at least 1".into());
    }
    // Two samples at least after the warm-up, or the memory check measures nothing.
    if args.soak_seconds > 0 && args.soak_seconds < 2 * args.rss_interval {
        return usage(format!(
            "--soak-seconds {} must be at least twice --rss-interval {}",
            args.soak_seconds, args.rss_interval
        ));
    }
    if args.requests == 0 && args.fault_requests == 0 && args.soak_seconds == 0 {
        return usage(
            "nothing to run: --requests, --fault-requests and --soak-seconds are 0".into(),
        );
    }
    Ok(())
}

/// The served model's name in requests.
const NAME: &str = "bench";

/// `nucleus serve` as a child process on a free loopback port.
struct ServerProcess {
    child: Child,
    base: String,
    /// The last lines the server wrote on stderr (a panic message, a warning).
    tail: Arc<Mutex<std::collections::VecDeque<String>>>,
}

/// How many of the server's last stderr lines are kept.
const TAIL_LINES: usize = 20;

impl ServerProcess {
    fn start(model: &str, args: &Config) -> Result<Self> {
        let mut cmd = Command::new(&args.server_binary);
        cmd.args([
            "serve",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ])
        .args(["--served-model-name", NAME])
        .args(["--max-num-seqs", &args.max_num_seqs.to_string()])
        .args(["--max-queue", &args.max_queue.to_string()]);
        if let Some(t) = args.threads {
            cmd.args(["--threads", &t.to_string()]);
        }
        cmd.env_remove("NUCLEUS_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // The server ends with the bench, however the bench ends (a signal to its pid alone
        // included): the kernel sends it SIGTERM when its parent dies.
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {} serve", args.server_binary.display()))?;
        let stderr = child.stderr.take().context("the server's stderr")?;
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let tail = Arc::new(Mutex::new(std::collections::VecDeque::new()));
        // Reads the server's stderr to its end: every line goes to `tx` until the address
        // line, and the last TAIL_LINES are kept for the report.
        {
            let tail = tail.clone();
            std::thread::spawn(move || {
                let mut tx = Some(tx);
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if let Ok(mut t) = tail.lock() {
                        if t.len() == TAIL_LINES {
                            t.pop_front();
                        }
                        t.push_back(line.clone());
                    }
                    if let Some(sender) = &tx {
                        let ready = line.starts_with("nucleus serve: listening on http://");
                        if sender.send(line).is_err() || ready {
                            tx = None;
                        }
                    }
                }
            });
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut lines = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(url) = line.strip_prefix("nucleus serve: listening on ") {
                        return Ok(Self {
                            child,
                            base: url.trim().to_string(),
                            tail,
                        });
                    }
                    lines.push(line);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    // Its stderr closed: the server ended before it listened.
                    let status = child.wait().context("waiting for nucleus serve")?;
                    bail!(
                        "nucleus serve ended ({status}) before it listened; it said: {}",
                        lines.join(" | ")
                    );
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!(
                        "nucleus serve did not listen within 120 s; it said: {}",
                        lines.join(" | ")
                    );
                }
            }
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How the server process ended, if it has.
    fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(None) => None,
            Ok(Some(status)) => Some(status.to_string()),
            Err(e) => Some(format!("unknown ({e})")),
        }
    }

    /// The server's last stderr lines, joined.
    fn tail(&self) -> String {
        self.tail
            .lock()
            .map(|t| t.iter().cloned().collect::<Vec<_>>().join(" | "))
            .unwrap_or_default()
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How one request ended.
#[derive(Clone, Debug, Default)]
struct Outcome {
    /// The HTTP status (0: none came back).
    status: u16,
    /// The stream ended with `[DONE]`.
    done: bool,
    /// The client hung up on purpose.
    hung_up: bool,
    /// `usage.completion_tokens` of the last chunk.
    tokens: usize,
    /// Seconds from sending to the first chunk with text.
    ttft: Option<f64>,
    /// Seconds between chunks with text.
    itl: Vec<f64>,
    /// What went wrong, for the report.
    error: Option<String>,
}

/// The counts and latencies of a set of requests.
#[derive(Debug, Default)]
struct Tally {
    sent: usize,
    ok: usize,
    short: usize,
    c4xx: usize,
    c503: usize,
    c5xx: usize,
    lost: usize,
    hung_up: usize,
    tokens: usize,
    ttft: Vec<f64>,
    itl: Vec<f64>,
    errors: Vec<String>,
}

impl Tally {
    fn add(&mut self, o: Outcome, max_tokens: usize) {
        self.sent += 1;
        if o.hung_up {
            self.hung_up += 1;
            return;
        }
        match o.status {
            200 if o.done => {
                self.ok += 1;
                if o.tokens < max_tokens {
                    self.short += 1;
                }
                self.tokens += o.tokens;
                self.ttft.extend(o.ttft);
                self.itl.extend(o.itl);
            }
            503 => self.c503 += 1,
            400..=499 => self.c4xx += 1,
            500..=599 => self.c5xx += 1,
            _ => self.lost += 1,
        }
        // The first five distinct errors, for the report.
        if let Some(e) = o.error {
            if self.errors.len() < 5 && !self.errors.contains(&e) {
                self.errors.push(e);
            }
        }
    }
}

/// The `q`-quantile (0..=1) of `v` by linear interpolation, as numpy's default; `NaN` for none.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let pos = q * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// One request; `hang_up_after`: hang up after that many chunks with text.
async fn one_request(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    hang_up_after: Option<usize>,
) -> Outcome {
    let mut o = Outcome::default();
    let sent = Instant::now();
    let response = match client.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) => {
            o.error = Some(format!("sending: {}", chain(&e)));
            return o;
        }
    };
    o.status = response.status().as_u16();
    let mut response = response;
    if o.status != 200 {
        let text = response.text().await.unwrap_or_default();
        o.error = Some(format!(
            "HTTP {}: {}",
            o.status,
            text.chars()
                .take(300)
                .flat_map(char::escape_debug)
                .collect::<String>()
        ));
        return o;
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut last = None::<Instant>;
    let mut chunks = 0usize;
    loop {
        let piece = match response.chunk().await {
            Ok(Some(p)) => p,
            Ok(None) => break,
            Err(e) => {
                o.error = Some(format!("reading the stream: {}", chain(&e)));
                return o;
            }
        };
        buf.extend_from_slice(&piece);
        // SSE events end with a blank line.
        while let Some(end) = find(&buf, b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            for line in event.split(|&b| b == b'\n') {
                let Some(data) = line.strip_prefix(b"data: ") else {
                    continue;
                };
                if data == b"[DONE]" {
                    o.done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_slice::<Value>(data) else {
                    o.error = Some("a chunk that is not JSON".into());
                    return o;
                };
                if let Some(e) = v.get("error") {
                    o.error = Some(format!("an error in the stream: {e}"));
                    return o;
                }
                if let Some(n) = v
                    .pointer("/usage/completion_tokens")
                    .and_then(Value::as_u64)
                {
                    o.tokens = n as usize;
                }
                let has_text = v["choices"].as_array().is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c["text"].as_str().is_some_and(|t| !t.is_empty())
                            || c["delta"]["content"]
                                .as_str()
                                .is_some_and(|t| !t.is_empty())
                    })
                });
                if has_text {
                    let now = Instant::now();
                    match last {
                        None => o.ttft = Some((now - sent).as_secs_f64()),
                        Some(prev) => o.itl.push((now - prev).as_secs_f64()),
                    }
                    last = Some(now);
                    chunks += 1;
                    if hang_up_after.is_some_and(|k| chunks >= k) {
                        // Dropping the response closes the connection mid-stream.
                        o.hung_up = true;
                        return o;
                    }
                }
            }
        }
    }
    if !o.done {
        o.error = Some("the stream ended without [DONE]".into());
        o.status = 0;
    }
    o
}

/// `e` and its causes, `: `-separated; a timeout says so.
fn chain(e: &reqwest::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        parts.push(s.to_string());
        source = s.source();
    }
    if e.is_timeout() {
        parts.push("--request-timeout passed".into());
    }
    parts.join(": ")
}

/// Whether request `i` is one of the share `f` that hang up: spread evenly, `floor((i + 1) f)`
/// stepping up at `i` (0.2 picks 4, 9, 14, ...).
fn picked(i: usize, f: f64) -> bool {
    ((i + 1) as f64 * f).floor() > (i as f64 * f).floor()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// What every request of a run shares.
struct Target {
    client: reqwest::Client,
    url: String,
    body: Value,
    max_tokens: usize,
}

impl Target {
    fn body(&self, i: usize) -> Value {
        let mut b = self.body.clone();
        b["seed"] = json!(i);
        b
    }
}

/// `count` requests (or, with `until`, requests until that instant) at `concurrency`; request
/// `i` hangs up after `hang_up(i)` chunks when that is `Some`.
async fn drive(
    target: &Arc<Target>,
    concurrency: usize,
    count: Option<usize>,
    until: Option<Instant>,
    hang_up: impl Fn(usize) -> Option<usize> + Clone + 'static,
) -> (Tally, f64) {
    let next = Arc::new(AtomicUsize::new(0));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (target, next, tally, hang_up) =
            (target.clone(), next.clone(), tally.clone(), hang_up.clone());
        tasks.spawn_local(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if count.is_some_and(|n| i >= n) || until.is_some_and(|t| Instant::now() >= t) {
                    break;
                }
                let o = one_request(&target.client, &target.url, &target.body(i), hang_up(i)).await;
                if let Ok(mut t) = tally.lock() {
                    t.add(o, target.max_tokens);
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let wall = start.elapsed().as_secs_f64();
    let tally = Arc::try_unwrap(tally)
        .ok()
        .and_then(|m| m.into_inner().ok())
        .unwrap_or_default();
    (tally, wall)
}

/// A gauge or counter of `/metrics` (the first series of that name).
async fn metric(client: &reqwest::Client, base: &str, name: &str) -> Result<f64> {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .context("GET /metrics")?
        .text()
        .await
        .context("reading /metrics")?;
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let series_name = series.split('{').next()?;
            (series_name == name).then(|| value.parse::<f64>().ok())?
        })
        .ok_or_else(|| anyhow!("no {name} in /metrics"))
}

/// Waits up to `limit` for running and waiting to be 0; the seconds it took.
///
/// # Errors
/// `/metrics` cannot be read, or the server is not back at 0 within `limit`.
async fn drained(client: &reqwest::Client, base: &str, limit: Duration) -> Result<f64> {
    let start = Instant::now();
    loop {
        let running = metric(client, base, "nucleus:num_requests_running").await?;
        let waiting = metric(client, base, "nucleus:num_requests_waiting").await?;
        if running == 0.0 && waiting == 0.0 {
            return Ok(start.elapsed().as_secs_f64());
        }
        if start.elapsed() > limit {
            bail!(
                "the server was not back at 0 running and 0 waiting {} s after the last \
                 answer ({running} running, {waiting} waiting)",
                limit.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `VmRSS` of `/proc/PID/status`, in bytes (`None` where there is no /proc).
fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The row of a phase of `wall` seconds.
fn row(phase: &'static str, streams: usize, t: &mut Tally, wall: f64) -> PhaseRow {
    PhaseRow {
        phase,
        streams,
        sent: t.sent,
        ok: t.ok,
        c4xx: t.c4xx,
        c503: t.c503,
        c5xx: t.c5xx,
        lost: t.lost,
        hung_up: t.hung_up,
        requests_per_s: t.ok as f64 / wall,
        tokens_per_s: t.tokens as f64 / wall,
        ttft_p50: quantile(&mut t.ttft, 0.5),
        ttft_p99: quantile(&mut t.ttft, 0.99),
        itl_p50: quantile(&mut t.itl, 0.5),
        itl_p99: quantile(&mut t.itl, 0.99),
    }
}

/// The checks every phase shares; failures appended to `failures`.
fn check_tally(phase: &str, t: &Tally, failures: &mut Vec<String>) {
    if t.lost > 0 || t.c4xx > 0 || t.c5xx > 0 {
        failures.push(format!(
            "{phase}: {} lost, {} 4xx, {} 5xx (first errors: {})",
            t.lost,
            t.c4xx,
            t.c5xx,
            t.errors.join("; ")
        ));
    }
    if t.short > 0 {
        failures.push(format!(
            "{phase}: {} completed requests had fewer tokens than asked",
            t.short
        ));
    }
}

async fn phases(
    args: &Config,
    server: &ServerProcess,
    model: &str,
    on_event: &mut dyn FnMut(ServeEvent) -> Result<()>,
) -> Result<ServeReport> {
    let local = tokio::task::LocalSet::new();
    local
        .run_until(phases_local(args, server, model, on_event))
        .await
}

async fn phases_local(
    args: &Config,
    server: &ServerProcess,
    model: &str,
    on_event: &mut dyn FnMut(ServeEvent) -> Result<()>,
) -> Result<ServeReport> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(args.request_timeout))
        .build()
        .context("building the HTTP client")?;
    let base = server.base.clone();
    let (path, mut body) = match args.endpoint {
        Route::Completions => ("/v1/completions", json!({"prompt": args.prompt})),
        Route::Chat => (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": args.prompt}]}),
        ),
    };
    let fields = json!({
        "model": NAME, "max_tokens": args.max_tokens, "ignore_eos": true, "temperature": 1.0,
        "stream": true, "stream_options": {"include_usage": true},
    });
    if let (Some(b), Some(f)) = (body.as_object_mut(), fields.as_object()) {
        b.extend(f.clone());
    }
    let target = Arc::new(Target {
        client: client.clone(),
        url: format!("{base}{path}"),
        body,
        max_tokens: args.max_tokens,
    });
    let mut failures = Vec::new();
    on_event(ServeEvent::Started(Started {
        model: model.to_string(),
        path,
        base: base.clone(),
    }))?;
    let drain_limit = Duration::from_secs(30);

    if args.requests > 0 {
        for &c in &args.concurrency {
            let phase = format!("load at {c} streams");
            let (mut t, wall) = drive(&target, c, Some(args.requests), None, |_| None).await;
            on_event(ServeEvent::Phase(row("load", c, &mut t, wall)))?;
            check_tally(&phase, &t, &mut failures);
            if let Err(e) = drained(&client, &base, drain_limit).await {
                failures.push(format!("{phase}: {e:#}"));
            }
        }
    }

    let mut faults = None;
    if args.fault_requests > 0 {
        let aborted_before = metric(&client, &base, "nucleus:request_aborted_total").await;
        let f = args.disconnect_fraction;
        let half = args.max_tokens / 2;
        let hang_up = move |i: usize| picked(i, f).then_some(1 + i % half);
        let (mut t, wall) = drive(
            &target,
            args.fault_concurrency,
            Some(args.fault_requests),
            None,
            hang_up,
        )
        .await;
        on_event(ServeEvent::Phase(row(
            "faults",
            args.fault_concurrency,
            &mut t,
            wall,
        )))?;
        check_tally("faults", &t, &mut failures);
        let meant = (0..args.fault_requests)
            .filter(|&i| hang_up(i).is_some())
            .count();
        let rest = args.fault_requests - meant;
        if t.hung_up != meant || t.ok != rest {
            failures.push(format!(
                "faults: {} hung up (of {meant} meant to) and {} of the other {rest} completed \
                 ({} refused with 503, {} lost, {} 4xx, {} other 5xx)",
                t.hung_up, t.ok, t.c503, t.lost, t.c4xx, t.c5xx
            ));
        }
        let drain = drained(&client, &base, drain_limit).await;
        let aborted_after = metric(&client, &base, "nucleus:request_aborted_total").await;
        match (drain, aborted_before, aborted_after) {
            (Ok(s), Ok(before), Ok(after)) => {
                let aborted = (after - before).round() as usize;
                // Every client that hung up left the server tokens to generate for it.
                if aborted != t.hung_up {
                    failures.push(format!(
                        "faults: {} clients hung up mid-stream but the server aborted {aborted}",
                        t.hung_up
                    ));
                }
                faults = Some(FaultSummary {
                    hung_up: t.hung_up,
                    sent: t.sent,
                    completed: t.ok,
                    others: rest,
                    aborted,
                    drained_s: s,
                });
            }
            (drain, before, after) => {
                for e in [drain.err(), before.err(), after.err()]
                    .into_iter()
                    .flatten()
                {
                    failures.push(format!("faults: {e:#}"));
                }
            }
        }
    }

    let mut soak_memory = None;
    if args.soak_seconds > 0 {
        let soak = Duration::from_secs(args.soak_seconds);
        let interval = Duration::from_secs(args.rss_interval);
        let start = Instant::now();
        let until = start + soak;
        let pid = server.pid();
        let samples = Arc::new(Mutex::new(vec![(0.0, rss_bytes(pid))]));
        let sampler = {
            let samples = samples.clone();
            tokio::task::spawn_local(async move {
                let mut next = start + interval;
                while next <= until {
                    tokio::time::sleep_until(next.into()).await;
                    if let Ok(mut s) = samples.lock() {
                        s.push((start.elapsed().as_secs_f64(), rss_bytes(pid)));
                    }
                    next += interval;
                }
            })
        };
        let (mut t, wall) =
            drive(&target, args.soak_concurrency, None, Some(until), |_| None).await;
        let _ = sampler.await;
        on_event(ServeEvent::Phase(row(
            "soak",
            args.soak_concurrency,
            &mut t,
            wall,
        )))?;
        check_tally("soak", &t, &mut failures);
        let samples: Vec<(f64, Option<u64>)> =
            samples.lock().map(|s| s.clone()).unwrap_or_default();
        let warm_up = (soak.as_secs_f64() / 6.0).min(60.0);
        let known: Vec<(f64, u64)> = samples
            .iter()
            .filter_map(|&(t, r)| r.map(|r| (t, r)))
            .collect();
        if known.is_empty() {
            soak_memory = Some(None);
        } else {
            let base_sample = known
                .iter()
                .find(|(t, _)| *t >= warm_up)
                .or(known.last())
                .copied()
                .unwrap_or(known[0]);
            let max = known.iter().map(|&(_, r)| r).max().unwrap_or(0);
            let after_max = known
                .iter()
                .filter(|(t, _)| *t >= base_sample.0)
                .map(|&(_, r)| r)
                .max()
                .unwrap_or(base_sample.1);
            let last = known.last().map_or(0, |&(_, r)| r);
            let growth = after_max.saturating_sub(base_sample.1);
            soak_memory = Some(Some(SoakMemory {
                seconds: args.soak_seconds,
                streams: args.soak_concurrency,
                requests: t.sent,
                start_mib: mib(known[0].1),
                warm_up_s: warm_up,
                after_warm_up_mib: mib(base_sample.1),
                highest_mib: mib(max),
                last_mib: mib(last),
                growth_mib: mib(growth),
                bound_mib: args.max_rss_growth_mib,
                samples: known.iter().map(|&(t, r)| (t, mib(r))).collect(),
            }));
            if growth > args.max_rss_growth_mib * 1024 * 1024 {
                failures.push(format!(
                    "soak: the server's memory grew {:.1} MiB after the warm-up, more than \
                     --max-rss-growth-mib {}",
                    mib(growth),
                    args.max_rss_growth_mib
                ));
            }
        }
    }

    Ok(ServeReport {
        faults,
        soak: soak_memory,
        failures,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_as_numpy() {
        // numpy.quantile([1, 2, 3, 4], [0.5, 0.99]) = [2.5, 3.97]
        let mut v = vec![4.0, 1.0, 3.0, 2.0];
        assert_eq!(quantile(&mut v, 0.5), 2.5);
        assert!((quantile(&mut v, 0.99) - 3.97).abs() < 1e-12);
        assert!(quantile(&mut [], 0.5).is_nan());
    }

    #[test]
    fn a_fifth_hang_up_spread_evenly() {
        let chosen: Vec<usize> = (0..20).filter(|&i| picked(i, 0.2)).collect();
        assert_eq!(chosen, vec![4, 9, 14, 19]);
        assert_eq!((0..1000).filter(|&i| picked(i, 0.2)).count(), 200);
        assert_eq!((0..7).filter(|&i| picked(i, 1.0)).count(), 7);
        assert_eq!((0..7).filter(|&i| picked(i, 0.0)).count(), 0);
    }
}
