//! `nucleus bench moe`: nucleus-moe's `moe_init_routing` and `moe_token_unpermute` against a
//! straightforward reference ([`reference`](mod@reference)) and memory floors, on the same data
//! in one run (DESIGN.md: speed as ratios against named baselines in one run).
//!
//! Data, per shape (N tokens, H hidden, K experts per token, E experts), from a fixed seed:
//! `x [N, H]` normal(0, 1) rounded to the element type (bf16 by default, DeepSeek-V3's
//! activation type); `expert_idx [N, K]`, K distinct experts per token drawn uniformly from
//! `0..E`; `weights [N, K]` positive, summing to 1 per token. The expert output that unpermute
//! combines is `expanded_x` itself (the identity expert), so it gives `x` back (checked).
//! Init routing runs dropless with the gather index and count `expert_tokens`, without
//! quantisation and with dynamic int8 (quant_mode 1, no smooth scale: the Ascend DeepSeek
//! configuration).
//!
//! What is timed ([`Job`]):
//! - nucleus: `moe_init_routing_into` writing into buffers reused from call to call (how an
//!   engine calls it), the allocating `moe_init_routing`, `moe_init_routing_into` with dynamic
//!   int8, and `moe_token_unpermute` (which returns a new `[N, H]` vector);
//! - the reference, on the same reused buffers (the unpermute reference allocates its output,
//!   as the operator does);
//! - the floors: init, the bytes of `expanded_x` (`N*K*H` elements) written once into a
//!   preallocated buffer by memcpy, each row of `x` copied to K consecutive rows (so `x` is
//!   read once and `expanded_x` written once: the operation's traffic without the
//!   permutation); int8, the same with an int8 copy of `x` (`N*K*H` bytes written); unpermute,
//!   one sequential read of `expert_out` (`N*K*H` elements, XOR-folding each token's K rows)
//!   and one write of the preallocated `out` (`N*H` elements). Floors split their work over
//!   the rayon pool's threads once it passes 1 MiB (the operator's own threshold); with more
//!   than one thread each floor is also timed on one thread and the faster counts (two threads
//!   lost to one at 256 KiB on the 2-core machine).
//!
//! Before timing, the reference and nucleus must agree exactly (every output). Every method
//! runs in the same rayon pool (nucleus-moe's own parallelism; the reference uses one thread).
//! The measurements of one shape are interleaved ([`median_us`]); shapes run one
//! after another, each shape's buffers freed before the next (N = 4,096, K = 8, H = 7,168 bf16
//! is 470 MB per `expanded_x`: `expert_out` and one shared destination are kept, plus what an
//! allocating call takes for itself). Times are µs per call, the median over the timed rounds.

pub mod reference;

use std::cell::{Cell, RefCell};
use std::ops::BitXor;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use half::{bf16, f16};
use nucleus_moe::{
    moe_init_routing, moe_init_routing_into, moe_token_unpermute, ExpandedX, ExpertTokensNumType,
    FloatElement, MoeInitRoutingAttrs, MoeInitRoutingInput, MoeInitRoutingOutput, QuantMode,
};
use rayon::prelude::*;

use super::sampling::workload::{SplitMix64, DEFAULT_SEED};
use super::sampling::{check_runs, interleaved_medians};
use crate::ParamError;
use crate::{reserve, try_collect};

/// What `nucleus bench moe` measures: every shape of `rows` x `hidden` (hidden-major), each
/// with `k` of `experts` experts per token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Tokens per call, N (at least one value; each at least 1).
    pub rows: Vec<usize>,
    /// Hidden sizes, H (at least one value; each at least 1).
    pub hidden: Vec<usize>,
    /// Experts per token, K (at least 1, at most `experts`).
    pub k: usize,
    /// Experts, E (`1..=10240`).
    pub experts: usize,
    /// Element type of x and of the expert outputs.
    pub dtype: MoeDtype,
    /// Threads of the rayon pool that every method runs in (at least 1).
    pub threads: usize,
    /// Timed runs per measurement (`None`: at least [`AUTO_MIN_RUNS`](crate::sampling::AUTO_MIN_RUNS), more within
    /// [`AUTO_BUDGET`](crate::sampling::AUTO_BUDGET) each); µs are medians.
    pub iters: Option<usize>,
}

/// The element type of x and of the expert outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeDtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl MoeDtype {
    /// The name of the type, as nucleus-moe names it (`f32`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            MoeDtype::F32 => <f32 as nucleus_moe::Element>::DTYPE.name(),
            MoeDtype::F16 => <f16 as nucleus_moe::Element>::DTYPE.name(),
            MoeDtype::Bf16 => <bf16 as nucleus_moe::Element>::DTYPE.name(),
        }
    }
}

