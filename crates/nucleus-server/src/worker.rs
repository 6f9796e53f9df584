//! The engine thread: the step loop of [`nucleus_engine::Engine`], fed over a channel.
//!
//! HTTP handlers never touch the engine. A handler sends a [`Job`] (engine requests and a
//! channel for its events) and reads [`Event`]s back. Between two steps the thread takes new
//! jobs, admits waiting ones while fewer than `max_num_seqs` jobs run (first come, first
//! served), drops the jobs whose event channel has closed (the client went away: the engine
//! aborts their samples before the next step, so they cost no more work), and runs one step
//! when anything is running. A panic in a step is caught: the jobs then running are answered
//! with a 500 and removed, and the loop goes on.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nucleus_engine::{Engine, EngineError, Request, RequestInfo, StepOutput};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
use crate::metrics::Metrics;

/// What a handler hands the engine thread: one engine request per prompt (each with its
/// own `n` samples), answered in order on `events`.
pub struct Job {
    /// The engine requests, one per prompt.
    pub requests: Vec<Request>,
    /// Where the events go. A closed channel (the handler dropped its receiver) cancels the
    /// job.
    pub events: UnboundedSender<Event>,
    /// When the handler accepted the request (for time to first token).
    pub arrived: Instant,
}

/// What the engine thread tells a handler about its job.
pub enum Event {
    /// The job was admitted: the prompts' ids and seeds, one per engine request.
    Started(Vec<RequestInfo>),
    /// One sample's step: `prompt` indexes [`Job::requests`].
    Step {
        /// Which of the job's requests.
        prompt: usize,
        /// What happened.
        output: StepOutput,
    },
    /// The job failed before or while running (a bad grammar, a panic): the answer.
    Failed(ApiError),
}

/// Counts shared with the handlers: jobs admitted and jobs accepted but not finished.
#[derive(Default)]
pub struct Counts {
    /// Jobs in the engine now.
    pub running: AtomicUsize,
    /// Jobs accepted and not yet finished (waiting + running): admission control reads it.
    pub in_system: AtomicUsize,
}

impl Counts {
    /// Jobs waiting to be admitted.
    pub fn waiting(&self) -> usize {
        self.in_system
            .load(Ordering::SeqCst)
            .saturating_sub(self.running.load(Ordering::SeqCst))
    }
}

/// A job in the engine.
struct Active {
    events: UnboundedSender<Event>,
    /// Engine request id -> index of the prompt in the job.
    prompts: Vec<u64>,
    /// Samples not finished yet.
    open: usize,
    /// The job's samples (`n` per prompt): its share of `max_num_seqs`.
    samples: usize,
    arrived: Instant,
    /// When each sample's last token came (inter-token latency), by (prompt, sample).
    last_token: HashMap<(usize, u32), Instant>,
    first_token_seen: bool,
}

/// The engine loop's settings.
pub struct WorkerConfig {
    /// The most sequences (samples: `n` per prompt of each job) in the engine at once, as
    /// vLLM's `--max-num-seqs`; a job that would pass it waits (first come, first served).
    pub max_num_seqs: usize,
}

/// The samples of a job: `n` per prompt.
pub fn job_samples(job: &Job) -> usize {
    job.requests.iter().map(|r| r.n).sum()
}

