//! Shared support of the large-row tests (`large_rows/selection.rs`, `large_rows/inputs.rs`):
//! rows of 8,193 to 327,680 ids against the f64 oracle of spec/sampling.md.
//!
//! The sampler's fast paths depend on the row's size and layout: runs of 32 values, blocks of
//! 512 values, f64 sums over chunks of 8,192 ids, a top-k buffer compacted at 2k, steps 3-5 on
//! a sparse list when vocab >= 16 (k + touched ids), min-p and top-p candidates cut by logit
//! bounds, a polynomial exp, an exact fallback for |max| > 1e30, AVX-512 / AVX2 / SSE2 chosen
//! at run time. Small rows reach little of that. Here every step runs on rows of realistic
//! vocabulary sizes, with the special ids (maxima, ties, NaN, +inf, -inf) at run, block and
//! chunk boundaries and in the last partial run, and each case asserts:
//! - `distribution()` equals the expected answer within 1e-6 per entry and 1e-5 in total
//!   variation, removed ids are exactly 0, and the support is the expected one;
//! - every `sample_row` token is the spec's inverse CDF (step 11) of `distribution()` and of
//!   the expected probabilities, at three (position, sample index) pairs, with the seed,
//!   logprob and candidate count that go with it;
//! - exact values computed here: greedy ids, top-k support sizes and sets, the survivors of
//!   equal rows.
//!
//! The expected answer is the oracle's (common/oracle.rs), except where the test computes it
//! itself: ties of 10^4-10^5 ids at a cut (the oracle's near-tie check is quadratic in them),
//! rows of logits near ±3e38 (its rounding allowances, relative to |l|, call every neighbour a
//! near-tie although `l - max` is exact there), and -0.0 beside +0.0 (its `total_cmp` sort
//! orders them; the spec's ties do not). As in proptest_oracle.rs, rows whose decision the
//! oracle finds within rounding of a boundary (spec "Arithmetic") are skipped, and each test
//! requires most of its cases compared.
//!
//! The ISA is chosen by the CPU; under `qemu-x86_64 -cpu max` (AVX2, no AVX-512) and
//! `-cpu qemu64` (SSE2) the same binary runs the other paths.

use std::time::Instant;

use super::oracle::{oracle_with_stops, Oracle};
use super::{inverse_cdf, normal_row, spec_uniform};
use nucleus_sampling::{distribution, sample_row, SampleOutput, SampleRequest, SamplingParams};

/// Vocabulary sizes: odd sizes one past a chunk and two chunks (last run of 1 value), Llama 2,
/// GPT-2 (last run of 17 values), Qwen's padded table.
pub const SIZES: [usize; 5] = [8_193, 16_385, 32_000, 50_257, 151_936];

/// The (position, sample index) pairs drawn for every case.
pub const DRAWS: [(u64, u32); 3] = [(7, 0), (4_099, 1), ((1 << 32) + 9, 3)];

pub const TEMPERATURES: [f64; 3] = [0.3, 1.0, 2.5];

/// Context of one request: prompt, generated ids, EOS / stop ids.
#[derive(Clone, Debug, Default)]
pub struct Hist {
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    pub stops: Vec<u32>,
}

impl Hist {
    pub fn request<'a>(&'a self, p: &'a SamplingParams, pos: u64, idx: u32) -> SampleRequest<'a> {
        SampleRequest::new(p, &self.prompt, &self.output, pos)
            .with_stop_token_ids(&self.stops)
            .with_sample_index(idx)
    }

    /// Distinct ids of prompt and output.
    pub fn distinct(&self) -> usize {
        let mut ids: Vec<u32> = self.prompt.iter().chain(&self.output).copied().collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }
}

/// Cases run, compared with the expected answer, and skipped as boundary cases, per test.
pub struct Tally {
    pub what: &'static str,
    pub cases: usize,
    pub compared: usize,
    pub skipped: Vec<String>,
    pub started: Instant,
}