/// A float element type of the benchmark, with its bits for the XOR floor.
pub trait BenchElement: FloatElement {
    /// The unsigned integer of the same width.
    type Bits: Copy + BitXor<Output = Self::Bits> + Send + Sync;
    /// The bits.
    fn bits(self) -> Self::Bits;
    /// The value with these bits.
    fn from_bits(b: Self::Bits) -> Self;
}

macro_rules! bench_element {
    ($t:ty, $bits:ty) => {
        impl BenchElement for $t {
            type Bits = $bits;
            #[inline(always)]
            fn bits(self) -> $bits {
                self.to_bits()
            }
            #[inline(always)]
            fn from_bits(b: $bits) -> Self {
                <$t>::from_bits(b)
            }
        }
    };
}
bench_element!(f32, u32);
bench_element!(f16, u16);
bench_element!(bf16, u16);

/// One shape of the grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// N, tokens.
    pub n: usize,
    /// H, hidden size.
    pub h: usize,
    /// K, experts per token.
    pub k: usize,
    /// E, experts.
    pub e: usize,
}

/// One thing that is timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Job {
    /// `expanded_x`'s bytes written once: each row of `x` copied to K consecutive rows of a
    /// preallocated `[N*K, H]` buffer.
    InitFloor,
    /// [`Job::InitFloor`] on the calling thread alone.
    InitFloorOneThread,
    /// `moe_init_routing_into` on reused buffers.
    InitNucleus,
    /// `moe_init_routing` (a new output per call).
    InitNucleusAlloc,
    /// [`reference::init_routing`] on reused buffers.
    InitReference,
    /// As [`Job::InitFloor`] from an int8 copy of `x`: `N*K*H` bytes written.
    Int8Floor,
    /// [`Job::Int8Floor`] on the calling thread alone.
    Int8FloorOneThread,
    /// `moe_init_routing_into` with dynamic int8, on reused buffers.
    Int8Nucleus,
    /// [`reference::init_routing_dynamic_int8`] on reused buffers.
    Int8Reference,
    /// One read of `expert_out` (XOR of each token's K rows), one write of `out`.
    UnpermuteFloor,
    /// [`Job::UnpermuteFloor`] on the calling thread alone.
    UnpermuteFloorOneThread,
    /// `moe_token_unpermute`.
    UnpermuteNucleus,
    /// [`reference::unpermute`].
    UnpermuteReference,
}

impl Job {
    /// Every job, in the order of the interleaved rounds. Each one-thread floor comes after
    /// its operation's jobs: with two threads, nucleus's parallel row copy at N = 8, H = 2,048
    /// (256 KiB) measured 11-12 µs right after a one-thread job and 7.3-7.8 µs right after
    /// the parallel floor.
    pub const ALL: [Job; 13] = [
        Job::InitFloor,
        Job::InitNucleus,
        Job::InitNucleusAlloc,
        Job::InitReference,
        Job::InitFloorOneThread,
        Job::Int8Floor,
        Job::Int8Nucleus,
        Job::Int8Reference,
        Job::Int8FloorOneThread,
        Job::UnpermuteFloor,
        Job::UnpermuteNucleus,
        Job::UnpermuteReference,
        Job::UnpermuteFloorOneThread,
    ];

    /// The jobs worth timing in a pool of `threads` threads: on one thread the one-thread
    /// floors are the floors themselves and are left out.
    pub fn measured(threads: usize) -> Vec<Job> {
        let one_thread_floors = [
            Job::InitFloorOneThread,
            Job::Int8FloorOneThread,
            Job::UnpermuteFloorOneThread,
        ];
        Job::ALL
            .into_iter()
            .filter(|j| threads > 1 || !one_thread_floors.contains(j))
            .collect()
    }

    /// A floor's one-thread version.
    fn one_thread_floor(self) -> Option<Job> {
        match self {
            Job::InitFloor => Some(Job::InitFloorOneThread),
            Job::Int8Floor => Some(Job::Int8FloorOneThread),
            Job::UnpermuteFloor => Some(Job::UnpermuteFloorOneThread),
            _ => None,
        }
    }

