//! `GET /metrics`: Prometheus text, named like vLLM's `vllm:` metrics with a `nucleus:`
//! prefix (vLLM `docs/usage/metrics.md`; the buckets are vLLM's).

use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntGauge, Registry, TextEncoder};

/// The server's metrics.
pub struct Metrics {
    registry: Registry,
    /// `nucleus:num_requests_running`: jobs in the engine.
    pub running: IntGauge,
    /// `nucleus:num_requests_waiting`: jobs accepted, not yet admitted.
    pub waiting: IntGauge,
    /// `nucleus:prompt_tokens_total`.
    pub prompt_tokens: IntCounter,
    /// `nucleus:generation_tokens_total`.
    pub generation_tokens: IntCounter,
    /// `nucleus:time_to_first_token_seconds`: from arrival to the first sampled token.
    pub time_to_first_token: Histogram,
    /// `nucleus:inter_token_latency_seconds`: between two tokens of one sample.
    pub inter_token_latency: Histogram,
    /// `nucleus:e2e_request_latency_seconds`: from arrival to the last token.
    pub e2e_latency: Histogram,
    /// `nucleus:request_aborted_total`: jobs whose client went away.
    pub aborted: IntCounter,
    /// `nucleus:admission_rejections_total`: requests refused with 503.
    pub rejected: IntCounter,
}

impl Metrics {
    /// Registers every metric, labelled `model_name`.
    ///
    /// # Errors
    /// A metric the registry refuses (not expected: the names are fixed).
    pub fn new(model_name: &str) -> prometheus::Result<Self> {
        let registry = Registry::new_custom(
            None,
            Some([("model_name".to_string(), model_name.to_string())].into()),
        )?;
        let gauge = |name: &str, help: &str| -> prometheus::Result<IntGauge> {
            let g = IntGauge::new(name, help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let counter = |name: &str, help: &str| -> prometheus::Result<IntCounter> {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let histogram =
            |name: &str, help: &str, buckets: &[f64]| -> prometheus::Result<Histogram> {
                let h =
                    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))?;
                registry.register(Box::new(h.clone()))?;
                Ok(h)
            };
        // vLLM's buckets (vllm/v1/metrics/loggers.py), out to hours: a slow CPU model's long
        // requests land in a bucket, not only in +Inf.
        const TTFT: [f64; 22] = [
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
        ];
        const ITL: [f64; 19] = [
            0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0,
        ];
        const E2E: [f64; 21] = [
            0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
        ];
        Ok(Self {
            running: gauge(
                "nucleus:num_requests_running",
                "Requests in the engine now.",
            )?,
            waiting: gauge(
                "nucleus:num_requests_waiting",
                "Requests waiting to be admitted.",
            )?,
            prompt_tokens: counter("nucleus:prompt_tokens_total", "Prompt tokens prefilled.")?,
            generation_tokens: counter("nucleus:generation_tokens_total", "Tokens generated.")?,
            time_to_first_token: histogram(
                "nucleus:time_to_first_token_seconds",
                "Time from a request's arrival to its first token.",
                &TTFT,
            )?,
            inter_token_latency: histogram(
                "nucleus:inter_token_latency_seconds",
                "Time between two tokens of one sample.",
                &ITL,
            )?,
            e2e_latency: histogram(
                "nucleus:e2e_request_latency_seconds",
                "Time from a request's arrival to its last token.",
                &E2E,
            )?,
            aborted: counter(
                "nucleus:request_aborted_total",
                "Requests whose client went away before they finished.",
            )?,
            rejected: counter(
                "nucleus:admission_rejections_total",
                "Requests refused with 503 because the queue was full.",
            )?,
            registry,
        })
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail but for a metric family the registry holds wrongly.
        if TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .is_err()
        {
            return String::new();
        }
        String::from_utf8(out).unwrap_or_default()
    }
}