impl Tally {
    pub fn new(what: &'static str) -> Self {
        Self {
            what,
            cases: 0,
            compared: 0,
            skipped: Vec::new(),
            started: Instant::now(),
        }
    }

    /// Reports, and requires at least `min_percent` of the cases compared (not skipped).
    pub fn finish(&self, min_percent: usize) {
        eprintln!(
            "{}: {} cases, {} compared, {} skipped as boundary cases {:?}, {:.2?}",
            self.what,
            self.cases,
            self.compared,
            self.skipped.len(),
            self.skipped,
            self.started.elapsed()
        );
        assert!(self.cases > 0);
        assert!(
            self.compared * 100 >= self.cases * min_percent,
            "{}: only {} of {} cases compared; skipped {:?}",
            self.what,
            self.compared,
            self.cases,
            self.skipped
        );
    }
}

/// What `check` saw: the implementation's distribution, the expected answer, the tokens drawn
/// at [`DRAWS`].
pub struct Checked {
    pub d: Vec<f64>,
    pub o: Oracle,
    pub tokens: Vec<u32>,
}

pub fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        seed: Some(seed),
        ..Default::default()
    }
}

pub fn greedy(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..seeded(seed)
    }
}

/// The logits around id `i`, for messages (never the whole row).
pub fn around<T: std::fmt::Debug>(v: &[T], i: usize) -> String {
    let lo = i.saturating_sub(2);
    let hi = (i + 3).min(v.len());
    format!("[{lo}..{hi}] = {:?}", &v[lo..hi])
}

/// Checks one sampled output against the distribution it was drawn from: seed, candidate
/// count, logprob, and the token as the inverse CDF of `d` at the spec's uniform.
#[track_caller]
pub fn check_output(
    name: &str,
    s: &SampleOutput,
    d: &[f64],
    greedy: bool,
    seed: u64,
    draw: (u64, u32),
) {
    let (pos, idx) = draw;
    assert_eq!(s.seed, seed, "{name}: seed");
    assert!(s.extra_samples.is_empty() && s.logprobs.is_none(), "{name}");
    let tok = s.token as usize;
    assert!(tok < d.len(), "{name}: token {tok} out of range");
    assert!(d[tok] > 0.0, "{name}: token {tok} has probability 0");
    let nonzero = d.iter().filter(|&&x| x > 0.0).count();
    assert_eq!(s.num_candidates, nonzero, "{name}: num_candidates");
    if greedy {
        assert_eq!(s.logprob, 0.0, "{name}: greedy logprob");
        assert_eq!(d[tok], 1.0, "{name}: greedy token");
    } else {
        assert!(
            (s.logprob - d[tok].ln()).abs() <= 1e-6,
            "{name}: logprob {} vs ln p {}",
            s.logprob,
            d[tok].ln()
        );
        let u = spec_uniform(seed, pos, idx);
        if let Some(want) = inverse_cdf(d, u, 1e-12) {
            assert_eq!(
                s.token, want,
                "{name}: (position {pos}, sample {idx}) u = {u}: \
                 not the inverse CDF of distribution()"
            );
        }
    }
}

/// The largest |cumulative difference| between two distributions in id order.
pub fn max_cum_diff(a: &[f64], b: &[f64]) -> f64 {
    let (mut cum, mut worst) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        cum += x - y;
        worst = worst.max(cum.abs());
    }
    worst
}