    /// A short name (criterion's function names).
    pub fn name(self) -> &'static str {
        match self {
            Job::InitFloor => "init floor (copy)",
            Job::InitFloorOneThread => "init floor (copy, one thread)",
            Job::InitNucleus => "init nucleus (into)",
            Job::InitNucleusAlloc => "init nucleus (allocating)",
            Job::InitReference => "init reference",
            Job::Int8Floor => "int8 floor (copy)",
            Job::Int8FloorOneThread => "int8 floor (copy, one thread)",
            Job::Int8Nucleus => "int8 nucleus (into)",
            Job::Int8Reference => "int8 reference",
            Job::UnpermuteFloor => "unpermute floor (read)",
            Job::UnpermuteFloorOneThread => "unpermute floor (read, one thread)",
            Job::UnpermuteNucleus => "unpermute nucleus",
            Job::UnpermuteReference => "unpermute reference",
        }
    }
}

/// A row of the table: an operation, its floor, nucleus and (maybe) the reference.
#[derive(Clone, Copy, Debug)]
struct Row {
    label: &'static str,
    floor: Job,
    nucleus: Job,
    reference: Option<Job>,
}

const ROWS: [Row; 4] = [
    Row {
        label: "init routing, into reused buffers",
        floor: Job::InitFloor,
        nucleus: Job::InitNucleus,
        reference: Some(Job::InitReference),
    },
    Row {
        label: "init routing, allocating",
        floor: Job::InitFloor,
        nucleus: Job::InitNucleusAlloc,
        reference: None,
    },
    Row {
        label: "init routing, dynamic int8, into",
        floor: Job::Int8Floor,
        nucleus: Job::Int8Nucleus,
        reference: Some(Job::Int8Reference),
    },
    Row {
        label: "unpermute",
        floor: Job::UnpermuteFloor,
        nucleus: Job::UnpermuteNucleus,
        reference: Some(Job::UnpermuteReference),
    },
];

/// The buffers that the timed calls write into, reused from call to call. `dst` is the one
/// `[N*K, H]` destination of the init floor, the reference and `moe_init_routing_into` (moved
/// into their outputs for the call and back), `dst_i8` the same for int8.
struct Buffers<T> {
    dst: Vec<T>,
    dst_i8: Vec<i8>,
    nucleus: MoeInitRoutingOutput<T>,
    nucleus_int8: MoeInitRoutingOutput<T>,
    reference: reference::Routed<T>,
    reference_int8: reference::Routed<i8>,
    /// `[N, H]`, the unpermute floor's output.
    floor_out: Vec<T>,
}

/// The data and buffers of one shape, built (and checked) outside the timing.
pub struct MoeBench<T> {
    shape: Shape,
    x: Vec<T>,
    /// Each token's row of nucleus's int8 `expanded_x` (the int8 floor's source).
    x_i8: Vec<i8>,
    expert_idx: Vec<i32>,
    weights: Vec<f32>,
    /// nucleus's `expanded_x` (the identity expert's output).
    expert_out: Vec<T>,
    /// nucleus's gather `expanded_row_idx`.
    row_idx: Vec<i32>,
    valid_rows: usize,
    buffers: Mutex<Buffers<T>>,
}

/// At or above this many bytes the floors split their work over the pool (nucleus-moe's
/// `PARALLEL_MIN_BYTES`).
const PARALLEL_MIN_BYTES: usize = 1024 * 1024;

/// The floors' parallel tasks hold whole tokens of at least this many bytes (as nucleus-moe's
/// row copies do). Splitting into one part per thread instead made the 2-thread floor slower
/// than one thread at 256 KiB (N = 8, H = 2,048: 12.9 µs against 6.4 µs): the second
/// thread, woken late, held up its half.
const TASK_BYTES: usize = 64 * 1024;

fn tokens_per_task(token_bytes: usize) -> usize {
    (TASK_BYTES / token_bytes.max(1)).max(1)
}