/// Runs the engine loop until `jobs` closes and nothing is left to do.
pub fn run(
    mut engine: Engine,
    jobs: Receiver<Job>,
    config: WorkerConfig,
    counts: Arc<Counts>,
    metrics: Arc<Metrics>,
) {
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut active: Vec<Active> = Vec::new();
    let mut closed = false;
    loop {
        // Take new jobs: block while idle, poll while working.
        if active.is_empty() && waiting.is_empty() {
            if closed {
                return;
            }
            match jobs.recv_timeout(Duration::from_millis(200)) {
                Ok(job) => waiting.push_back(job),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => closed = true,
            }
        }
        loop {
            match jobs.try_recv() {
                Ok(job) => waiting.push_back(job),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    closed = true;
                    break;
                }
            }
        }
        // Waiting jobs whose client left are dropped without running.
        waiting.retain(|job| {
            let keep = !job.events.is_closed();
            if !keep {
                counts.in_system.fetch_sub(1, Ordering::SeqCst);
                metrics.aborted.inc();
            }
            keep
        });
        // Running jobs whose client left are aborted: no more work for them.
        active.retain(|a| {
            if !a.events.is_closed() {
                return true;
            }
            for &id in &a.prompts {
                engine.abort(id);
            }
            counts.in_system.fetch_sub(1, Ordering::SeqCst);
            metrics.aborted.inc();
            false
        });
        // Admit, in order, while the sequences fit.
        loop {
            let running_samples: usize = active.iter().map(|a| a.samples).sum();
            let Some(front) = waiting.front() else {
                break;
            };
            if running_samples + job_samples(front) > config.max_num_seqs && !active.is_empty() {
                break;
            }
            let Some(job) = waiting.pop_front() else {
                break;
            };
            match admit(&mut engine, &job) {
                Ok((infos, prompts, open)) => {
                    let prompt_tokens: usize = infos.iter().map(|i| i.prompt_ids.len()).sum();
                    metrics.prompt_tokens.inc_by(prompt_tokens as u64);
                    let _ = job.events.send(Event::Started(infos));
                    active.push(Active {
                        events: job.events,
                        prompts,
                        samples: open,
                        open,
                        arrived: job.arrived,
                        last_token: HashMap::new(),
                        first_token_seen: false,
                    });
                }
                Err(e) => {
                    let _ = job.events.send(Event::Failed(e));
                    counts.in_system.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
        counts.running.store(active.len(), Ordering::SeqCst);
        metrics.running.set(active.len() as i64);
        metrics.waiting.set(waiting.len() as i64);
        if active.is_empty() {
            continue;
        }
        let step = std::panic::catch_unwind(AssertUnwindSafe(|| engine.step()));
        let outputs = match step {
            Ok(Ok(outputs)) => outputs,
            failed => {
                let message = match failed {
                    Ok(Err(e)) => format!("the engine step failed: {e}"),
                    Err(panic) => format!("the engine step panicked: {}", panic_message(&panic)),
                    Ok(Ok(_)) => unreachable!("handled above"),
                };
                tracing::error!("{message}");
                for a in active.drain(..) {
                    for &id in &a.prompts {
                        engine.abort(id);
                    }
                    let _ = a
                        .events
                        .send(Event::Failed(ApiError::internal(message.clone())));
                    counts.in_system.fetch_sub(1, Ordering::SeqCst);
                }
                continue;
            }
        };
        let now = Instant::now();
        for output in outputs {
            let Some(a) = active
                .iter_mut()
                .find(|a| a.prompts.contains(&output.request_id))
            else {
                continue;
            };
            let prompt = a
                .prompts
                .iter()
                .position(|&id| id == output.request_id)
                .unwrap_or(0);
            if output.token.is_some() {
                metrics.generation_tokens.inc();
                let key = (prompt, output.sample_index);
                if !a.first_token_seen {
                    a.first_token_seen = true;
                    metrics
                        .time_to_first_token
                        .observe(now.duration_since(a.arrived).as_secs_f64());
                }
                if let Some(prev) = a.last_token.insert(key, now) {
                    metrics
                        .inter_token_latency
                        .observe(now.duration_since(prev).as_secs_f64());
                }
            }
            if output.finish.is_some() {
                a.open = a.open.saturating_sub(1);
            }
            let _ = a.events.send(Event::Step { prompt, output });
        }
        active.retain(|a| {
            if a.open > 0 {
                return true;
            }
            counts.in_system.fetch_sub(1, Ordering::SeqCst);
            metrics
                .e2e_latency
                .observe(now.duration_since(a.arrived).as_secs_f64());
            false
        });
        counts.running.store(active.len(), Ordering::SeqCst);
        metrics.running.set(active.len() as i64);
    }
}

/// Adds a job's requests to the engine; on an error the ones already added are aborted.
/// Returns the infos, the engine ids and the number of samples.
fn admit(engine: &mut Engine, job: &Job) -> Result<(Vec<RequestInfo>, Vec<u64>, usize), ApiError> {
    let mut infos = Vec::new();
    let mut ids = Vec::new();
    let mut open = 0;
    for request in &job.requests {
        let added =
            std::panic::catch_unwind(AssertUnwindSafe(|| engine.add_request(request.clone())));
        let error = match added {
            Ok(Ok(info)) => {
                ids.push(info.request_id);
                open += request.n;
                infos.push(info);
                continue;
            }
            Ok(Err(e)) => ApiError::from_engine(&e),
            Err(panic) => ApiError::internal(format!(
                "adding the request panicked: {}",
                panic_message(&panic)
            )),
        };
        for &id in &ids {
            engine.abort(id);
        }
        return Err(error);
    }
    Ok((infos, ids, open))
}

/// The text of a caught panic.
pub fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

impl ApiError {
    /// The answer to an engine error while adding a request: a grammar that does not compile
    /// or a bad request is a 400, the rest a 500.
    pub fn from_engine(e: &EngineError) -> Self {
        match e {
            EngineError::Grammar(g) => ApiError::bad_request(
                format!("the grammar does not compile: {g}"),
                Some("response_format"),
            ),
            EngineError::InvalidRequest(m) => {
                let param = if m.contains("context") {
                    Some("prompt")
                } else {
                    None
                };
                ApiError::bad_request(m.clone(), param)
            }
            other => ApiError::internal(other.to_string()),
        }
    }
}