/// `distribution()` against the expected answer `o`: within 1e-6 per entry, total variation
/// within 1e-5, removed ids exactly 0, survivors non-zero (unless the expected probability is
/// below 1e-30, where an f32 weight underflows).
#[track_caller]
pub fn compare_with_oracle(name: &str, row: &[f32], d: &[f64], o: &Oracle) {
    let mut tv = 0.0;
    for (i, (&g, &w)) in d.iter().zip(&o.probs).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6,
            "{name}: id {i}: distribution {g} vs expected {w}; logits {}; processed {}",
            around(row, i),
            o.penalised[i]
        );
        if !o.support[i] {
            assert_eq!(
                g,
                0.0,
                "{name}: id {i} was removed by a filter; logits {}",
                around(row, i)
            );
        } else if w > 1e-30 {
            assert!(
                g > 0.0,
                "{name}: id {i} survives with expected probability {w}, got 0"
            );
        }
        tv += (g - w).abs();
    }
    assert!(
        tv <= 1e-5,
        "{name}: total variation {tv} from the expected answer"
    );
}

/// The whole comparison for one row and request against the oracle (see the module docs).
/// Returns what it saw for the caller's exact assertions.
#[track_caller]
pub fn check(t: &mut Tally, name: &str, row: &[f32], p: &SamplingParams, h: &Hist) -> Checked {
    let o = oracle_with_stops(row, p, &h.prompt, &h.output, &h.stops)
        .unwrap_or_else(|e| panic!("{name}: oracle: {e:?}"));
    check_against(t, name, row, p, h, o)
}

/// An expected answer computed by the test instead of the oracle (see the module docs):
/// `probs`, never fragile, the support its non-zero entries, the masked ids those of the row.
pub fn given(row: &[f32], probs: Vec<f64>, greedy: bool) -> Oracle {
    Oracle {
        support: probs.iter().map(|&x| x > 0.0).collect(),
        probs,
        greedy,
        fragile: false,
        penalised: row.iter().map(|&l| f64::from(l)).collect(),
    }
}

/// One-hot on `id`.
pub fn one_hot(row: &[f32], id: usize, greedy: bool) -> Oracle {
    let mut probs = vec![0.0; row.len()];
    probs[id] = 1.0;
    given(row, probs, greedy)
}

/// Uniform over `ids`.
pub fn uniform(row: &[f32], ids: &[usize]) -> Oracle {
    let mut probs = vec![0.0; row.len()];
    for &i in ids {
        probs[i] = 1.0 / ids.len() as f64;
    }
    given(row, probs, false)
}

/// [`check`] against the expected answer `o`: the oracle's, or one given by the test.
#[track_caller]
pub fn check_against(
    t: &mut Tally,
    name: &str,
    row: &[f32],
    p: &SamplingParams,
    h: &Hist,
    o: Oracle,
) -> Checked {
    t.cases += 1;
    let seed = p.seed.expect("tests use fixed seeds");
    let d = distribution(row, &h.request(p, 0, 0))
        .unwrap_or_else(|e| panic!("{name}: distribution: {e}"));
    assert_eq!(d.len(), row.len(), "{name}: length");
    let mut sum = 0.0;
    for (i, &x) in d.iter().enumerate() {
        assert!(x.is_finite() && x >= 0.0, "{name}: id {i}: {x}");
        if o.penalised[i] == f64::NEG_INFINITY {
            assert_eq!(x, 0.0, "{name}: id {i} is masked or banned");
        }
        sum += x;
    }
    assert!((sum - 1.0).abs() <= 1e-9, "{name}: sum {sum}");
    let mut tokens = Vec::new();
    for draw in DRAWS {
        let s = sample_row(row, &h.request(p, draw.0, draw.1))
            .unwrap_or_else(|e| panic!("{name}: sample_row: {e}"));
        check_output(name, &s, &d, o.greedy, seed, draw);
        tokens.push(s.token);
    }
    if o.fragile {
        t.skipped.push(name.to_string());
        return Checked { d, o, tokens };
    }
    t.compared += 1;
    compare_with_oracle(name, row, &d, &o);
    if !o.greedy {
        let margin = 1e-9 + max_cum_diff(&d, &o.probs);
        for ((pos, idx), &tok) in DRAWS.into_iter().zip(&tokens) {
            let u = spec_uniform(seed, pos, idx);
            if let Some(want) = inverse_cdf(&o.probs, u, margin) {
                assert_eq!(
                    tok, want,
                    "{name}: (position {pos}, sample {idx}) u = {u}: not the expected inverse CDF"
                );
            }
        }
    }
    Checked { d, o, tokens }
}