impl<T: BenchElement> MoeBench<T> {
    /// Generates the data of `shape` from `seed`, runs nucleus and the reference once and
    /// checks that they agree exactly (and that unpermute gives `x` back within rounding).
    ///
    /// # Errors
    /// A bad shape (zero sizes, K > E, E > 10240, N*K past `i32::MAX`: a [`ParamError`]),
    /// memory that cannot be had, an operator error, or a disagreement.
    pub fn new(shape: Shape, seed: u64) -> Result<Self> {
        check_shape(shape)?;
        let Shape { n, h, k, e } = shape;
        let nk = n * k;
        // The caller names the shape (`N 4096, H 7168, K 8: its buffers need ...`).
        reserve(shape.buffer_bytes(std::mem::size_of::<T>()), "its buffers")?;

        let mut rng = SplitMix64::new(seed);
        let x: Vec<T> = try_collect(
            n * h,
            std::iter::repeat_with(|| T::from_f32(rng.normal() as f32)),
            "x",
        )?;
        let mut expert_idx = try_collect(nk, std::iter::empty(), "expert_idx")?;
        let mut weights = try_collect(nk, std::iter::empty(), "the routing weights")?;
        for _ in 0..n {
            let token = expert_idx.len();
            while expert_idx.len() < token + k {
                let id = rng.below(e as u64) as i32;
                if !expert_idx[token..].contains(&id) {
                    expert_idx.push(id);
                }
            }
            let u: Vec<f32> = (0..k).map(|_| rng.uniform(0.1, 1.0) as f32).collect();
            let sum: f32 = u.iter().sum();
            weights.extend(u.iter().map(|&v| v / sum));
        }

        let input = MoeInitRoutingInput {
            x: &x,
            num_rows: n,
            hidden_size: h,
            expert_idx: &expert_idx,
            k,
            scale: None,
            offset: None,
        };
        let out = moe_init_routing(&input, &attrs(e, QuantMode::None))?;
        let mut reference = reference::Routed::default();
        reference::init_routing(&x, h, &expert_idx, k, e, &mut reference);
        ensure!(
            out.expanded_row_idx == reference.expanded_row_idx,
            "expanded_row_idx: nucleus and the reference disagree"
        );
        ensure!(
            out.expert_tokens.as_deref() == Some(&reference.expert_tokens[..]),
            "expert_tokens: nucleus and the reference disagree"
        );
        ensure!(
            out.valid_rows == reference.valid_rows && out.valid_rows == nk,
            "valid_rows: nucleus {}, the reference {}, routes {nk}",
            out.valid_rows,
            reference.valid_rows
        );
        let ExpandedX::Unquantized(expert_out) = out.expanded_x else {
            anyhow::bail!("nucleus returned an int8 expanded_x without quantisation");
        };
        ensure!(
            expert_out == reference.expanded_x,
            "expanded_x: nucleus and the reference disagree"
        );
        let dst = std::mem::take(&mut reference.expanded_x);

        let mut nucleus_int8 = MoeInitRoutingOutput::default();
        moe_init_routing_into(&input, &attrs(e, QuantMode::Dynamic), &mut nucleus_int8)?;
        let mut reference_int8 = reference::Routed::default();
        reference::init_routing_dynamic_int8(&x, h, &expert_idx, k, e, &mut reference_int8);
        let ExpandedX::Int8(q) =
            std::mem::replace(&mut nucleus_int8.expanded_x, ExpandedX::Int8(Vec::new()))
        else {
            anyhow::bail!("nucleus returned an unquantised expanded_x with dynamic int8");
        };
        ensure!(
            q == reference_int8.expanded_x
                && nucleus_int8.expanded_scale.as_deref()
                    == Some(&reference_int8.expanded_scale[..])
                && nucleus_int8.expanded_row_idx == reference_int8.expanded_row_idx,
            "dynamic int8: nucleus and the reference disagree"
        );
        // Reserved at once (collected from `flat_map`, the vector doubled past its length).
        let x_i8: Vec<i8> = try_collect(
            n * h,
            (0..n).flat_map(|i| {
                let r = nucleus_int8.expanded_row_idx[i * k] as usize;
                q[r * h..(r + 1) * h].iter().copied()
            }),
            "the int8 x",
        )?;
        drop(q);
        let dst_i8 = std::mem::take(&mut reference_int8.expanded_x);

        let back =
            moe_token_unpermute(&expert_out, h, &out.expanded_row_idx, Some(&weights), k, nk)?;
        let back_ref = reference::unpermute(&expert_out, h, &out.expanded_row_idx, &weights, k, nk);
        ensure!(
            back == back_ref,
            "unpermute: nucleus and the reference disagree"
        );
        // The weights sum to 1 (in f32, to within a few ulps): out is x to within rounding.
        let far = x.iter().zip(&back).position(|(a, b)| {
            let (a, b) = (a.to_f32(), b.to_f32());
            (a - b).abs() > 1e-2 * a.abs() + 1e-6
        });
        ensure!(
            far.is_none(),
            "unpermute of the identity expert does not give x back (element {far:?})"
        );
        drop((back, back_ref));

        Ok(Self {
            shape,
            x,
            x_i8,
            expert_idx,
            weights,
            expert_out,
            row_idx: out.expanded_row_idx,
            valid_rows: nk,
            buffers: Mutex::new(Buffers {
                dst,
                dst_i8,
                nucleus: MoeInitRoutingOutput::default(),
                nucleus_int8,
                reference,
                reference_int8,
                floor_out: try_collect(n * h, std::iter::repeat(T::default()), "the floor's out")?,
            }),
        })
    }

