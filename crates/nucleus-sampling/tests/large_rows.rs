//! Large rows (8,193 to 327,680 ids) against the f64 oracle of spec/sampling.md.
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

mod common;

use std::collections::BTreeMap;
use std::time::Instant;

use common::oracle::{oracle_with_stops, Oracle, OracleError};
use common::{inverse_cdf, normal_row, spec_uniform, SplitMix};
use half::{bf16, f16};
use nucleus_sampling::{
    distribution, distribution_from_probs, sample_batch, sample_row, sample_row_from_probs,
    LogitsView, SampleError, SampleOutput, SampleRequest, SamplingParams,
};

/// Vocabulary sizes: odd sizes one past a chunk and two chunks (last run of 1 value), Llama 2,
/// GPT-2 (last run of 17 values), Qwen's padded table.
const SIZES: [usize; 5] = [8_193, 16_385, 32_000, 50_257, 151_936];

/// The (position, sample index) pairs drawn for every case.
const DRAWS: [(u64, u32); 3] = [(7, 0), (4_099, 1), ((1 << 32) + 9, 3)];

const TEMPERATURES: [f64; 3] = [0.3, 1.0, 2.5];

/// Context of one request: prompt, generated ids, EOS / stop ids.
#[derive(Clone, Debug, Default)]
struct Hist {
    prompt: Vec<u32>,
    output: Vec<u32>,
    stops: Vec<u32>,
}

impl Hist {
    fn request<'a>(&'a self, p: &'a SamplingParams, pos: u64, idx: u32) -> SampleRequest<'a> {
        SampleRequest::new(p, &self.prompt, &self.output, pos)
            .with_stop_token_ids(&self.stops)
            .with_sample_index(idx)
    }

    /// Distinct ids of prompt and output.
    fn distinct(&self) -> usize {
        let mut ids: Vec<u32> = self.prompt.iter().chain(&self.output).copied().collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }
}

/// Cases run, compared with the expected answer, and skipped as boundary cases, per test.
struct Tally {
    what: &'static str,
    cases: usize,
    compared: usize,
    skipped: Vec<String>,
    started: Instant,
}

impl Tally {
    fn new(what: &'static str) -> Self {
        Self {
            what,
            cases: 0,
            compared: 0,
            skipped: Vec::new(),
            started: Instant::now(),
        }
    }

    /// Reports, and requires at least `min_percent` of the cases compared (not skipped).
    fn finish(&self, min_percent: usize) {
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
struct Checked {
    d: Vec<f64>,
    o: Oracle,
    tokens: Vec<u32>,
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        seed: Some(seed),
        ..Default::default()
    }
}

fn greedy(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..seeded(seed)
    }
}

/// The logits around id `i`, for messages (never the whole row).
fn around<T: std::fmt::Debug>(v: &[T], i: usize) -> String {
    let lo = i.saturating_sub(2);
    let hi = (i + 3).min(v.len());
    format!("[{lo}..{hi}] = {:?}", &v[lo..hi])
}