/// Asserts `d` is one-hot on `id` and every draw chose it.
#[track_caller]
pub fn assert_one_hot(name: &str, c: &Checked, id: usize) {
    assert_eq!(c.d[id], 1.0, "{name}: want one-hot on {id}");
    assert!(
        c.tokens.iter().all(|&x| x as usize == id),
        "{name}: tokens {:?}, want {id}",
        c.tokens
    );
}

pub fn support_size(d: &[f64]) -> usize {
    d.iter().filter(|&&x| x > 0.0).count()
}

/// The expected answer keeps exactly `want` ids, and the implementation keeps those of them
/// whose weight does not underflow (an expected probability above 1e-30) and no other.
#[track_caller]
pub fn assert_support_size(name: &str, c: &Checked, want: usize) {
    let oracle = c.o.support.iter().filter(|&&x| x).count();
    assert_eq!(oracle, want, "{name}: oracle support");
    if c.o.fragile {
        return;
    }
    let sure = c.o.probs.iter().filter(|&&x| x > 1e-30).count();
    let size = support_size(&c.d);
    assert!(
        sure <= size && size <= want,
        "{name}: support {size}, want {sure}..={want}"
    );
}

/// The lowest id of the maximum of `values`.
pub fn argmax(values: impl Iterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (i, v) in values.enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0
}

/// Ids of the `m` largest logits, in the spec's order (logit descending, ties to the lower id).
pub fn top_ids(row: &[f32], m: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    ids.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    ids.truncate(m);
    ids
}

/// `row` rounded to multiples of `step` (a power of two, so exact): many exact ties. Zeros are
/// +0.0 (the oracle's sort orders -0.0 below +0.0; signed zeros have their own test).
pub fn quantised(row: &[f32], step: f32) -> Vec<f32> {
    row.iter()
        .map(|&x| (x / step).round() * step + 0.0)
        .collect()
}

/// normal(0, 3) with spikes 20, 19, 18, 15, 14 at ids spread over the row (first run, a block
/// boundary, the middle, a chunk boundary, the last id). At T = 0.3 the first three spikes
/// hold all but 6e-8 of the mass.
pub fn peaked_row(seed: u64, n: usize) -> Vec<f32> {
    let mut row = normal_row(seed, n, 3.0);
    for (id, v) in [
        (31, 20.0),
        (512, 19.0),
        (n / 2, 18.0),
        (8_192, 15.0),
        (n - 1, 14.0),
    ] {
        row[id] = v;
    }
    row
}

/// Row kinds of the temperature, top-k and top-p tests, by name.
pub fn row_kind(kind: &str, seed: u64, n: usize) -> Vec<f32> {
    match kind {
        "normal(0,3)" => normal_row(seed, n, 3.0),
        "peaked" => peaked_row(seed, n),
        "quantised 1/4" => quantised(&normal_row(seed, n, 3.0), 0.25),
        "ascending" => (0..n).map(|i| i as f32 / 1024.0).collect(),
        "descending" => (0..n).map(|i| -(i as f32) / 1024.0).collect(),
        "flat equal" => vec![0.75; n],
        "flat normal(0,0.1)" => normal_row(seed, n, 0.1),
        "flat normal(0,1)" => normal_row(seed, n, 1.0),
        "spikes over normal(0,1)" => {
            // At T = 0.3 the three spikes leave less than 1e-12 of the mass to the rest, so
            // that a top-p of 0.999999 has a cut clear of rounding.
            let mut row = normal_row(seed, n, 1.0);
            for (id, v) in [(n - 1, 20.0), (8_191, 19.0), (32, 18.0)] {
                row[id] = v;
            }
            row
        }
        _ => unreachable!("{kind}"),
    }
}