    /// The shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    fn input(&self) -> MoeInitRoutingInput<'_, T> {
        MoeInitRoutingInput {
            x: &self.x,
            num_rows: self.shape.n,
            hidden_size: self.shape.h,
            expert_idx: &self.expert_idx,
            k: self.shape.k,
            scale: None,
            offset: None,
        }
    }

    fn buffers(&self) -> MutexGuard<'_, Buffers<T>> {
        self.buffers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `job` once.
    ///
    /// # Errors
    /// An operator error (none on the benchmark's data).
    pub fn run_job(&self, job: Job) -> Result<()> {
        let Shape { n: _, h, k, e } = self.shape;
        let mut guard = self.buffers();
        let b = &mut *guard;
        match job {
            Job::InitFloor => fan_out(&mut b.dst, &self.x, h, k, true),
            Job::InitFloorOneThread => fan_out(&mut b.dst, &self.x, h, k, false),
            Job::Int8Floor => fan_out(&mut b.dst_i8, &self.x_i8, h, k, true),
            Job::Int8FloorOneThread => fan_out(&mut b.dst_i8, &self.x_i8, h, k, false),
            Job::UnpermuteFloor => xor_floor(&self.expert_out, h, k, &mut b.floor_out, true),
            Job::UnpermuteFloorOneThread => {
                xor_floor(&self.expert_out, h, k, &mut b.floor_out, false)
            }
            Job::InitNucleus => {
                b.nucleus.expanded_x = ExpandedX::Unquantized(std::mem::take(&mut b.dst));
                let r = moe_init_routing_into(
                    &self.input(),
                    &attrs(e, QuantMode::None),
                    &mut b.nucleus,
                );
                if let ExpandedX::Unquantized(v) =
                    std::mem::replace(&mut b.nucleus.expanded_x, ExpandedX::Int8(Vec::new()))
                {
                    b.dst = v;
                }
                r?;
            }
            Job::InitNucleusAlloc => {
                let out = moe_init_routing(&self.input(), &attrs(e, QuantMode::None))?;
                std::hint::black_box(&out);
            }
            Job::InitReference => {
                b.reference.expanded_x = std::mem::take(&mut b.dst);
                reference::init_routing(&self.x, h, &self.expert_idx, k, e, &mut b.reference);
                b.dst = std::mem::take(&mut b.reference.expanded_x);
            }
            Job::Int8Nucleus => {
                b.nucleus_int8.expanded_x = ExpandedX::Int8(std::mem::take(&mut b.dst_i8));
                let r = moe_init_routing_into(
                    &self.input(),
                    &attrs(e, QuantMode::Dynamic),
                    &mut b.nucleus_int8,
                );
                if let ExpandedX::Int8(v) =
                    std::mem::replace(&mut b.nucleus_int8.expanded_x, ExpandedX::Int8(Vec::new()))
                {
                    b.dst_i8 = v;
                }
                r?;
            }
            Job::Int8Reference => {
                b.reference_int8.expanded_x = std::mem::take(&mut b.dst_i8);
                reference::init_routing_dynamic_int8(
                    &self.x,
                    h,
                    &self.expert_idx,
                    k,
                    e,
                    &mut b.reference_int8,
                );
                b.dst_i8 = std::mem::take(&mut b.reference_int8.expanded_x);
            }
            Job::UnpermuteNucleus => {
                let out = moe_token_unpermute(
                    &self.expert_out,
                    h,
                    &self.row_idx,
                    Some(&self.weights),
                    k,
                    self.valid_rows,
                )?;
                std::hint::black_box(&out);
            }
            Job::UnpermuteReference => {
                let out = reference::unpermute(
                    &self.expert_out,
                    h,
                    &self.row_idx,
                    &self.weights,
                    k,
                    self.valid_rows,
                );
                std::hint::black_box(&out);
            }
        }
        std::hint::black_box(&b.dst);
        Ok(())
    }
}