/// Checks one sampled output against the distribution it was drawn from: seed, candidate
/// count, logprob, and the token as the inverse CDF of `d` at the spec's uniform.
#[track_caller]
fn check_output(
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
fn max_cum_diff(a: &[f64], b: &[f64]) -> f64 {
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
fn compare_with_oracle(name: &str, row: &[f32], d: &[f64], o: &Oracle) {
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
fn check(t: &mut Tally, name: &str, row: &[f32], p: &SamplingParams, h: &Hist) -> Checked {
    let o = oracle_with_stops(row, p, &h.prompt, &h.output, &h.stops)
        .unwrap_or_else(|e| panic!("{name}: oracle: {e:?}"));
    check_against(t, name, row, p, h, o)
}

/// An expected answer computed by the test instead of the oracle (see the module docs):
/// `probs`, never fragile, the support its non-zero entries, the masked ids those of the row.
fn given(row: &[f32], probs: Vec<f64>, greedy: bool) -> Oracle {
    Oracle {
        support: probs.iter().map(|&x| x > 0.0).collect(),
        probs,
        greedy,
        fragile: false,
        penalised: row.iter().map(|&l| f64::from(l)).collect(),
    }
}

/// One-hot on `id`.
fn one_hot(row: &[f32], id: usize, greedy: bool) -> Oracle {
    let mut probs = vec![0.0; row.len()];
    probs[id] = 1.0;
    given(row, probs, greedy)
}

/// Uniform over `ids`.
fn uniform(row: &[f32], ids: &[usize]) -> Oracle {
    let mut probs = vec![0.0; row.len()];
    for &i in ids {
        probs[i] = 1.0 / ids.len() as f64;
    }
    given(row, probs, false)
}

/// [`check`] against the expected answer `o`: the oracle's, or one given by the test.
#[track_caller]
fn check_against(
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
fn assert_one_hot(name: &str, c: &Checked, id: usize) {
    assert_eq!(c.d[id], 1.0, "{name}: want one-hot on {id}");
    assert!(
        c.tokens.iter().all(|&x| x as usize == id),
        "{name}: tokens {:?}, want {id}",
        c.tokens
    );
}

fn support_size(d: &[f64]) -> usize {
    d.iter().filter(|&&x| x > 0.0).count()
}

/// The expected answer keeps exactly `want` ids, and the implementation keeps those of them
/// whose weight does not underflow (an expected probability above 1e-30) and no other.
#[track_caller]
fn assert_support_size(name: &str, c: &Checked, want: usize) {
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
fn argmax(values: impl Iterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (i, v) in values.enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0
}

/// Ids of the `m` largest logits, in the spec's order (logit descending, ties to the lower id).
fn top_ids(row: &[f32], m: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    ids.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    ids.truncate(m);
    ids
}

/// `row` rounded to multiples of `step` (a power of two, so exact): many exact ties. Zeros are
/// +0.0 (the oracle's sort orders -0.0 below +0.0; signed zeros have their own test).
fn quantised(row: &[f32], step: f32) -> Vec<f32> {
    row.iter()
        .map(|&x| (x / step).round() * step + 0.0)
        .collect()
}

/// normal(0, 3) with spikes 20, 19, 18, 15, 14 at ids spread over the row (first run, a block
/// boundary, the middle, a chunk boundary, the last id). At T = 0.3 the first three spikes
/// hold all but 6e-8 of the mass.
fn peaked_row(seed: u64, n: usize) -> Vec<f32> {
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
fn row_kind(kind: &str, seed: u64, n: usize) -> Vec<f32> {
    match kind {
        "normal(0,3)" => normal_row(seed, n, 3.0),
        "peaked" => peaked_row(seed, n),
        "quantised 1/4" => quantised(&normal_row(seed, n, 3.0), 0.25),
        "ascending" => (0..n).map(|i| i as f32 / 1024.0).collect(),
        "descending" => (0..n).map(|i| -(i as f32) / 1024.0).collect(),
        "flat equal" => vec![0.75; n],
        "flat normal(0,0.1)" => normal_row(seed, n, 0.1),
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

// ---------------------------------------------------------------------------------------------
// Greedy

/// Step 6: the argmax, ties to the lowest id, wherever the maxima lie relative to runs, blocks
/// and chunks; at temperature 0, below 1e-5 (other filters ignored) and as top_k = 1.
#[test]
fn greedy_argmax_wherever_the_maxima_lie() {
    let mut t = Tally::new("greedy");
    for (s, &n) in SIZES.iter().enumerate() {
        let base = normal_row(100 + s as u64, n, 3.0);
        let last_run = (n - 1) / 32 * 32;
        let last_block = (n - 1) / 512 * 512;
        let scenarios: [(&str, Vec<usize>); 12] = [
            ("max at id 0", vec![0]),
            ("max at vocab-1", vec![n - 1]),
            ("tie at vocab-2 and vocab-1", vec![n - 1, n - 2]),
            ("ties in three blocks", vec![7 * 512 + 100, 3 * 512 + 5, 40]),
            ("tie across a run boundary", vec![32, 31]),
            ("tie across a block boundary", vec![512, 511]),
            ("tie across a chunk boundary", vec![8_192, 8_191]),
            ("tie in the last run", vec![n - 1, last_run]),
            ("max at vocab-1 tied with id 0", vec![n - 1, 0]),
            ("tie at both ends of a block", vec![1_535, 1_024]),
            (
                "max in the last block",
                vec![last_block + (n - 1 - last_block) / 2],
            ),
            (
                "tie of 64 ids, one per block",
                (0..64).map(|b| (n - 1 - 37 * b) / 512 * 512 + b).collect(),
            ),
        ];
        for (what, ids) in scenarios {
            let mut row = base.clone();
            for &i in &ids {
                row[i] = 50.0;
            }
            let want = *ids.iter().min().unwrap();
            let params = [
                ("T=0", greedy(s as u64)),
                (
                    "T=5e-6 with top_k 50, top_p 0.3, min_p 0.5",
                    SamplingParams {
                        temperature: 5e-6,
                        top_k: 50,
                        top_p: 0.3,
                        min_p: 0.5,
                        ..seeded(s as u64)
                    },
                ),
                (
                    "top_k 1 at T=0.7",
                    SamplingParams {
                        temperature: 0.7,
                        top_k: 1,
                        ..seeded(s as u64)
                    },
                ),
            ];
            for (j, (pname, p)) in params.iter().enumerate() {
                let name = format!("vocab {n}, {what}, {pname}");
                let c = if j == 0 {
                    check(&mut t, &name, &row, p, &Hist::default())
                } else {
                    let o = one_hot(&row, want, p.is_greedy());
                    check_against(&mut t, &name, &row, p, &Hist::default(), o)
                };
                assert_one_hot(&name, &c, want);
            }
        }
        // One ulp above a tie: the larger value wins although its id is higher. (The oracle
        // calls one ulp a near-tie; without bias or penalties the argmax compares the row's
        // own f32 values, which leaves no room for rounding.)
        let mut row = base.clone();
        row[300] = 50.0;
        row[n - 2] = f32::from_bits(50.0f32.to_bits() + 1);
        row[n - 1] = 50.0;
        for (pname, p) in [
            ("greedy", greedy(9)),
            (
                "top_k 1",
                SamplingParams {
                    top_k: 1,
                    ..seeded(9)
                },
            ),
        ] {
            let name = format!("vocab {n}, max one ulp above a lower tie, {pname}");
            let o = one_hot(&row, n - 2, p.is_greedy());
            let c = check_against(&mut t, &name, &row, &p, &Hist::default(), o);
            assert_one_hot(&name, &c, n - 2);
        }
        // An equal row: id 0.
        let row = vec![-3.5f32; n];
        let name = format!("vocab {n}, equal row");
        let o = one_hot(&row, 0, true);
        let c = check_against(&mut t, &name, &row, &greedy(9), &Hist::default(), o);
        assert_one_hot(&name, &c, 0);
    }
    t.finish(100);
}

/// -0.0 and +0.0 are the same logit (equal weights at any temperature), so at the maximum they
/// tie and the lower id wins, whichever zero it holds. Checked directly, not with the oracle
/// (whose sort uses `total_cmp`, which orders -0.0 below +0.0).
#[test]
fn signed_zeros_at_the_maximum_tie() {
    for &n in &[8_193usize, 32_000] {
        for (lo, hi) in [(37usize, 900usize), (511, 512), (31, n - 1)] {
            for (zl, zh) in [(-0.0f32, 0.0f32), (0.0, -0.0)] {
                let mut row = vec![-1.0f32; n];
                row[lo] = zl;
                row[hi] = zh;
                for p in [
                    greedy(3),
                    SamplingParams {
                        top_k: 1,
                        ..seeded(3)
                    },
                ] {
                    let req = SampleRequest::new(&p, &[], &[], 5);
                    let d = distribution(&row, &req).unwrap();
                    let s = sample_row(&row, &req).unwrap();
                    assert_eq!(
                        (d[lo], s.token as usize),
                        (1.0, lo),
                        "vocab {n}: {zl:?} at {lo}, {zh:?} at {hi}, {p:?}"
                    );
                }
                // Without a filter the two zeros weigh the same.
                let p = seeded(3);
                let d = distribution(&row, &SampleRequest::new(&p, &[], &[], 5)).unwrap();
                assert_eq!(d[lo], d[hi], "vocab {n}: {zl:?} at {lo}, {zh:?} at {hi}");
            }
        }
    }
}

/// Exact weights `exp((l_i - max) / T)` of `kept`, renormalised, in f64.
fn softmax_of(row: &[f32], kept: &[usize], temperature: f64) -> Vec<f64> {
    let max = kept
        .iter()
        .map(|&i| f64::from(row[i]))
        .fold(f64::NEG_INFINITY, f64::max);
    let mut probs = vec![0.0; row.len()];
    for &i in kept {
        probs[i] = ((f64::from(row[i]) - max) / temperature).exp();
    }
    let z: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= z);
    probs
}

/// Asserts that `distribution()` keeps exactly the ids `kept` (in any order).
#[track_caller]
fn assert_kept(name: &str, row: &[f32], p: &SamplingParams, kept: &[usize]) {
    let d = distribution(row, &SampleRequest::new(p, &[], &[], 0)).unwrap();
    let mut want = kept.to_vec();
    want.sort_unstable();
    let got: Vec<usize> = (0..row.len()).filter(|&i| d[i] > 0.0).collect();
    let missing: Vec<usize> = want.iter().copied().filter(|i| d[*i] == 0.0).collect();
    let extra: Vec<usize> = got
        .iter()
        .copied()
        .filter(|i| want.binary_search(i).is_err())
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{name}: {} ids kept, want {} (top_k {}); missing {:?}, extra {:?}",
        got.len(),
        want.len(),
        p.top_k,
        &missing[..missing.len().min(8)],
        &extra[..extra.len().min(8)]
    );
}

/// Top-k with -0.0 and +0.0 tied at the cut (quantised or rounded logits produce both): exactly
/// k ids are kept (spec step 9), and since the two zeros are the same logit, the tie goes to
/// the lowest ids whatever their sign. Min-p and top-p treat the zeros as equal too. Checked
/// against expectations computed here (the oracle's `total_cmp` sort puts -0.0 below +0.0).
#[test]
fn top_k_with_signed_zeros_at_the_cut_keeps_exactly_k() {
    let mut t = Tally::new("signed zeros at a cut");
    // Minimal rows.
    let small: [(&[f32], i64, &[usize]); 5] = [
        (&[1.0, -0.0, 0.0], 2, &[0, 1]),
        (&[-0.0, -1.0, 0.0], 2, &[0, 2]),
        (&[-0.0, -0.0, 0.0, 0.0], 3, &[0, 1, 2]),
        (&[0.0, -0.0, 0.0], 2, &[0, 1]),
        (&[-0.0, 0.0, 2.0], 2, &[0, 2]),
    ];
    for (row, k, kept) in small {
        let p = SamplingParams {
            top_k: k,
            ..seeded(17)
        };
        let name = format!("{row:?}, top_k {k}");
        assert_kept(&name, row, &p, kept);
        let o = given(row, softmax_of(row, kept, 1.0), false);
        check_against(&mut t, &name, row, &p, &Hist::default(), o);
    }
    // Large rows: normal(0, 3) rounded to quarters keeps the sign of the values rounded to 0.
    for (s, &n) in [8_193usize, 50_257, 151_936].iter().enumerate() {
        let row: Vec<f32> = normal_row(3_000 + s as u64, n, 3.0)
            .iter()
            .map(|&x| (x / 0.25).round() * 0.25)
            .collect();
        let positive: Vec<usize> = (0..n).filter(|&i| row[i] > 0.0).collect();
        let zeros: Vec<usize> = (0..n).filter(|&i| row[i] == 0.0).collect();
        let negative_zeros = zeros.iter().filter(|&&i| row[i].is_sign_negative()).count();
        assert!(negative_zeros > 10 && zeros.len() - negative_zeros > 10);
        let nz = zeros.len();
        for (j, m) in [1, nz / 3, nz / 2, nz - 1].into_iter().enumerate() {
            let k = positive.len() + m;
            let temperature = TEMPERATURES[(j + s) % 3].max(1.0);
            let p = SamplingParams {
                top_k: k as i64,
                temperature,
                ..seeded(18 + j as u64)
            };
            let mut kept = positive.clone();
            kept.extend_from_slice(&zeros[..m]);
            let name = format!("vocab {n}, {nz} zeros ({negative_zeros} of them -0.0), top_k {k}");
            assert_kept(&name, &row, &p, &kept);
            let o = given(&row, softmax_of(&row, &kept, temperature), false);
            check_against(&mut t, &name, &row, &p, &Hist::default(), o);
        }
    }
    // Min-p 1 keeps every zero at the maximum; top-p on an all-zero row keeps the lowest ids.
    for &n in &[8_193usize, 32_000] {
        let mut row = vec![-1.0f32; n];
        let ids = [3usize, 31, 32, 511, 512, 4_000, n - 1];
        for (j, &i) in ids.iter().enumerate() {
            row[i] = if j % 2 == 0 { -0.0 } else { 0.0 };
        }
        let p = SamplingParams {
            min_p: 1.0,
            ..seeded(19)
        };
        let name = format!("vocab {n}, ±0 at the maximum, min_p 1");
        check_against(
            &mut t,
            &name,
            &row,
            &p,
            &Hist::default(),
            uniform(&row, &ids),
        );
        let zeros: Vec<f32> = (0..n)
            .map(|i| if i % 3 == 0 { -0.0 } else { 0.0 })
            .collect();
        let p = SamplingParams {
            top_p: 0.5,
            ..seeded(20)
        };
        let m = n.div_ceil(2);
        let first: Vec<usize> = (0..m).collect();
        let name = format!("vocab {n}, ±0 everywhere, top_p 0.5");
        check_against(
            &mut t,
            &name,
            &zeros,
            &p,
            &Hist::default(),
            uniform(&zeros, &first),
        );
    }
    t.finish(100);
}

// ---------------------------------------------------------------------------------------------
// Top-k

/// Step 9, exact k with ties to the lower id, for k from 1 to past vocab/16 (where the top-k
/// buffer gives way to another path) on continuous, heavily tied, ascending (every value beats
/// the running threshold: the buffer compacts again and again) and descending rows.
#[test]
fn top_k_keeps_exactly_k_on_large_rows() {
    let mut t = Tally::new("top_k");
    let kinds = ["normal(0,3)", "quantised 1/4", "ascending", "descending"];
    for (s, &n) in SIZES.iter().enumerate() {
        let v16 = n / 16;
        let ks = [
            1,
            2,
            50,
            1000,
            v16 - 1,
            v16,
            v16 + 1,
            2 * v16,
            n / 2,
            n - 1,
            n,
            n + 5,
        ];
        for (r, kind) in kinds.iter().enumerate() {
            let row = row_kind(kind, 200 + s as u64, n);
            for (j, &k) in ks.iter().enumerate() {
                // Every k on every row of the two smallest sizes; a rotating half elsewhere.
                if s >= 2 && (j + r + s) % 2 == 1 {
                    continue;
                }
                let temperature = TEMPERATURES[(j + r + s) % 3];
                let p = SamplingParams {
                    temperature,
                    top_k: k as i64,
                    ..seeded(1_000 + j as u64)
                };
                let name = format!("vocab {n}, {kind}, top_k {k}, T {temperature}");
                let c = check(&mut t, &name, &row, &p, &Hist::default());
                assert_support_size(&name, &c, k.min(n));
                match *kind {
                    "ascending" => assert!(c.d[n - 1] > 0.0 && (k >= n || c.d[n - 1 - k] == 0.0)),
                    "descending" => assert!(c.d[0] > 0.0 && (k >= n || c.d[k] == 0.0)),
                    _ => {}
                }
            }
        }
    }
    t.finish(95);
}

/// Ties at the k-th value spread over every block (every 7th id): exactly the lowest ids of
/// the tie are kept. Expected values computed here (a tie of 21,706 ids at the cut makes the
/// oracle's near-tie check quadratic).
#[test]
fn top_k_breaks_a_wide_tie_toward_the_lower_ids() {
    let mut t = Tally::new("top_k wide tie");
    for (s, &n) in SIZES.iter().enumerate() {
        // 10 ids at 5.0 and every 7th id at 2.0; the rest below.
        let mut row = normal_row(300 + s as u64, n, 0.3);
        let tied: Vec<usize> = (0..n).step_by(7).collect();
        for &i in &tied {
            row[i] = 2.0;
        }
        let top: Vec<usize> = (0..10)
            .map(|j| (j * 4_099 + 3) % n)
            .filter(|i| i % 7 != 0)
            .collect();
        for &i in &top {
            row[i] = 5.0;
        }
        for k in [
            top.len() + 1,
            top.len() + 33,
            top.len() + 600,
            n / 16,
            n / 8,
        ] {
            let p = SamplingParams {
                top_k: k as i64,
                ..seeded(s as u64)
            };
            let name = format!("vocab {n}, tie of {} ids, top_k {k}", tied.len());
            let kept_ties = k - top.len();
            let mut kept = top.clone();
            kept.extend_from_slice(&tied[..kept_ties]);
            let o = given(&row, softmax_of(&row, &kept, 1.0), false);
            let c = check_against(&mut t, &name, &row, &p, &Hist::default(), o);
            for (j, &i) in tied.iter().enumerate() {
                assert_eq!(c.d[i] > 0.0, j < kept_ties, "{name}: tied id {i} (#{j})");
            }
            for &i in &top {
                assert!(c.d[i] > 0.0, "{name}: top id {i}");
            }
            assert_support_size(&name, &c, k);
        }
    }
    t.finish(100);
}

// ---------------------------------------------------------------------------------------------
// Steps 3-5 with top-k and greedy: sparse and dense paths

/// A history of `total` ids: 60% in the prompt, the rest in the output, where every third id
/// repeats an earlier output id (frequency counts above 1); the new ids are drawn a quarter
/// from the `4 * total / 10` largest logits (so that penalties move ids across the top-k
/// cut), the rest anywhere.
fn history(row: &[f32], seed: u64, total: usize) -> Hist {
    let mut g = SplitMix(seed);
    let n = row.len() as u64;
    let top = top_ids(row, (total * 4 / 10).max(8));
    let split = total * 6 / 10;
    let (mut prompt, mut output) = (Vec::new(), Vec::new());
    for j in 0..total {
        if j >= split && j % 3 == 0 && !output.is_empty() {
            let again = output[g.below(output.len() as u64) as usize];
            output.push(again);
            continue;
        }
        let id = if j % 4 == 0 {
            top[g.below(top.len() as u64) as usize]
        } else {
            g.below(n) as u32
        };
        if j < split {
            prompt.push(id);
        } else {
            output.push(id);
        }
    }
    Hist {
        prompt,
        output,
        stops: Vec::new(),
    }
}

/// Repetition, frequency and presence penalties with top-k and greedy, over 256 and 20,000
/// history ids, with k on both sides of the sparse-path threshold vocab = 16 (k + touched ids)
/// for both readings of "touched" (distinct ids, or every context id).
#[test]
fn penalties_with_top_k_and_greedy_on_long_histories() {
    let mut t = Tally::new("penalties");
    let cases: [(usize, usize); 4] = [
        (32_000, 256),
        (151_936, 256),
        (151_936, 20_000),
        (327_680, 20_000),
    ];
    for (s, &(n, distinct)) in cases.iter().enumerate() {
        // Continuous logits on the smallest row; multiples of 2^-10 on the others, on which
        // the dyadic penalties below act exactly (the oracle then needs no perturbation pass
        // per id bit to bound their rounding, which costs seconds on these rows).
        let row = if n < 100_000 {
            normal_row(400 + s as u64, n, 3.0)
        } else {
            quantised(&normal_row(400 + s as u64, n, 3.0), 1.0 / 1024.0)
        };
        let h = history(&row, 500 + s as u64, distinct);
        let touched_distinct = h.distinct();
        let touched_all = h.prompt.len() + h.output.len();
        let mut ks: Vec<i64> = vec![1, 50, 1000];
        for touched in [touched_distinct, touched_all] {
            if n / 16 > touched + 1 {
                let k0 = (n / 16 - touched) as i64;
                ks.extend([k0 - 1, k0, k0 + 1]);
            }
        }
        ks.push((n / 16) as i64 + 1);
        let sets: [(&str, f64, f64, f64, f64); 4] = [
            ("rep 2, freq 0.5, pres 0.25", 2.0, 0.5, 0.25, 1.0),
            ("rep 1.3, freq 0.1, pres -0.7", 1.3, 0.1, -0.7, 0.7),
            ("rep 0.5, pres -2", 0.5, 0.0, -2.0, 2.5),
            ("freq 2, pres 2", 1.0, 2.0, 2.0, 0.3),
        ];
        for (j, &k) in ks.iter().enumerate() {
            let (what, rep, freq, pres, temperature) = sets[j % sets.len()];
            // The inexact set costs the oracle a perturbation pass per id bit: once per large
            // row (k = 50), otherwise on the smallest row only.
            let (what, rep, freq, pres) = if n > 100_000 && rep == 1.3 && k != 50 {
                ("rep 2, freq 0.5, pres 0.25", 2.0, 0.5, 0.25)
            } else {
                (what, rep, freq, pres)
            };
            let p = SamplingParams {
                temperature,
                top_k: k,
                repetition_penalty: rep,
                frequency_penalty: freq,
                presence_penalty: pres,
                ..seeded(600 + j as u64)
            };
            let name = format!(
                "vocab {n}, {touched_distinct} distinct history ids, {what}, top_k {k}, \
                 T {temperature}"
            );
            let c = check(&mut t, &name, &row, &p, &h);
            assert_support_size(&name, &c, (k as usize).min(n));
        }
        // Greedy: the penalised argmax. A presence penalty of -2 and a repetition penalty of
        // 0.5 raise the best history id above the row's maximum when they can.
        for (j, (rep, pres)) in [(2.0, 0.5), (0.5, -2.0)].into_iter().enumerate() {
            let p = SamplingParams {
                repetition_penalty: rep,
                presence_penalty: pres,
                frequency_penalty: 0.25,
                ..greedy(700 + j as u64)
            };
            let name = format!(
                "vocab {n}, {touched_distinct} distinct history ids, greedy, rep {rep}, \
                 pres {pres}"
            );
            let c = check(&mut t, &name, &row, &p, &h);
            let want = argmax(c.o.penalised.iter().copied());
            assert_one_hot(&name, &c, want);
        }
    }
    t.finish(90);
}

// ---------------------------------------------------------------------------------------------
// logit_bias, bad_words, min_tokens

/// Step 4 on large rows: a bias lifts the row's lowest token from the bottom to just below the
/// maximum (into every top-k), -100 drops the maximum out, a small bias moves the 60th token
/// just inside the top 50; with few and with thousands of biased ids (sparse and dense paths).
/// A bias of 1e6 acts as 100 (clamped): it makes a low token the argmax, and the distribution
/// is bitwise that of bias 100.
#[test]
fn logit_bias_moves_tokens_across_the_top_k_cut() {
    let mut t = Tally::new("logit_bias");
    for (s, &n) in SIZES.iter().enumerate() {
        // Multiples of 2^-10 and biases that are multiples of 2^-10: every biased logit is
        // exact in f32, so the oracle needs no rounding allowance.
        let row = quantised(&normal_row(800 + s as u64, n, 3.0), 1.0 / 1024.0);
        let order = top_ids(&row, n);
        let (max_id, min_id) = (order[0] as usize, order[n - 1] as usize);
        let lift = f64::from(row[max_id]) - f64::from(row[min_id]) - 0.5;
        // The 60th largest id gets 0.5 above the 50th value: inside the top 50.
        let id60 = order[59] as usize;
        let gap = f64::from(row[order[49] as usize]) - f64::from(row[id60]);
        let few: Vec<(u32, f64)> = vec![
            (min_id as u32, lift),
            (max_id as u32, -100.0),
            (id60 as u32, gap + 0.5),
            (0, 1.5),
            ((n - 1) as u32, -0.75),
        ];
        let mut many = few.clone();
        let mut g = SplitMix(900 + s as u64);
        while many.len() < 3_000 {
            let id = g.below(n as u64) as u32;
            if !many.iter().any(|&(i, _)| i == id) {
                many.push((id, (g.below(129) as f64 - 64.0) / 64.0));
            }
        }
        for (label, bias) in [("5 biased ids", &few), ("3000 biased ids", &many)] {
            let logit_bias: BTreeMap<u32, f64> = bias.iter().copied().collect();
            let biased: Vec<f64> = row
                .iter()
                .enumerate()
                .map(|(i, &l)| f64::from(l) + logit_bias.get(&(i as u32)).copied().unwrap_or(0.0))
                .collect();
            for (j, k) in [50i64, 1, 1000, (n / 16) as i64].into_iter().enumerate() {
                let p = SamplingParams {
                    top_k: k,
                    temperature: TEMPERATURES[(j + s) % 3],
                    logit_bias: logit_bias.clone(),
                    ..seeded(1_100 + j as u64)
                };
                let name = format!("vocab {n}, {label}, top_k {k}, T {}", p.temperature);
                let c = check(&mut t, &name, &row, &p, &Hist::default());
                assert_support_size(&name, &c, k as usize);
                assert_eq!(c.d[max_id], 0.0, "{name}: the lowered maximum");
                if k == 1 {
                    assert_one_hot(&name, &c, argmax(biased.iter().copied()));
                } else {
                    assert!(c.d[min_id] > 0.0, "{name}: the lifted lowest token");
                }
                if k >= 50 && label == "5 biased ids" {
                    assert!(c.d[id60] > 0.0, "{name}: id {id60} raised into the top 50");
                }
            }
            let p = SamplingParams {
                logit_bias: logit_bias.clone(),
                ..greedy(3)
            };
            let name = format!("vocab {n}, {label}, greedy");
            let c = check(&mut t, &name, &row, &p, &Hist::default());
            assert_one_hot(&name, &c, argmax(biased.iter().copied()));
        }
        // Clamping: 1e6 on the second-lowest token is 100, which makes it the argmax.
        let low = order[n - 2] as usize;
        for (j, k) in [0i64, 50, (n / 16) as i64].into_iter().enumerate() {
            let with = |b: f64| SamplingParams {
                top_k: k,
                temperature: [0.0, 2.5, 20.0][j],
                logit_bias: [(low as u32, b), (max_id as u32, -1e9)]
                    .into_iter()
                    .collect(),
                ..seeded(1_200)
            };
            let (p100, p1e6) = (with(100.0), with(1e6));
            let name = format!(
                "vocab {n}, bias 1e6 on id {low}, top_k {k}, T {}",
                p100.temperature
            );
            let c = check(&mut t, &name, &row, &p1e6, &Hist::default());
            let d100 = distribution(&row, &SampleRequest::new(&p100, &[], &[], 0)).unwrap();
            assert!(d100 == c.d, "{name}: bias 1e6 differs from bias 100");
            if j == 0 {
                assert_one_hot(&name, &c, low);
            } else {
                assert_eq!(argmax(c.d.iter().copied()), low, "{name}");
            }
        }
    }
    t.finish(90);
}

/// Step 3 on large rows: a one-token bad word, a three-token bad word whose prefix ends the
/// output, and min_tokens with the maximum and runner-up as stop ids, each banning the row's
/// maximum (and more) under greedy, top-k, top-p and plain sampling; a prefix that does not
/// match and min_tokens reached ban nothing.
#[test]
fn bad_words_and_min_tokens_ban_the_maximum() {
    let mut t = Tally::new("bad_words/min_tokens");
    for (s, &n) in SIZES.iter().enumerate() {
        let row = normal_row(1_200 + s as u64, n, 3.0);
        let order = top_ids(&row, 3);
        let (first, second, third) = (order[0], order[1], order[2]);
        let (a, b) = (17u32, (n - 5) as u32);
        let output = vec![3, 9, a, b];
        let plain_hist = Hist {
            output: output.clone(),
            ..Hist::default()
        };
        let stops_hist = Hist {
            output: output.clone(),
            stops: vec![second, first, 0],
            ..Hist::default()
        };
        type Ban = (&'static str, Vec<Vec<u32>>, usize, bool, Vec<u32>);
        let bans: [Ban; 5] = [
            ("bad word [max]", vec![vec![first]], 0, false, vec![first]),
            (
                "bad word [a, b, max]",
                vec![vec![a, b, first], vec![b, a, second]],
                0,
                false,
                vec![first],
            ),
            (
                "min_tokens 5 with output 4",
                vec![],
                5,
                true,
                vec![first, second, 0],
            ),
            ("min_tokens 4 reached", vec![], 4, true, vec![]),
            (
                "bad words and min_tokens",
                vec![vec![b, third], vec![9, a, b, (n - 1) as u32]],
                100,
                true,
                vec![first, second, third, 0, (n - 1) as u32],
            ),
        ];
        for (what, bad_words, min_tokens, stops, banned) in bans {
            let h = if stops { &stops_hist } else { &plain_hist };
            let base = SamplingParams {
                bad_words,
                min_tokens,
                ..seeded(1_300 + s as u64)
            };
            let params = [
                (
                    "greedy",
                    SamplingParams {
                        temperature: 0.0,
                        ..base.clone()
                    },
                ),
                (
                    "top_k 50",
                    SamplingParams {
                        top_k: 50,
                        temperature: 0.3,
                        ..base.clone()
                    },
                ),
                (
                    "top_p 0.9",
                    SamplingParams {
                        top_p: 0.9,
                        ..base.clone()
                    },
                ),
                (
                    "plain T 2.5",
                    SamplingParams {
                        temperature: 2.5,
                        ..base.clone()
                    },
                ),
            ];
            for (pname, p) in &params {
                let name = format!("vocab {n}, {what}, {pname}");
                let c = check(&mut t, &name, &row, p, h);
                for &id in &banned {
                    assert_eq!(c.d[id as usize], 0.0, "{name}: id {id} is banned");
                }
                if *pname == "greedy" {
                    let want = top_ids(&row, 8)
                        .into_iter()
                        .find(|i| !banned.contains(i))
                        .unwrap();
                    assert_one_hot(&name, &c, want as usize);
                } else if banned.is_empty() {
                    assert!(c.d[first as usize] > 0.0, "{name}: nothing is banned");
                }
            }
        }
    }
    t.finish(90);
}

// ---------------------------------------------------------------------------------------------
// min-p

/// Step 8 on large rows: min_p 0.05, 1e-6 and 1.0 (ties at the maximum spread over blocks are
/// all kept), alone and with top-k and top-p, at three temperatures, on continuous and
/// quantised rows.
#[test]
fn min_p_on_large_rows() {
    let mut t = Tally::new("min_p");
    for (s, &n) in SIZES.iter().enumerate() {
        let cont = normal_row(1_400 + s as u64, n, 3.0);
        let quant = quantised(&cont, 1.0 / 64.0);
        let tie_ids = [0, 31, 32, 511, 512, 4_103, n - 1];
        let mut ties = quant.clone();
        for &i in &tie_ids {
            ties[i] = 30.0;
        }
        for (r, (kind, row)) in [
            ("normal(0,3)", &cont),
            ("quantised 1/64", &quant),
            ("7 ties at the max", &ties),
        ]
        .into_iter()
        .enumerate()
        {
            for (j, min_p) in [0.05, 1e-6, 1.0].into_iter().enumerate() {
                for (extra, top_k, top_p) in [
                    ("alone", 0, 1.0),
                    ("with top_k 1000", 1000, 1.0),
                    ("with top_p 0.9", 0, 0.9),
                ] {
                    let temperature = TEMPERATURES[(s + r + j) % 3];
                    let p = SamplingParams {
                        temperature,
                        min_p,
                        top_k,
                        top_p,
                        ..seeded(1_500 + j as u64)
                    };
                    let name = format!("vocab {n}, {kind}, min_p {min_p} {extra}, T {temperature}");
                    let c = check(&mut t, &name, row, &p, &Hist::default());
                    if min_p == 1.0 {
                        if r == 2 {
                            for &i in &tie_ids {
                                assert_eq!(c.d[i], 1.0 / 7.0, "{name}: id {i}");
                            }
                            assert_eq!(support_size(&c.d), 7, "{name}");
                        } else {
                            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                            let at_max = row.iter().filter(|&&l| l == max).count();
                            assert_eq!(support_size(&c.d), at_max, "{name}");
                        }
                    }
                }
            }
        }
    }
    t.finish(90);
}

// ---------------------------------------------------------------------------------------------
// top-p alone

/// Step 10 without top-k (every weight by the polynomial exp, candidates above a bound from the
/// total mass) on peaked rows and flat rows, p = 0.9, 0.5, 0.999999 and 1e-9. On the equal row
/// the survivors are exactly the ids 0..m with m the least count whose mass m / vocab >= p.
#[test]
fn top_p_alone_on_peaked_and_flat_rows() {
    let mut t = Tally::new("top_p");
    let kinds = [
        "peaked",
        "flat equal",
        "flat normal(0,0.1)",
        "normal(0,3)",
        "spikes over normal(0,1)",
    ];
    for (s, &n) in SIZES.iter().enumerate() {
        for (r, kind) in kinds.iter().enumerate() {
            let row = row_kind(kind, 1_600 + s as u64, n);
            for (j, top_p) in [0.9, 0.5, 0.999_999, 1e-9].into_iter().enumerate() {
                for (ti, temperature) in TEMPERATURES.into_iter().enumerate() {
                    // All three temperatures on the peaked rows; T = 0.3 on the spikes; one,
                    // rotating, elsewhere.
                    let wanted = match *kind {
                        "peaked" => true,
                        "spikes over normal(0,1)" => ti == 0,
                        _ => ti == (s + r + j) % 3,
                    };
                    if !wanted {
                        continue;
                    }
                    let p = SamplingParams {
                        temperature,
                        top_p,
                        ..seeded(1_700 + j as u64)
                    };
                    let name = format!("vocab {n}, {kind}, top_p {top_p}, T {temperature}");
                    let c = if *kind == "flat equal" {
                        // Expected here: the oracle's near-tie check is quadratic in a tie of
                        // the whole row.
                        let m = (1..=n).find(|&m| m as f64 / n as f64 >= top_p).unwrap();
                        let near = |m: usize| (m as f64 / n as f64 - top_p).abs() <= 1e-6 * top_p;
                        let first: Vec<usize> = (0..m).collect();
                        let mut o = uniform(&row, &first);
                        o.fragile = near(m) || near(m - 1);
                        let c = check_against(&mut t, &name, &row, &p, &Hist::default(), o);
                        if !c.o.fragile {
                            for (i, &x) in c.d.iter().enumerate() {
                                let want = if i < m { 1.0 / m as f64 } else { 0.0 };
                                assert!(
                                    (x - want).abs() <= 1e-15,
                                    "{name}: id {i}: {x}, want {want} (m = {m})"
                                );
                            }
                        }
                        c
                    } else {
                        check(&mut t, &name, &row, &p, &Hist::default())
                    };
                    if top_p == 1e-9 && *kind != "flat equal" {
                        let want = top_ids(&row, 1)[0] as usize;
                        assert_one_hot(&name, &c, want);
                    }
                    if *kind == "spikes over normal(0,1)" {
                        // Masses 0.9643, 0.0344, 0.0012 and less than 1e-12 for the rest.
                        let kept = if top_p == 0.999_999 {
                            vec![n - 1, 8_191, 32]
                        } else {
                            vec![n - 1]
                        };
                        assert!(!c.o.fragile, "{name}");
                        assert_eq!(support_size(&c.d), kept.len(), "{name}");
                        assert!(kept.iter().all(|&i| c.d[i] > 0.0), "{name}");
                    }
                }
            }
        }
    }
    t.finish(75);
}

// ---------------------------------------------------------------------------------------------
// Plain temperature sampling

/// Steps 7 and 11 alone: softmax at T = 0.3, 1 and 2.5 over the whole row.
#[test]
fn plain_temperature_sampling_on_large_rows() {
    let mut t = Tally::new("temperature");
    let kinds = [
        "normal(0,3)",
        "peaked",
        "quantised 1/4",
        "flat normal(0,0.1)",
        "ascending",
    ];
    for (s, &n) in SIZES.iter().enumerate() {
        for kind in kinds {
            let row = row_kind(kind, 1_800 + s as u64, n);
            for (j, temperature) in TEMPERATURES.into_iter().enumerate() {
                let p = SamplingParams {
                    temperature,
                    ..seeded(1_900 + j as u64 + 10 * s as u64)
                };
                let name = format!("vocab {n}, {kind}, T {temperature}");
                let c = check(&mut t, &name, &row, &p, &Hist::default());
                assert_support_size(&name, &c, n);
            }
        }
    }
    t.finish(100);
}

// ---------------------------------------------------------------------------------------------
// -inf

/// Rows that are -inf except a few ids at run, block and chunk boundaries and the last id:
/// masked ids stay at 0 under every filter, penalty and bias; one finite id is one-hot; none
/// is NoCandidates, also when allowed_token_ids or bad words leave only -inf ids.
#[test]
fn rows_of_mostly_neg_inf() {
    let mut t = Tally::new("-inf rows");
    for &n in &SIZES {
        let finite = [0, 31, 32, 511, 512, 8_191, 8_192, n - 1];
        let values = [1.5f32, -2.0, 3.25, 0.5, 3.25, -7.0, 2.0, 0.75];
        let mut row = vec![f32::NEG_INFINITY; n];
        for (&i, &v) in finite.iter().zip(&values) {
            row[i] = v;
        }
        let h = Hist {
            prompt: vec![31, 100, 511, 8_192],
            output: vec![0, 0, 4_000, (n - 2) as u32, 32],
            stops: vec![],
        };
        let empty = Hist::default();
        let cases: Vec<(&str, SamplingParams, &Hist)> = vec![
            ("greedy", greedy(1), &empty),
            (
                "top_k 1",
                SamplingParams {
                    top_k: 1,
                    ..seeded(2)
                },
                &empty,
            ),
            (
                "top_k 3",
                SamplingParams {
                    top_k: 3,
                    ..seeded(3)
                },
                &empty,
            ),
            (
                "top_k 8",
                SamplingParams {
                    top_k: 8,
                    ..seeded(4)
                },
                &empty,
            ),
            (
                "top_k 50",
                SamplingParams {
                    top_k: 50,
                    ..seeded(5)
                },
                &empty,
            ),
            (
                "top_p 0.5",
                SamplingParams {
                    top_p: 0.5,
                    ..seeded(6)
                },
                &empty,
            ),
            (
                "top_p 0.9 T 2.5",
                SamplingParams {
                    top_p: 0.9,
                    temperature: 2.5,
                    ..seeded(7)
                },
                &empty,
            ),
            (
                "min_p 0.1",
                SamplingParams {
                    min_p: 0.1,
                    ..seeded(8)
                },
                &empty,
            ),
            (
                "plain T 0.3",
                SamplingParams {
                    temperature: 0.3,
                    ..seeded(9)
                },
                &empty,
            ),
            (
                "penalties on finite and -inf ids, top_k 4",
                SamplingParams {
                    top_k: 4,
                    repetition_penalty: 2.0,
                    presence_penalty: -2.0,
                    frequency_penalty: -1.0,
                    ..seeded(10)
                },
                &h,
            ),
            (
                "bias +100 on -inf ids",
                SamplingParams {
                    logit_bias: [
                        (1u32, 100.0),
                        (4_000, 100.0),
                        ((n - 2) as u32, 50.0),
                        (31, 5.0),
                    ]
                    .into_iter()
                    .collect(),
                    ..seeded(11)
                },
                &empty,
            ),
            (
                "allowed ids mixing finite and -inf",
                SamplingParams {
                    allowed_token_ids: Some(vec![1, 2, 31, 512, (n - 1) as u32, (n - 2) as u32]),
                    top_k: 2,
                    ..seeded(12)
                },
                &empty,
            ),
        ];
        for (what, p, h) in &cases {
            let name = format!("vocab {n}, 8 finite ids, {what}");
            let c = check(&mut t, &name, &row, p, h);
            for (i, &x) in c.d.iter().enumerate() {
                if row[i] == f32::NEG_INFINITY {
                    assert_eq!(x, 0.0, "{name}: masked id {i}");
                }
            }
            if *what == "greedy" || *what == "top_k 1" {
                assert_one_hot(&name, &c, 32);
            }
        }
        // One finite id, in the last run.
        let mut one = vec![f32::NEG_INFINITY; n];
        one[n - 1] = -1e4;
        for (what, p) in [
            ("greedy", greedy(1)),
            (
                "top_p 0.5 min_p 0.9",
                SamplingParams {
                    top_p: 0.5,
                    min_p: 0.9,
                    ..seeded(2)
                },
            ),
            (
                "top_k 1000",
                SamplingParams {
                    top_k: 1000,
                    ..seeded(3)
                },
            ),
        ] {
            let name = format!("vocab {n}, one finite id at vocab-1, {what}");
            let c = check(&mut t, &name, &one, &p, &Hist::default());
            assert_one_hot(&name, &c, n - 1);
        }
        // Nothing left: NoCandidates.
        let all = vec![f32::NEG_INFINITY; n];
        let nothing: [(&str, &[f32], SamplingParams, Hist); 4] = [
            ("all -inf, greedy", &all, greedy(1), Hist::default()),
            (
                "all -inf, top_k 5",
                &all,
                SamplingParams {
                    top_k: 5,
                    ..seeded(1)
                },
                Hist::default(),
            ),
            (
                "allowed ids all -inf",
                &row,
                SamplingParams {
                    allowed_token_ids: Some(vec![1, 30, 33, 513, (n - 3) as u32]),
                    top_p: 0.9,
                    ..seeded(1)
                },
                Hist::default(),
            ),
            (
                "bad words and min_tokens ban every finite id",
                &row,
                SamplingParams {
                    bad_words: finite[..6].iter().map(|&i| vec![i as u32]).collect(),
                    min_tokens: 1,
                    logit_bias: [(1u32, 100.0)].into_iter().collect(),
                    ..seeded(1)
                },
                Hist {
                    stops: vec![8_192, (n - 1) as u32],
                    ..Hist::default()
                },
            ),
        ];
        for (what, r, p, h) in &nothing {
            assert_eq!(
                oracle_with_stops(r, p, &h.prompt, &h.output, &h.stops).unwrap_err(),
                OracleError::NoCandidates,
                "{what}"
            );
            assert_eq!(
                distribution(r, &h.request(p, 0, 0)),
                Err(SampleError::NoCandidates),
                "vocab {n}, {what}"
            );
            assert_eq!(
                sample_row(r, &h.request(p, 9, 0)),
                Err(SampleError::NoCandidates),
                "vocab {n}, {what}"
            );
        }
    }
    t.finish(95);
}

// ---------------------------------------------------------------------------------------------
// |max| > 1e30

/// Without penalties or bias, steps 6-11 depend only on the order of the logits and on
/// x_i = (l_i - max) / T. For a row of huge logits the oracle's rounding allowances (relative
/// to |l|) call every pair of neighbours a near-tie, although `l - max` is exact there. The
/// surrogate row holds x_i itself (f64, then f32; below -1e4, where every weight is 0,
/// clamped to -1e4; -inf kept) at temperature 1 (greedy stays greedy): the same order, the same
/// weights, magnitudes at which the allowances mean what they should.
fn surrogate(row: &[f32], p: &SamplingParams) -> (Vec<f32>, SamplingParams) {
    let max = f64::from(row.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let t = if p.is_greedy() { 1.0 } else { p.temperature };
    let row2 = row
        .iter()
        .map(|&l| {
            if l == f32::NEG_INFINITY {
                l
            } else {
                ((f64::from(l) - max) / t).max(-1e4) as f32
            }
        })
        .collect();
    let p2 = SamplingParams {
        temperature: if p.is_greedy() { p.temperature } else { 1.0 },
        ..p.clone()
    };
    (row2, p2)
}

/// Logits near ±3e38 (the exact fallback): at T = 1e38 the differences are O(1) in exact
/// arithmetic although `l - max` overflows f32; at T = 1 only the ties at the maximum keep any
/// weight; rows near -f32::MAX differ by ulps of 2^104.
#[test]
fn huge_logits_take_the_exact_fallback() {
    let mut t = Tally::new("huge logits");
    for (s, &n) in [32_000usize, 151_936].iter().enumerate() {
        let mut g = SplitMix(2_000 + s as u64);
        // (a) normal(0, 1) * 1e38, clamped to ±3.3e38, with 3e38 at two ids.
        let mut wide: Vec<f32> = (0..n)
            .map(|_| (g.normal() * 1e38).clamp(-3.3e38, 3.3e38) as f32)
            .collect();
        for i in [512, 777] {
            wide[i] = 3.35e38;
        }
        // (b) -f32::MAX plus 0..64 ulps.
        let low: Vec<f32> = (0..n)
            .map(|_| -f32::from_bits(f32::MAX.to_bits() - g.below(64) as u32))
            .collect();
        // (c) ±3e38 and ordinary values: the maxima (ties at 31, 8192, n-1) take everything.
        let mut mixed = normal_row(2_100 + s as u64, n, 3.0);
        for i in (0..n).step_by(97) {
            mixed[i] = -3e38;
        }
        for i in [31, 8_192, n - 1] {
            mixed[i] = 3e38;
        }
        // (d) one logit at 2e30, just above the fallback's bound, the rest ordinary.
        let mut just = normal_row(2_200 + s as u64, n, 3.0);
        just[n / 3] = 2e30;
        // (kind, row, temperature, compare with the oracle on the surrogate row)
        let rows: [(&str, &[f32], f64, bool); 6] = [
            ("normal * 1e38, T 1e38", &wide, 1e38, false),
            ("normal * 1e38, T 3e38", &wide, 3e38, false),
            ("-f32::MAX + ulps, T 1e32", &low, 1e32, true),
            ("-f32::MAX + ulps, T 1", &low, 1.0, false),
            ("±3e38 and ordinary, T 1", &mixed, 1.0, false),
            ("one 2e30, T 1", &just, 1.0, false),
        ];
        let top_level: Vec<usize> = {
            let max = low.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            (0..n).filter(|&i| low[i] == max).collect()
        };
        for (kind, row, temperature, use_surrogate) in rows {
            let params = [
                (
                    "plain",
                    SamplingParams {
                        temperature,
                        ..seeded(1)
                    },
                ),
                (
                    "top_k 50",
                    SamplingParams {
                        temperature,
                        top_k: 50,
                        ..seeded(2)
                    },
                ),
                (
                    "top_p 0.9",
                    SamplingParams {
                        temperature,
                        top_p: 0.9,
                        ..seeded(3)
                    },
                ),
                (
                    "min_p 0.05",
                    SamplingParams {
                        temperature,
                        min_p: 0.05,
                        ..seeded(4)
                    },
                ),
                ("greedy", greedy(5)),
            ];
            for (pname, p) in &params {
                let name = format!("vocab {n}, {kind}, {pname}");
                // At T = 1 the last three rows put all the weight on the ties at the maximum
                // (every other weight is exp(-2^104) or less): expected values from here, as
                // those rows are ties of 10^5 ids for the oracle.
                let maxima: &[usize] = match kind {
                    "-f32::MAX + ulps, T 1" => &top_level,
                    "±3e38 and ordinary, T 1" => &[31, 8_192, n - 1],
                    "one 2e30, T 1" => &[n / 3],
                    _ => &[],
                };
                let c = if use_surrogate {
                    let (row2, p2) = surrogate(row, p);
                    let o = oracle_with_stops(&row2, &p2, &[], &[], &[])
                        .unwrap_or_else(|e| panic!("{name}: oracle: {e:?}"));
                    check_against(&mut t, &name, row, p, &Hist::default(), o)
                } else if !maxima.is_empty() {
                    let c = maxima.len();
                    let kept = match *pname {
                        "greedy" => 1,
                        "top_k 50" => c.min(50),
                        "top_p 0.9" => (1..=c).find(|&m| m as f64 / c as f64 >= 0.9).unwrap(),
                        _ => c,
                    };
                    let o = if p.is_greedy() {
                        one_hot(row, maxima[0], true)
                    } else {
                        uniform(row, &maxima[..kept])
                    };
                    check_against(&mut t, &name, row, p, &Hist::default(), o)
                } else {
                    check(&mut t, &name, row, p, &Hist::default())
                };
                match (kind, *pname) {
                    (_, "greedy") => {
                        let want = top_ids(row, 1)[0] as usize;
                        assert_one_hot(&name, &c, want);
                    }
                    ("±3e38 and ordinary, T 1", _) => {
                        for i in [31, 8_192, n - 1] {
                            assert_eq!(c.d[i], 1.0 / 3.0, "{name}: id {i}");
                        }
                    }
                    ("one 2e30, T 1", _) => assert_one_hot(&name, &c, n / 3),
                    ("-f32::MAX + ulps, T 1", "top_k 50") => {
                        let d = uniform(row, &top_level[..50]).probs;
                        assert!(c.d == d, "{name}: want the first 50 ids of the top level");
                    }
                    _ => {}
                }
            }
        }
    }
    t.finish(90);
}

// ---------------------------------------------------------------------------------------------
// NaN and +inf

/// The id and value of a `NonFiniteLogits` error, if `r` is one.
fn non_finite(r: &Result<SampleOutput, SampleError>) -> Option<(usize, f32)> {
    match r {
        Err(SampleError::NonFiniteLogits { token_id, value }) => Some((*token_id as usize, *value)),
        _ => None,
    }
}

/// Step 1 on large rows: a NaN (quiet, negative, signalling) or +inf below vocab_size is an
/// error naming the lowest such id, wherever it lies (id 0, run and block and chunk boundaries,
/// the last runs), under every path (greedy, top-k, top-p, min-p, sparse penalties), also when
/// the id is masked by allowed_token_ids or banned, and when the rest of the row is -inf.
#[test]
fn non_finite_logits_are_errors_wherever_they_lie() {
    let started = Instant::now();
    let bad_values = [
        f32::NAN,
        f32::INFINITY,
        f32::from_bits(0xFFC0_0000), // negative quiet NaN
        f32::from_bits(0x7F80_0001), // signalling NaN
        f32::from_bits(0xFFFF_FFFF),
    ];
    let mut calls = 0;
    for (s, &n) in [8_193usize, 50_257, 151_936].iter().enumerate() {
        let base = normal_row(2_300 + s as u64, n, 3.0);
        let mut neg = vec![f32::NEG_INFINITY; n];
        neg[n / 2] = 1.0;
        let positions = [
            0,
            1,
            31,
            32,
            511,
            512,
            8_191,
            8_192,
            n - 33,
            n - 32,
            n - 17,
            n - 2,
            n - 1,
        ];
        let h = Hist {
            prompt: vec![5, 6, 7],
            output: vec![8, 9],
            stops: vec![],
        };
        for (pi, &pos) in positions.iter().enumerate() {
            let bad = bad_values[pi % bad_values.len()];
            let others: Vec<u32> = [3u32, 40, (n / 2) as u32]
                .into_iter()
                .filter(|&i| i as usize != pos)
                .collect();
            let params = [
                ("greedy", greedy(1)),
                (
                    "top_k 50",
                    SamplingParams {
                        top_k: 50,
                        ..seeded(2)
                    },
                ),
                (
                    "top_p 0.9",
                    SamplingParams {
                        top_p: 0.9,
                        ..seeded(3)
                    },
                ),
                (
                    "min_p 0.1",
                    SamplingParams {
                        min_p: 0.1,
                        ..seeded(4)
                    },
                ),
                ("plain", seeded(5)),
                (
                    "penalties, bias, top_k 20",
                    SamplingParams {
                        top_k: 20,
                        repetition_penalty: 1.5,
                        presence_penalty: 1.0,
                        logit_bias: [(pos as u32, -100.0)].into_iter().collect(),
                        ..seeded(6)
                    },
                ),
                (
                    "id masked by allowed_token_ids",
                    SamplingParams {
                        allowed_token_ids: Some(others.clone()),
                        ..seeded(7)
                    },
                ),
                (
                    "id banned by a bad word, greedy",
                    SamplingParams {
                        bad_words: vec![vec![pos as u32]],
                        ..greedy(8)
                    },
                ),
            ];
            for (rname, r) in [("normal row", &base), ("-inf row", &neg)] {
                let mut row = r.clone();
                row[pos] = bad;
                // A second bad value later in the row does not change the reported id.
                let mut two = row.clone();
                two[(pos + 4_099) % n] = f32::NAN;
                if (pos + 4_099) % n < pos {
                    two[(pos + 4_099) % n] = r[(pos + 4_099) % n];
                }
                for (pname, p) in &params {
                    for (variant, row) in [("one", &row), ("two", &two)] {
                        let name =
                            format!("vocab {n}, {rname}, {bad:?} at {pos} ({variant}), {pname}");
                        let req = h.request(p, 11, 0);
                        for got in [
                            distribution(row, &req).map(|_| ()),
                            sample_row(row, &req).map(|_| ()),
                        ] {
                            calls += 1;
                            match got {
                                Err(SampleError::NonFiniteLogits { token_id, value }) => {
                                    assert_eq!(token_id as usize, pos, "{name}");
                                    assert!(
                                        value.to_bits() == bad.to_bits()
                                            || (value.is_nan() && bad.is_nan()),
                                        "{name}: value {value:?}"
                                    );
                                }
                                other => panic!("{name}: expected NonFiniteLogits, got {other:?}"),
                            }
                        }
                    }
                }
            }
        }
        // In a batch, the bad rows fail alone.
        let mut bad_row = base.clone();
        bad_row[n - 1] = f32::NAN;
        let mut data = base.clone();
        data.extend_from_slice(&bad_row);
        data.extend_from_slice(&base);
        let view = LogitsView::dense(&data, 3, n).unwrap();
        let p = SamplingParams {
            top_k: 50,
            ..seeded(42)
        };
        let e = Hist::default();
        let out = sample_batch(
            &view,
            &[
                e.request(&p, 3, 0),
                e.request(&p, 3, 0),
                e.request(&p, 3, 0),
            ],
        )
        .unwrap();
        let alone = sample_row(&base, &e.request(&p, 3, 0)).unwrap();
        assert_eq!(out[0].as_ref().unwrap(), &alone);
        assert_eq!(out[2].as_ref().unwrap(), &alone);
        assert_eq!(
            non_finite(&out[1]).map(|e| e.0),
            Some(n - 1),
            "{:?}",
            out[1]
        );
    }
    eprintln!("non-finite: {calls} calls, {:.2?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------------
// f16 / bf16 rows and padded rows through LogitsView + sample_batch

/// Checks every row of a batch: `sample_batch` equals `sample_row` on the widened row (the
/// vocab part), bitwise, and the widened row passes `check` against the oracle.
fn check_batch<T: nucleus_sampling::LogitValue>(
    t: &mut Tally,
    label: &str,
    view: &LogitsView<'_, T>,
    widened: &[Vec<f32>],
    params: &[SamplingParams],
) {
    let h = Hist::default();
    let requests: Vec<SampleRequest<'_>> = params
        .iter()
        .enumerate()
        .map(|(i, p)| h.request(p, DRAWS[i % 3].0, DRAWS[i % 3].1))
        .collect();
    let out = sample_batch(view, &requests).unwrap();
    for (i, ((got, row), req)) in out.iter().zip(widened).zip(&requests).enumerate() {
        let name = format!("{label}, row {i}, {:?}", params[i]);
        assert_eq!(row.len(), view.vocab_size());
        let want = sample_row(row, req);
        assert_eq!(
            got, &want,
            "{name}: sample_batch differs from sample_row on the widened row"
        );
        let c = check(t, &name, row, &params[i], &h);
        assert_eq!(got.as_ref().unwrap().token, c.tokens[i % 3], "{name}");
    }
}

fn batch_params() -> Vec<SamplingParams> {
    vec![
        greedy(1),
        SamplingParams {
            top_k: 50,
            temperature: 0.7,
            ..seeded(2)
        },
        SamplingParams {
            top_p: 0.9,
            ..seeded(3)
        },
        SamplingParams {
            min_p: 0.05,
            temperature: 1.5,
            ..seeded(4)
        },
        SamplingParams {
            temperature: 1.0,
            ..seeded(5)
        },
        SamplingParams {
            top_k: 1000,
            top_p: 0.8,
            temperature: 2.5,
            ..seeded(6)
        },
    ]
}

/// f16 and bf16 rows (many exact ties after rounding; -inf entries; huge bf16 values that take
/// the exact fallback) through `LogitsView` and `sample_batch`.
#[test]
fn f16_and_bf16_rows_through_sample_batch() {
    let mut t = Tally::new("f16/bf16");
    let params = batch_params();
    for (s, &n) in [32_000usize, 50_257, 151_936].iter().enumerate() {
        let rows: Vec<Vec<f32>> = (0..params.len())
            .map(|i| {
                let mut r = normal_row(2_400 + 10 * s as u64 + i as u64, n, 3.0);
                for j in (i..n).step_by(61) {
                    r[j] = f32::NEG_INFINITY;
                }
                r
            })
            .collect();
        // f16: rounding to 11 significant bits makes ties at the cuts.
        let data: Vec<f16> = rows.iter().flatten().map(|&x| f16::from_f32(x)).collect();
        let widened: Vec<Vec<f32>> = data
            .chunks(n)
            .map(|r| r.iter().map(|x| x.to_f32()).collect())
            .collect();
        let view = LogitsView::dense(&data, params.len(), n).unwrap();
        check_batch(&mut t, &format!("f16, vocab {n}"), &view, &widened, &params);
        // bf16: ordinary rows and rows scaled by 1e37 (|max| > 1e30), at T = 1e38.
        let mut huge_params = params.clone();
        for (i, p) in huge_params.iter_mut().enumerate() {
            if i % 2 == 1 && !p.is_greedy() {
                p.temperature = 1e38;
            }
        }
        let data: Vec<bf16> = rows
            .iter()
            .enumerate()
            .flat_map(|(i, r)| {
                let scale = if i % 2 == 1 { 1e37 } else { 1.0 };
                r.iter().map(move |&x| bf16::from_f32(x * scale))
            })
            .collect();
        let widened: Vec<Vec<f32>> = data
            .chunks(n)
            .map(|r| r.iter().map(|x| x.to_f32()).collect())
            .collect();
        let view = LogitsView::dense(&data, params.len(), n).unwrap();
        check_batch(
            &mut t,
            &format!("bf16, vocab {n}"),
            &view,
            &widened,
            &huge_params,
        );
    }
    // An f16 NaN and an f16 +inf row beside healthy rows.
    let n = 50_257;
    let healthy: Vec<f16> = normal_row(2_500, n, 3.0)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let mut data = healthy.clone();
    let mut nan = healthy.clone();
    nan[512] = f16::NAN;
    let mut inf = healthy.clone();
    inf[n - 1] = f16::INFINITY;
    data.extend(nan);
    data.extend(inf);
    let view = LogitsView::dense(&data, 3, n).unwrap();
    let p = SamplingParams {
        top_p: 0.9,
        ..seeded(8)
    };
    let h = Hist::default();
    let out = sample_batch(
        &view,
        &[
            h.request(&p, 1, 0),
            h.request(&p, 1, 0),
            h.request(&p, 1, 0),
        ],
    )
    .unwrap();
    assert!(out[0].is_ok());
    let (id, value) = non_finite(&out[1]).expect("NonFiniteLogits");
    assert!(id == 512 && value.is_nan(), "{:?}", out[1]);
    assert_eq!(
        non_finite(&out[2]),
        Some((n - 1, f32::INFINITY)),
        "{:?}",
        out[2]
    );
    t.finish(90);
}

/// Padded rows: row_len 151,936 for a 151,665-token vocabulary, padding of NaN, +inf and values
/// above every logit, and a row stride with more junk between rows. The padding is never a
/// candidate, never an error and never the maximum: the batch equals `sample_row` on the
/// vocab part. A NaN at vocab_size - 1 is still an error.
#[test]
fn padded_rows_ignore_the_padding() {
    let mut t = Tally::new("padded");
    let (vocab, row_len) = (151_665usize, 151_936usize);
    let params = batch_params();
    let fills = [
        f32::NAN,
        f32::INFINITY,
        3e38,
        f32::MAX,
        1e4,
        f32::from_bits(0xFFC0_0001),
    ];
    for (stride, label) in [
        (row_len, "stride = row_len"),
        (row_len + 128, "stride = row_len + 128"),
    ] {
        let mut data = vec![f32::NAN; stride * (params.len() - 1) + row_len];
        let mut widened = Vec::new();
        for i in 0..params.len() {
            let mut r = if i % 2 == 0 {
                normal_row(2_600 + i as u64, vocab, 3.0)
            } else {
                peaked_row(2_600 + i as u64, vocab)
            };
            if i == 3 {
                r[vocab - 1] = 25.0; // the maximum in the last vocab id, next to the padding
            }
            let start = i * stride;
            data[start..start + vocab].copy_from_slice(&r);
            for (j, x) in data[start + vocab..start + row_len].iter_mut().enumerate() {
                *x = fills[(i + j) % fills.len()];
            }
            widened.push(r);
        }
        let view = LogitsView::new(&data, params.len(), row_len, stride, vocab).unwrap();
        check_batch(
            &mut t,
            &format!("f32 padded, {label}"),
            &view,
            &widened,
            &params,
        );
        // The same in f16 (padding of f16 NaN, +inf and 65504).
        let data16: Vec<f16> = data.iter().map(|&x| f16::from_f32(x)).collect();
        let widened16: Vec<Vec<f32>> = widened
            .iter()
            .map(|r| r.iter().map(|&x| f16::from_f32(x).to_f32()).collect())
            .collect();
        let view = LogitsView::new(&data16, params.len(), row_len, stride, vocab).unwrap();
        check_batch(
            &mut t,
            &format!("f16 padded, {label}"),
            &view,
            &widened16,
            &params,
        );
    }
    // A NaN at vocab_size - 1 is an error; at vocab_size it is padding.
    let mut data = normal_row(2_700, row_len, 3.0);
    data.extend(normal_row(2_701, row_len, 3.0));
    data[vocab - 1] = f32::NAN;
    data[row_len + vocab] = f32::NAN;
    let view = LogitsView::new(&data, 2, row_len, row_len, vocab).unwrap();
    let p = greedy(1);
    let h = Hist::default();
    let out = sample_batch(&view, &[h.request(&p, 0, 0), h.request(&p, 0, 0)]).unwrap();
    assert_eq!(
        non_finite(&out[0]).map(|e| e.0),
        Some(vocab - 1),
        "{:?}",
        out[0]
    );
    let want = top_ids(&data[row_len..row_len + vocab], 1)[0];
    assert_eq!(out[1].as_ref().unwrap().token, want);
    t.finish(90);
}

// ---------------------------------------------------------------------------------------------
// Exact boundaries with probability input

/// Probability input (spec "Inputs"; exact boundaries are tested with dyadic probabilities) on
/// large rows: a top-p prefix that reaches p exactly takes nothing more, min-p keeps the ties
/// with its threshold, top-k keeps the lowest ids of a tie, and every draw is the inverse CDF.
#[test]
fn exact_boundaries_with_probability_input() {
    let mut cases: Vec<(String, Vec<f32>, SamplingParams, Vec<f64>)> = Vec::new();
    for &n in &[32_000usize, 32_768, 151_936] {
        // The spec's worked case [0.25, 0.125, 0.125, 0.5], top_p 0.75, spread over the row.
        let mut probs = vec![0.0f32; n];
        for (id, w) in [(7, 0.25), (100, 0.125), (9_000, 0.125), (n - 1, 0.5)] {
            probs[id] = w;
        }
        let mut want = vec![0.0; n];
        want[7] = 1.0 / 3.0;
        want[n - 1] = 2.0 / 3.0;
        let p = SamplingParams {
            top_p: 0.75,
            ..seeded(40)
        };
        cases.push((
            format!("vocab {n}, worked case, top_p 0.75"),
            probs,
            p,
            want,
        ));
        // Equal weights: top_p 0.5 is reached exactly by the first half.
        let m = n / 2;
        let want: Vec<f64> = (0..n)
            .map(|i| if i < m { 1.0 / m as f64 } else { 0.0 })
            .collect();
        let p = SamplingParams {
            top_p: 0.5,
            ..seeded(41)
        };
        cases.push((
            format!("vocab {n}, equal weights, top_p 0.5"),
            vec![1.0; n],
            p,
            want,
        ));
        // Min-p 0.25 keeps the ties with the threshold (4 ids at 1, 10 at 0.25, the rest 0.125).
        let mut probs = vec![0.125f32; n];
        let top = [0, 511, 8_192, n - 1];
        let at = [
            31,
            32,
            512,
            4_000,
            8_191,
            n / 2,
            n - 33,
            n - 32,
            n - 3,
            n - 2,
        ];
        top.iter().for_each(|&i| probs[i] = 1.0);
        at.iter().for_each(|&i| probs[i] = 0.25);
        let mut want = vec![0.0; n];
        top.iter().for_each(|&i| want[i] = 1.0 / 6.5);
        at.iter().for_each(|&i| want[i] = 0.25 / 6.5);
        let p = SamplingParams {
            min_p: 0.25,
            ..seeded(42)
        };
        cases.push((
            format!("vocab {n}, ties at the min-p threshold"),
            probs,
            p,
            want,
        ));
        // Top-k 1000 in a tie of every 5th id.
        let probs: Vec<f32> = (0..n)
            .map(|i| if i % 5 == 0 { 0.5 } else { 0.25 })
            .collect();
        let want: Vec<f64> = (0..n)
            .map(|i| if i % 5 == 0 && i < 5_000 { 1e-3 } else { 0.0 })
            .collect();
        let p = SamplingParams {
            top_k: 1000,
            ..seeded(43)
        };
        cases.push((format!("vocab {n}, top_k 1000 in a tie"), probs, p, want));
    }
    for (name, probs, p, want) in &cases {
        let d = distribution_from_probs(probs, &SampleRequest::new(p, &[], &[], 0))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (i, (&g, &w)) in d.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-12 && (g > 0.0) == (w > 0.0),
                "{name}: id {i}: {g}, want {w}"
            );
        }
        for (pos, idx) in DRAWS {
            let req = SampleRequest::new(p, &[], &[], pos).with_sample_index(idx);
            let s = sample_row_from_probs(probs, &req).unwrap_or_else(|e| panic!("{name}: {e}"));
            let u = spec_uniform(p.seed.unwrap(), pos, idx);
            assert_eq!(s.num_candidates, support_size(want), "{name}");
            if let Some(tok) = inverse_cdf(want, u, 1e-9) {
                assert_eq!(s.token, tok, "{name}: u = {u}");
            }
            assert!(
                (s.logprob - want[s.token as usize].ln()).abs() <= 1e-9,
                "{name}"
            );
        }
    }
}