/// The flags of one shape in their domains, as [`ParamError`]s: N, H, K at least 1, E in
/// `1..=10240`, K <= E (K distinct experts per token), N * K at most `i32::MAX` (the row
/// indices are i32).
///
/// # Errors
/// The first value outside its domain.
pub fn check_shape(shape: Shape) -> Result<()> {
    let Shape { n, h, k, e } = shape;
    let usage = |m: String| Err(anyhow::Error::new(ParamError(m)));
    if n == 0 {
        return usage("--rows must be at least 1".into());
    }
    if h == 0 {
        return usage("--hidden must be at least 1".into());
    }
    if k == 0 {
        return usage("--k must be at least 1".into());
    }
    if !(1..=10240).contains(&e) {
        return usage(format!("--experts {e}: must be in 1..=10240"));
    }
    if k > e {
        return usage(format!(
            "--k {k}: K distinct experts per token need K <= E = {e}"
        ));
    }
    if n.checked_mul(k).is_none_or(|nk| nk > i32::MAX as usize) {
        return usage(format!(
            "--rows {n} x --k {k}: N * K must be at most 2^31 - 1 (the row indices are i32)"
        ));
    }
    Ok(())
}

impl Shape {
    /// The bytes a shape's measurement holds at its peak for elements of `elem` bytes, a
    /// bound on every phase of [`MoeBench::new`] and of the timed jobs: `x` and its int8 copy
    /// (nucleus-moe's dynamic int8 makes one more while it runs); `expert_out`, the shared
    /// destination and an allocating call's output (`[N*K, H]` each) and two int8 ones (the
    /// shared destination, and nucleus's output while it is checked); the unpermute outputs
    /// and the floor's (`[N, H]`, four at most); per route, 64 bytes: the ids, weights, the
    /// row indices and scales of the four kept outputs, nucleus-moe's counting sort (a bucket,
    /// the order, the positions) and the reference's stable argsort (`usize` indices and
    /// merge buffer); per expert, the four outputs' token counts. Every large buffer is
    /// allocated at its length (none grows by doubling). `None` when they overflow `usize`.
    pub fn buffer_bytes(self, elem: usize) -> Option<usize> {
        let Shape { n, h, k, e } = self;
        let nk = n.checked_mul(k)?;
        let p = crate::memory::product;
        crate::memory::total(&[
            p(&[nk, h, elem, 3]),
            p(&[nk, h, 2]),
            p(&[n, h, elem, 4]),
            p(&[n, h, 2]),
            p(&[nk, 64]),
            p(&[e, 64]),
        ])
    }
}

/// Dropless, gather index, count `expert_tokens`, `quant`.
fn attrs(experts: usize, quant: QuantMode) -> MoeInitRoutingAttrs {
    MoeInitRoutingAttrs {
        expert_tokens_num_type: ExpertTokensNumType::Count,
        expert_tokens_num_flag: true,
        quant_mode: quant,
        ..MoeInitRoutingAttrs::new(experts as i64)
    }
}

/// The init floors: rows `i*K..(i+1)*K` of `dst` = row `i` of `src` (`[N, H]`), one
/// `copy_from_slice` per row; with `parallel`, from [`PARALLEL_MIN_BYTES`] of `dst` on, tokens
/// in parallel in tasks of at least [`TASK_BYTES`] of `dst`.
fn fan_out<U: Copy + Send + Sync>(dst: &mut [U], src: &[U], h: usize, k: usize, parallel: bool) {
    let token = |(s, d): (&[U], &mut [U])| {
        for row in d.chunks_exact_mut(h) {
            row.copy_from_slice(s);
        }
    };
    let threads = rayon::current_num_threads();
    let n = src.len() / h;
    debug_assert_eq!(dst.len(), n * k * h);
    if !parallel || threads == 1 || std::mem::size_of_val(dst) < PARALLEL_MIN_BYTES || n == 1 {
        src.chunks_exact(h)
            .zip(dst.chunks_exact_mut(k * h))
            .for_each(token);
        return;
    }
    let per_task = tokens_per_task(k * h * std::mem::size_of::<U>());
    src.par_chunks(per_task * h)
        .zip(dst.par_chunks_mut(per_task * k * h))
        .for_each(|(s, d)| {
            s.chunks_exact(h)
                .zip(d.chunks_exact_mut(k * h))
                .for_each(token)
        });
}

/// The unpermute floor: `out` row `i` = the XOR of rows `i*K..(i+1)*K` of `expert_out` (one
/// sequential read of `expert_out`, one write of `out`); with `parallel`, from
/// [`PARALLEL_MIN_BYTES`] of `expert_out` on, tokens in parallel in tasks of at least
/// [`TASK_BYTES`] of `expert_out`.
fn xor_floor<T: BenchElement>(expert_out: &[T], h: usize, k: usize, out: &mut [T], parallel: bool) {
    let token = |(rows, o): (&[T], &mut [T])| {
        o.copy_from_slice(&rows[..h]);
        for row in rows[h..].chunks_exact(h) {
            for (o, &v) in o.iter_mut().zip(row) {
                *o = T::from_bits(o.bits() ^ v.bits());
            }
        }
    };
    let threads = rayon::current_num_threads();
    let n = out.len() / h;
    if !parallel || threads == 1 || std::mem::size_of_val(expert_out) < PARALLEL_MIN_BYTES || n == 1
    {
        expert_out
            .chunks_exact(k * h)
            .zip(out.chunks_exact_mut(h))
            .for_each(token);
        return;
    }
    let per_task = tokens_per_task(k * h * std::mem::size_of::<T>());
    expert_out
        .par_chunks(per_task * k * h)
        .zip(out.par_chunks_mut(per_task * h))
        .for_each(|(rows, o)| {
            rows.chunks_exact(k * h)
                .zip(o.chunks_exact_mut(h))
                .for_each(token)
        });
}

/// [`interleaved_medians`] calls a job once untimed before each timed call shorter than this.
const UNTIMED_CALL_BELOW: Duration = Duration::from_millis(2);

/// Times `jobs` on `bench`, interleaved round by round ([`interleaved_medians`]); returns per
/// job the median µs per call.
///
/// One untimed call was not enough to settle the caches after another job at the shapes whose
/// buffers are about the size of L2 (N = 64, H = 2,048: 2 MB per `expanded_x`): whichever job
/// came first in a round (after the previous round's unpermute reference) measured 1.7x-1.8x
/// slower than the same job in second place. So a job that follows another one and gets an
/// untimed call (one under `UNTIMED_CALL_BELOW`, 2 ms) is called once more before it, untimed:
/// every short job is timed on its third call in a row; jobs of 2 ms and more, timed on their
/// first, are bound by memory far larger than the caches.
///
/// # Errors
/// The first job that fails.
pub fn median_us<T: BenchElement>(
    bench: &MoeBench<T>,
    jobs: &[Job],
    iters: Option<usize>,
) -> Result<Vec<f64>> {
    let previous = Cell::new(None);
    let last = RefCell::new(vec![Duration::MAX; jobs.len()]);
    interleaved_medians(jobs, 1, iters, |job| {
        let i = jobs.iter().position(|&j| j == job).expect("a job");
        if previous.replace(Some(job)) != Some(job) && last.borrow()[i] < UNTIMED_CALL_BELOW {
            bench.run_job(job)?;
        }
        let t = Instant::now();
        bench.run_job(job)?;
        last.borrow_mut()[i] = t.elapsed();
        Ok(())
    })
}

/// One operation of one shape: its floor, nucleus and (for three of the four) the reference,
/// µs per call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OperationTimes {
    /// The operation (`init routing, into reused buffers`, `unpermute`, ...).
    pub label: &'static str,
    /// The floor: with more than one thread, the faster of its runs on the pool and on one
    /// thread.
    pub floor_us: f64,
    /// nucleus-moe.
    pub nucleus_us: f64,
    /// The reference (`None`: the allocating init routing, which has none of its own).
    pub reference_us: Option<f64>,
}

/// One shape's measurements, the four operations in table order.
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeTimes {
    /// The shape.
    pub shape: Shape,
    /// The operations.
    pub operations: Vec<OperationTimes>,
}

/// What [`run`] reports as it goes.
#[derive(Clone, Debug, PartialEq)]
pub enum MoeEvent {
    /// Every parameter is checked and the largest shape's memory reserved: the shapes are
    /// about to be measured.
    Started,
    /// One shape was measured (they come in `hidden`-major order).
    Shape(ShapeTimes),
}

/// Runs the measurement of every shape (`rows` x `hidden`) in a rayon pool of
/// `config.threads` threads, telling `on_event` when it starts and each shape as it is
/// measured (each shape's buffers are freed before the next).
///
/// # Errors
/// A bad configuration (a [`ParamError`]), memory that cannot be had, an operator error, a
/// disagreement between the methods, or an error of `on_event`.
pub fn run(
    config: &Config,
    on_event: &mut (dyn FnMut(MoeEvent) -> Result<()> + Send),
) -> Result<()> {
    check_runs(config.threads, config.iters)?;
    if config.rows.is_empty() || config.hidden.is_empty() {
        bail!(ParamError::new(
            "--rows and --hidden need at least one value each"
        ));
    }
    // Every shape's parameters, and the memory of the largest one, before anything starts.
    let shapes: Vec<Shape> = config
        .hidden
        .iter()
        .flat_map(|&h| {
            config.rows.iter().map(move |&n| Shape {
                n,
                h,
                k: config.k,
                e: config.experts,
            })
        })
        .collect();
    for &shape in &shapes {
        check_shape(shape)?;
    }
    let elem = match config.dtype {
        MoeDtype::F32 => 4,
        MoeDtype::F16 | MoeDtype::Bf16 => 2,
    };
    let largest = shapes
        .iter()
        .map(|s| (s.buffer_bytes(elem), s))
        .max_by_key(|(bytes, _)| bytes.unwrap_or(usize::MAX));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(config.threads)
        .build()
        .context("building the thread pool")?;
    pool.install(|| {
        // Checked on the pool's thread, where the shapes are built: its stack and malloc
        // arena (64 MiB of address space) count against a `ulimit -v` too, and a check made
        // before them passed shapes that then failed after the table's header.
        if let Some((bytes, s)) = largest {
            reserve(
                bytes,
                &format!(
                    "the largest shape, N {} x H {} x K {}, and its outputs",
                    s.n, s.h, s.k
                ),
            )?;
        }
        on_event(MoeEvent::Started)?;
        for &shape in &shapes {
            let times = match config.dtype {
                MoeDtype::F32 => measure_shape::<f32>(shape, config),
                MoeDtype::F16 => measure_shape::<f16>(shape, config),
                MoeDtype::Bf16 => measure_shape::<bf16>(shape, config),
            }?;
            on_event(MoeEvent::Shape(times))?;
        }
        Ok(())
    })
}

/// Builds one shape's data and times its jobs on the current rayon pool.
fn measure_shape<T: BenchElement>(shape: Shape, config: &Config) -> Result<ShapeTimes> {
    let bench = MoeBench::<T>::new(shape, DEFAULT_SEED)
        .with_context(|| format!("N {}, H {}, K {}", shape.n, shape.h, shape.k))?;
    let jobs = Job::measured(config.threads);
    let us = median_us(&bench, &jobs, config.iters)?;
    drop(bench);
    let find = |job: Job| jobs.iter().position(|&j| j == job).map(|i| us[i]);
    let at = |job: Job| find(job).context("a measured job");
    let operations = ROWS
        .iter()
        .map(|row| {
            // The faster of the floor on the pool and on one thread.
            let one_thread = row.floor.one_thread_floor().and_then(find);
            let floor = at(row.floor)?;
            Ok(OperationTimes {
                label: row.label,
                floor_us: one_thread.map_or(floor, |t| t.min(floor)),
                nucleus_us: at(row.nucleus)?,
                reference_us: row.reference.map(at).transpose()?,
            })
        })
        .collect::<Result<_>>()?;
    Ok(ShapeTimes { shape, operations })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_job_runs_on_a_small_shape() {
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                // 64 * 8 * 512 bf16 = 512 KiB: the parallel paths of the floors too.
                let shape = Shape {
                    n: 64,
                    h: 512,
                    k: 8,
                    e: 32,
                };
                let bench = MoeBench::<bf16>::new(shape, 7).unwrap();
                for job in Job::ALL {
                    bench.run_job(job).unwrap();
                }
                assert_eq!(
                    Job::measured(threads).len(),
                    if threads == 1 { 10 } else { 13 }
                );
                // The shared destinations hold what the last job wrote there.
                for job in [Job::InitNucleus, Job::InitReference] {
                    bench.run_job(job).unwrap();
                    assert_eq!(bench.buffers().dst, bench.expert_out, "{job:?}");
                }
                let mut floor = vec![0i8; 64 * 8 * 512];
                fan_out(&mut floor, &bench.x_i8, 512, 8, false);
                for job in [Job::Int8Floor, Job::Int8FloorOneThread] {
                    bench.buffers().dst_i8.fill(0);
                    bench.run_job(job).unwrap();
                    assert_eq!(bench.buffers().dst_i8, floor, "{job:?}");
                }
            });
        }
    }

    #[test]
    fn the_xor_floor_folds_each_tokens_rows() {
        let rows = [1f32, 2., 3., 4., 5., 6., 7., 8.];
        let mut out = [0f32; 4];
        xor_floor(&rows, 2, 2, &mut out, true);
        let x = |a: f32, b: f32| a.to_bits() ^ b.to_bits();
        assert_eq!(
            out.map(f32::to_bits),
            [x(1., 3.), x(2., 4.), x(5., 7.), x(6., 8.)]
        );
    }

    #[test]
    fn a_bad_shape_is_an_error() {
        let shape = Shape {
            n: 1,
            h: 4,
            k: 9,
            e: 8,
        };
        let err = MoeBench::<f32>::new(shape, 1).err().expect("K > E");
        assert!(err.to_string().contains("K <= E"), "{err}");
    }
}
