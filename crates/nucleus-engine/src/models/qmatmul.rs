//! Our matrix kernels for the quantized types people run most: Q8_0, Q4_0 (blocks of 32), Q4_K
//! and Q6_K (super-blocks of 256; Q4_K_M files are Q4_K and Q6_K), with one reduction order
//! per output, so a row's result does not depend on the batch it runs in.
//!
//! The semantics are ggml's (`ggml_compute_forward_mul_mat` in `ggml/src/ggml-cpu/ggml-cpu.c`):
//! each activation row is quantized to the weight type's dot-product type, Q8_0 for Q8_0 and
//! Q4_0, Q8_K for Q4_K and Q6_K (candle's `from_float`, ggml's `quantize_row_q8_0` /
//! `quantize_row_q8_K`, one row at a time), and each output is the dot product of a weight row
//! and a quantized activation row. The order of that dot product is ours, fixed and the same
//! for every tile, batch and thread count:
//!
//! - For each block pair `b` (weight block, activation block), 8 exact integer lanes
//!   `L[l]`: lane `l` sums the products of the elements `e` with `e % 32` in `4l..4l + 4`
//!   (times the sub-block scale of Q4_K and Q6_K). These are integers well within `i32` and
//!   within `2^24`, so their f32 values are exact.
//! - `acc[l] = fma(s_b, L[l] as f32, acc[l])` with the block's scale `s_b`: `d_w · d_x`
//!   (Q8_0, Q4_0; both f16 to f32, multiplied in f32), `d_x · d_w` (Q4_K, Q6_K; `d_x` is Q8_K's
//!   f32 scale).
//! - Q4_K's minimums: `m = fma(-(d_x · dmin_w), M_b as f32, m)` with `M_b = Σ_j min_j ·
//!   (bsum_2j + bsum_2j+1)` (exact, from Q8_K's sums of 16).
//! - The output is `((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)) + m`
//!   (`m` is 0 for the other types), the reduction of [`crate::models::matmul`].
//!
//! The lanes are what AVX2's `maddubs` / `madd` give (ggml's AVX2 `vec_dot` kernels use the
//! same instructions, and also keep 8 float lanes, but order the scales and the final sums
//! differently), so the AVX2 kernels here compute the portable definition ([`dot_portable`])
//! bit for bit; the tests check both against each other on every tile and edge, and against
//! candle's dequantize-then-multiply. The tiles: one weight row at a time against up to 4
//! activation rows while at most [`SMALL_BATCH`] rows (decode: the weights read as one
//! sequential stream, which measured faster than 2 or 4 rows at a time for every type here,
//! Q6_K 5x faster than 4 rows), 2 weight rows × 4 activation rows beyond (3 × 4 for Q4_0;
//! prefill: each weight chunk unpacked once for 4 activation rows, activations in blocks of
//! [`TOKEN_BLOCK`] rows; measured the fastest of 4 × 2, 4 × 3, 3 × 4, 2 × 2, 2 × 3 and 1 × 4);
//! rows split over rayon's pool in tasks of [`TASK_ROWS`] rows ([`crate::models::matmul`]'s
//! runner). For Q8_0 and Q4_0 the activations are quantized on AVX2 (candle's bits, 6x less
//! time than its scalar `from_float` with a libm `roundf` per value) and laid out in groups of
//! 4 rows ([`grouped`]): a tile reads one stream, and multiplies its 4 activation scales by a
//! weight block's in one instruction, then spreads each over the lanes with a shuffle (one
//! instruction per pair instead of a scalar product and a broadcast: Q8_0 prefill 15 to 20%
//! faster). There is no AVX-512 variant: the machines this was built and measured on have
//! none, and a kernel we cannot run is one we cannot test.
//!
//! ggml's semantics differ from an exact product by the activations' 8-bit rounding: on the
//! 0.85 B random Llama the logits move by up to 0.15 from an f64 computation of the stored
//! weights (RMS 0.035), llama.cpp's by as much, and the two by as much from each other
//! (BENCHMARKS.md, "Generation"): a difference of one rounding anywhere upstream changes
//! which activations round up, so no two implementations that are not identical op for op
//! agree more closely than that.

use candle_core::quantized::k_quants::GgmlType;
use candle_core::quantized::k_quants::{BlockQ4K, BlockQ4_0, BlockQ6K, BlockQ8K, BlockQ8_0};

#[cfg(doc)]
use crate::models::matmul::TASK_ROWS;
use crate::models::matmul::{by_tasks, reduce, Out, SMALL_BATCH, TOKEN_BLOCK};

/// Lanes of each output's accumulator.
const LANES: usize = 8;

/// ggml's `block_q8_0`: 32 values `d · qs[i]`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Q8_0 {
    d: u16,
    qs: [i8; 32],
}

/// ggml's `block_q4_0`: 32 values `d · (q - 8)`, `q` the low nibbles of `qs` (elements 0..16)
/// then the high nibbles (16..32).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Q4_0 {
    d: u16,
    qs: [u8; 16],
}

/// ggml's `block_q4_K`: 256 values in 8 sub-blocks of 32, `d · sc_j · q - dmin · m_j`, the
/// 6-bit `sc_j`, `m_j` packed in `scales`; `qs[32c..32c + 32]` holds sub-block `2c` in its low
/// nibbles and `2c + 1` in its high nibbles.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Q4K {
    d: u16,
    dmin: u16,
    scales: [u8; 12],
    qs: [u8; 128],
}

/// ggml's `block_q6_K`: 256 values `d · scales[e / 16] · (q - 32)`, `q` 6 bits: 4 in `ql`, 2 in
/// `qh` (layout: `dequantize_row_q6_K`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Q6K {
    ql: [u8; 128],
    qh: [u8; 64],
    scales: [i8; 16],
    d: u16,
}

/// ggml's `block_q8_K`: 256 values `d · qs[i]` and the sums of each 16.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Q8K {
    d: f32,
    qs: [i8; 256],
    bsums: [i16; 16],
}

/// candle's block type `C` and our mirror `M` of it have the same size and alignment (their
/// fields are not public; both are `repr(C)` copies of ggml's structs).
const fn same_layout<C, M>() -> bool {
    std::mem::size_of::<C>() == std::mem::size_of::<M>()
        && std::mem::align_of::<C>() == std::mem::align_of::<M>()
}
const _: () = assert!(same_layout::<BlockQ8_0, Q8_0>());
const _: () = assert!(same_layout::<BlockQ4_0, Q4_0>());
const _: () = assert!(same_layout::<BlockQ4K, Q4K>());
const _: () = assert!(same_layout::<BlockQ6K, Q6K>());
const _: () = assert!(same_layout::<BlockQ8K, Q8K>());

/// candle's blocks `C` as our mirror `M`.
///
/// # Safety
/// `M` is the mirror of `C` (`same_layout`, checked at compile time for the pairs above; both
/// plain old data).
unsafe fn view<C, M>(blocks: &[C]) -> &[M] {
    debug_assert!(same_layout::<C, M>());
    std::slice::from_raw_parts(blocks.as_ptr().cast::<M>(), blocks.len())
}

/// What the AVX2 kernels use of the activation blocks besides their quants, worked out once
/// per product, one entry per block: the scales as f32 (`d`), and for the kernels that ask for
/// them ([`Kernel::SUMS8`]: Q4_0) 8 times the sum of each 4 consecutive quants, for
/// `(q - 8) · a = q · a - 8 · a` per lane (exact integers either way; `sums8`, empty
/// otherwise). Arrays apart, so the prefill tiles read 4 bytes per block of the scales and
/// nothing they do not use.
pub(crate) struct ActAux {
    d: Vec<f32>,
    sums8: Vec<[i32; LANES]>,
}

impl ActAux {
    /// The scales and (with `K::SUMS8`) the lane sums of `acts`.
    fn new<K: Kernel>(acts: &[K::Act]) -> Self {
        Self {
            d: acts.iter().map(ActBlock::d).collect(),
            sums8: if K::SUMS8 {
                acts.iter().map(K::sums8).collect()
            } else {
                Vec::new()
            },
        }
    }
}

/// An activation block type.
pub(crate) trait ActBlock: Copy + Send + Sync + 'static {
    /// Makes the block's scale NaN (see [`quantize_rows`]).
    fn poison(&mut self);

    /// The block's scale as f32.
    fn d(&self) -> f32;
}

impl ActBlock for Q8_0 {
    fn poison(&mut self) {
        self.d = half::f16::NAN.to_bits();
    }

    fn d(&self) -> f32 {
        Soft.f32(self.d)
    }
}

impl ActBlock for Q8K {
    fn poison(&mut self) {
        self.d = f32::NAN;
    }

    fn d(&self) -> f32 {
        self.d
    }
}

/// A conversion of an f16's bits to f32 (exact): the `half` crate's ([`Soft`]), or on x86 a
/// table of every f16's value (`x86::F16c`). Both give the same value for every f16.
pub(crate) trait Halves: Copy {
    /// The value of the f16 `bits`.
    fn f32(self, bits: u16) -> f32;
}

/// The `half` crate's conversion (portable).
#[derive(Clone, Copy)]
pub(crate) struct Soft;

impl Halves for Soft {
    #[inline(always)]
    fn f32(self, bits: u16) -> f32 {
        half::f16::from_bits(bits).to_f32()
    }
}

/// A weight block type with our kernels, and the activation block type it is multiplied by.
pub(crate) trait Kernel: Copy + Send + Sync + 'static {
    /// candle's block type (whose slices are viewed as `Self`).
    type Candle: GgmlType;
    /// The activation block: [`Q8_0`] or [`Q8K`].
    type Act: ActBlock;
    /// candle's activation block type, whose `from_float` quantizes an activation row.
    type CandleAct: GgmlType;
    /// Whether the type has minimums (Q4_K).
    const MINS: bool;
    /// Whether the AVX2 kernel reads the activation blocks' `ActAux::sums8` (Q4_0).
    const SUMS8: bool = false;
    /// Whether the AVX2 prefill reads the activations in [`grouped`]'s layout (Q8_0 and Q4_0,
    /// whose tiles then work out 4 scales at once; measured slower for the super-block types;
    /// see [`grouped_layout`]).
    const GROUPED: bool;

    /// Quantizes one activation row `xs` into `ys` (`xs.len() / block` blocks) as candle's
    /// `CandleAct::from_float` does, each block with a NaN then poisoned ([`quantize_rows`]).
    fn quantize_row(xs: &[f32], ys: &mut [Self::Act]) {
        from_float_poisoned::<Self>(xs, ys)
    }

    /// An activation block's `ActAux::sums8` entry (with `SUMS8`).
    fn sums8(_a: &Self::Act) -> [i32; LANES] {
        [0; LANES]
    }

    /// The block pair's exact integer lanes (the module docs).
    fn lanes(w: &Self, a: &Self::Act) -> [i32; LANES];

    /// The block pair's scale `s_b`.
    fn scale<H: Halves>(w: &Self, a: &Self::Act, h: H) -> f32;

    /// The block pair's minimum term `(-(d_x · dmin_w), M_b)`; `(0, 0)` without minimums.
    fn mins<H: Halves>(_w: &Self, _a: &Self::Act, _h: H) -> (f32, i32) {
        (0.0, 0)
    }

    /// `rows_kernel` on AVX2 (`x86::rows_kernel` of the type).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; as `rows_kernel`.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn avx2_rows(
        w: &[Self],
        n: usize,
        per_row: usize,
        a: &[Self::Act],
        aux: &ActAux,
        t: usize,
        out: Out,
    );
}

/// The dot product of a weight row and a quantized activation row in the module docs' order.
pub(crate) fn dot_portable<K: Kernel>(w: &[K], a: &[K::Act]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut m = 0f32;
    for (w, a) in w.iter().zip(a) {
        let lanes = K::lanes(w, a);
        let s = K::scale(w, a, Soft);
        for l in 0..LANES {
            acc[l] = s.mul_add(lanes[l] as f32, acc[l]);
        }
        if K::MINS {
            let (c, mb) = K::mins(w, a, Soft);
            m = c.mul_add(mb as f32, m);
        }
    }
    reduce(&acc) + m
}

/// `Kernel::avx2_rows` of a type: its `x86::rows_kernel`.
macro_rules! avx2_rows {
    () => {
        #[cfg(target_arch = "x86_64")]
        unsafe fn avx2_rows(
            w: &[Self],
            n: usize,
            per_row: usize,
            a: &[Self::Act],
            aux: &ActAux,
            t: usize,
            out: Out,
        ) {
            x86::rows_kernel(w, n, per_row, a, aux, t, out)
        }
    };
}

impl Kernel for Q8_0 {
    avx2_rows!();

    type Candle = BlockQ8_0;
    type Act = Q8_0;
    type CandleAct = BlockQ8_0;
    const MINS: bool = false;
    const GROUPED: bool = true;

    fn quantize_row(xs: &[f32], ys: &mut [Q8_0]) {
        quantize_row_q8_0(xs, ys)
    }

    fn lanes(w: &Self, a: &Q8_0) -> [i32; LANES] {
        let mut l = [0i32; LANES];
        for e in 0..32 {
            l[e / 4] += w.qs[e] as i32 * a.qs[e] as i32;
        }
        l
    }

    #[inline(always)]
    fn scale<H: Halves>(w: &Self, a: &Q8_0, h: H) -> f32 {
        h.f32(w.d) * h.f32(a.d)
    }
}

impl Kernel for Q4_0 {
    avx2_rows!();

    type Candle = BlockQ4_0;
    type Act = Q8_0;
    type CandleAct = BlockQ8_0;
    const MINS: bool = false;
    const SUMS8: bool = true;
    const GROUPED: bool = true;

    fn quantize_row(xs: &[f32], ys: &mut [Q8_0]) {
        quantize_row_q8_0(xs, ys)
    }

    /// 8 times the sum of each 4 consecutive quants.
    fn sums8(a: &Q8_0) -> [i32; LANES] {
        let mut sums8 = [0i32; LANES];
        for (l, sum) in sums8.iter_mut().enumerate() {
            *sum = 8 * a.qs[4 * l..4 * l + 4]
                .iter()
                .map(|&q| q as i32)
                .sum::<i32>();
        }
        sums8
    }

    fn lanes(w: &Self, a: &Q8_0) -> [i32; LANES] {
        let mut l = [0i32; LANES];
        for e in 0..32 {
            let q = if e < 16 {
                w.qs[e] & 0xF
            } else {
                w.qs[e - 16] >> 4
            };
            l[e / 4] += (q as i32 - 8) * a.qs[e] as i32;
        }
        l
    }

    #[inline(always)]
    fn scale<H: Halves>(w: &Self, a: &Q8_0, h: H) -> f32 {
        h.f32(w.d) * h.f32(a.d)
    }
}

/// Q4_K's 6-bit scale and minimum of sub-block `j` (ggml's `get_scale_min_k4`).
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

impl Kernel for Q4K {
    avx2_rows!();

    type Candle = BlockQ4K;
    type Act = Q8K;
    type CandleAct = BlockQ8K;
    const MINS: bool = true;
    const GROUPED: bool = false;

    fn lanes(w: &Self, a: &Q8K) -> [i32; LANES] {
        let mut l = [0i32; LANES];
        for j in 0..8 {
            let sc = scale_min_k4(j, &w.scales).0 as i32;
            for e in 0..32 {
                let byte = w.qs[32 * (j / 2) + e];
                let q = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
                l[e / 4] += sc * q as i32 * a.qs[32 * j + e] as i32;
            }
        }
        l
    }

    #[inline(always)]
    fn scale<H: Halves>(w: &Self, a: &Q8K, h: H) -> f32 {
        a.d * h.f32(w.d)
    }

    #[inline(always)]
    fn mins<H: Halves>(w: &Self, a: &Q8K, h: H) -> (f32, i32) {
        let mut mb = 0i32;
        for j in 0..8 {
            let m = scale_min_k4(j, &w.scales).1 as i32;
            mb += m * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32);
        }
        (-(a.d * h.f32(w.dmin)), mb)
    }
}

impl Kernel for Q6K {
    avx2_rows!();

    type Candle = BlockQ6K;
    type Act = Q8K;
    type CandleAct = BlockQ8K;
    const MINS: bool = false;
    const GROUPED: bool = false;

    fn lanes(w: &Self, a: &Q8K) -> [i32; LANES] {
        let mut l = [0i32; LANES];
        for e in 0..256 {
            let (n, r) = (e / 128, e % 128);
            let (quarter, i) = (r / 32, r % 32);
            let low = match quarter {
                0 => w.ql[64 * n + i] & 0xF,
                1 => w.ql[64 * n + 32 + i] & 0xF,
                2 => w.ql[64 * n + i] >> 4,
                _ => w.ql[64 * n + 32 + i] >> 4,
            };
            let high = (w.qh[32 * n + i] >> (2 * quarter)) & 3;
            let q = (low | (high << 4)) as i32 - 32;
            l[(e % 32) / 4] += w.scales[e / 16] as i32 * q * a.qs[e] as i32;
        }
        l
    }

    #[inline(always)]
    fn scale<H: Halves>(w: &Self, a: &Q8K, h: H) -> f32 {
        a.d * h.f32(w.d)
    }
}

/// `y [t, rows] = x [t, cols] · W^T` for the `[rows, cols]` matrix of candle's blocks `w` (row
/// after row, `cols / 32` or `cols / 256` blocks each), `x` and `y` row-major f32, in the module
/// docs' order: each row of `x` quantized to `K::Act`, then the dot products.
pub(crate) fn matmul<K: Kernel>(
    w: &[K::Candle],
    rows: usize,
    cols: usize,
    x: &[f32],
    t: usize,
    y: &mut [f32],
) {
    let per_row = cols / K::Candle::BLCK_SIZE;
    debug_assert_eq!(w.len(), rows * per_row);
    // SAFETY: `K` is the mirror of `K::Candle` (the `same_layout` assertions).
    let w: &[K] = unsafe { view(w) };
    let acts = quantize_rows::<K>(x, t, cols);
    #[cfg(target_arch = "x86_64")]
    let simd = crate::models::matmul::avx2();
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    let (acts, aux) = if simd {
        let acts = if grouped_layout::<K>(t) {
            let g = grouped(&acts, t, per_row);
            drop(acts);
            g
        } else {
            acts
        };
        let aux = ActAux::new::<K>(&acts);
        (acts, Some(aux))
    } else {
        (acts, None)
    };
    by_tasks(
        rows,
        cols,
        x,
        t,
        y,
        || (),
        |_, r0, n, out| {
            let w = &w[r0 * per_row..(r0 + n) * per_row];
            // SAFETY: the task writes columns r0..r0 + n of `y` only (`by_tasks`); `aux` only
            // when `avx2` found AVX2, FMA and F16C.
            unsafe { rows_kernel::<K>(w, n, per_row, &acts, aux.as_ref(), t, out) };
        },
    );
}

/// The `t` rows of `x` (`cols` each) quantized to `K::Act` by candle's `from_float`, row after
/// row (`cols / block` blocks each). A block of activations with a NaN gets a NaN scale, so
/// the NaN reaches every output of its row as it would in exact arithmetic (`from_float` alone
/// takes the maximum magnitude with `f32::max`, which skips NaNs, and turns the NaN into a 0).
fn quantize_rows<K: Kernel>(x: &[f32], t: usize, cols: usize) -> Vec<K::Act> {
    let block = K::CandleAct::BLCK_SIZE;
    let per_row = cols / block;
    let blocks = vec![K::CandleAct::zeros(); t * per_row];
    // The same allocation as our mirror type, not a copy.
    let mut blocks = std::mem::ManuallyDrop::new(blocks);
    debug_assert!(same_layout::<K::CandleAct, K::Act>());
    // SAFETY: `K::Act` is the mirror of `K::CandleAct` (Q8_0 of BlockQ8_0, Q8K of BlockQ8K:
    // the same size and alignment, asserted at compile time, both plain old data), so the
    // allocation's layout is the same; `blocks` is not dropped.
    let mut acts: Vec<K::Act> = unsafe {
        Vec::from_raw_parts(
            blocks.as_mut_ptr().cast::<K::Act>(),
            blocks.len(),
            blocks.capacity(),
        )
    };
    if per_row > 0 {
        for (xs, ys) in x.chunks_exact(cols).zip(acts.chunks_exact_mut(per_row)) {
            K::quantize_row(xs, ys);
        }
    }
    acts
}

/// candle's `from_float` of one activation row into `ys` (`xs.len() / block` blocks), then
/// each block with a NaN poisoned ([`quantize_rows`]).
fn from_float_poisoned<K: Kernel>(xs: &[f32], ys: &mut [K::Act]) {
    // SAFETY: `K::CandleAct` is `K::Act`'s mirror (the `same_layout` assertions), plain old
    // data valid for every bit pattern.
    let c: &mut [K::CandleAct] =
        unsafe { std::slice::from_raw_parts_mut(ys.as_mut_ptr().cast(), ys.len()) };
    K::CandleAct::from_float(xs, c);
    for (xs, a) in xs.chunks_exact(K::CandleAct::BLCK_SIZE).zip(ys) {
        if xs.iter().any(|v| v.is_nan()) {
            a.poison();
        }
    }
}

/// [`quantize_rows`] of one row for Q8_0 and Q4_0: AVX2 (`x86::quantize_q8_0`, the same bits
/// as candle's `BlockQ8_0::from_float`) or candle's.
fn quantize_row_q8_0(xs: &[f32], ys: &mut [Q8_0]) {
    #[cfg(target_arch = "x86_64")]
    if crate::models::matmul::avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (`avx2`).
        return unsafe { x86::quantize_q8_0(xs, ys) };
    }
    from_float_poisoned::<Q8_0>(xs, ys)
}

/// Activation rows in each tile's group of [`ACT_GROUP`]: block `b` of row `s` at
/// [`grouped_at`]`(s, b, per_row)`, so a tile of up to `ACT_GROUP` rows of one group reads its
/// activation blocks (and their `ActAux` entries) as one sequential stream rather than one
/// per row. The last group is padded to `ACT_GROUP` rows with copies of a block (never read).
fn grouped<A: Copy>(acts: &[A], t: usize, per_row: usize) -> Vec<A> {
    let Some(&fill) = acts.first() else {
        return Vec::new();
    };
    let mut out = vec![fill; t.div_ceil(ACT_GROUP) * ACT_GROUP * per_row];
    for (s, row) in acts.chunks_exact(per_row).enumerate() {
        for (b, &a) in row.iter().enumerate() {
            out[grouped_at(s, b, per_row)] = a;
        }
    }
    out
}

/// Whether the AVX2 kernels read `t` activation rows of `K` in [`grouped`]'s layout: for
/// prefill (more than [`SMALL_BATCH`] rows) of the types that ask for it (`Kernel::GROUPED`).
/// Decode keeps each row's blocks side by side: padded to a group, one row's blocks would sit
/// 4 blocks apart (Q4_0 decode measured 15% slower so).
fn grouped_layout<K: Kernel>(t: usize) -> bool {
    K::GROUPED && t > SMALL_BATCH
}

/// Rows of the activations' groups ([`grouped`]): the AVX2 tiles' activation rows.
const ACT_GROUP: usize = 4;

/// The index of block `b` of activation row `s` in [`grouped`]'s layout (`per_row` blocks a
/// row): the groups one after another, in each the rows' blocks `b` side by side.
#[inline(always)]
fn grouped_at(s: usize, b: usize, per_row: usize) -> usize {
    ((s / ACT_GROUP) * per_row + b) * ACT_GROUP + s % ACT_GROUP
}

/// `y[s, out.col0 + r] = dot(w row r, activation row s)` for the `n` weight rows of `w` and the
/// `t` activation rows of `a` (`per_row` blocks each): on AVX2 when `aux` is given (`a` then
/// in [`grouped`]'s layout when [`grouped_layout`], `aux` its `ActAux`), else portable (`a`
/// row after row).
///
/// # Safety
/// As `crate::models::matmul`'s `rows_kernel`: `out` holds `t` rows of `out.stride >=
/// out.col0 + n` values, and no other thread writes columns `out.col0..out.col0 + n`; with
/// `aux`, the CPU has AVX2, FMA and F16C.
unsafe fn rows_kernel<K: Kernel>(
    w: &[K],
    n: usize,
    per_row: usize,
    a: &[K::Act],
    aux: Option<&ActAux>,
    t: usize,
    out: Out,
) {
    debug_assert!(w.len() >= n * per_row && a.len() >= t * per_row);
    #[cfg(target_arch = "x86_64")]
    if let Some(aux) = aux {
        // SAFETY: the CPU has AVX2, FMA and F16C (the caller's); the lengths are the caller's.
        debug_assert_eq!(aux.d.len(), a.len());
        debug_assert_eq!(aux.sums8.len(), if K::SUMS8 { a.len() } else { 0 });
        return K::avx2_rows(w, n, per_row, a, aux, t, out);
    }
    let _ = aux;
    for s in 0..t {
        let xs = &a[s * per_row..(s + 1) * per_row];
        for r in 0..n {
            *out.ptr.add(s * out.stride + out.col0 + r) =
                dot_portable(&w[r * per_row..(r + 1) * per_row], xs);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{grouped_at, grouped_layout, ACT_GROUP, LANES, TOKEN_BLOCK};
    use super::{ActAux, ActBlock, Halves, Kernel, Out, Q4K, Q4_0, Q6K, Q8K, Q8_0, SMALL_BATCH};
    use crate::models::matmul::x86::finish;

    /// The f32 value of every f16 (256 KiB), for the scales of Q8_0 and Q4_0 blocks (weights
    /// and activations): one load per block (ggml's `ggml_table_f32_f16`). F16C's
    /// `vcvtph2ps` of a scalar measured up to 1.7x slower there: LLVM loads the 16 bits with
    /// `vpinsrw` into a register's old value, a dependency from one block to the next.
    fn table() -> &'static [f32; 65536] {
        static TABLE: std::sync::OnceLock<Box<[f32; 65536]>> = std::sync::OnceLock::new();
        TABLE.get_or_init(|| {
            let mut t = Box::new([0f32; 65536]);
            for (bits, v) in t.iter_mut().enumerate() {
                *v = half::f16::from_bits(bits as u16).to_f32();
            }
            t
        })
    }

    /// F16C's conversion of a scalar f16: for the super-blocks' scales, where it measured
    /// faster than the table (one or two per 256 weights, off the critical path).
    ///
    /// # Safety
    /// The CPU has F16C.
    #[inline(always)]
    unsafe fn f16c(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits as i16)))
    }

    /// The table's conversion of an f16 to f32 (`table`), fetched once per product (named
    /// for the CPUs it runs on: the kernels that hold one also use F16C directly, `f16c`).
    #[derive(Clone, Copy)]
    pub(super) struct F16c(&'static [f32; 65536]);

    impl F16c {
        pub(super) fn new() -> Self {
            Self(table())
        }
    }

    impl Halves for F16c {
        #[inline(always)]
        fn f32(self, bits: u16) -> f32 {
            self.0[bits as usize]
        }
    }

    /// candle's `BlockQ8_0::from_float` of one row, bit for bit, on AVX2, each block with a
    /// NaN poisoned (`quantize_rows`): `amax` the largest `|x|` (NaNs skipped, as `f32::max`
    /// does), `d = amax / 127` stored as f16, `q = round(x / d)` (rounded half away from zero
    /// as `f32::round`, then saturated as `as i8`: NaN 0, ±inf ±127/-128) with `x` times
    /// `1 / d` (0 when `d` is 0).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_q8_0(xs: &[f32], ys: &mut [Q8_0]) {
        assert_eq!(xs.len(), ys.len() * 32, "a row of whole blocks");
        let sign = _mm256_set1_ps(-0.0);
        for (xs, y) in xs.chunks_exact(32).zip(ys.iter_mut()) {
            // Loops, not closures (`array::from_fn`), as in `tile`.
            let mut v = [_mm256_setzero_ps(); 4];
            for (i, v) in v.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(xs.as_ptr().add(8 * i));
            }
            // max(|x|, acc) keeps acc when |x| is NaN (the second operand on unordered).
            let mut m = _mm256_setzero_ps();
            let mut nan = _mm256_setzero_ps();
            for &x in &v {
                m = _mm256_max_ps(_mm256_andnot_ps(sign, x), m);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            y.d = half::f16::from_f32(d).to_bits();
            let idv = _mm256_set1_ps(id);
            let mut q = [_mm256_setzero_si256(); 4];
            for (q, &x) in q.iter_mut().zip(&v) {
                let x = _mm256_mul_ps(x, idv);
                let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(x);
                // |x - t| >= 0.5: one more away from zero (`x - t` is exact).
                let up = _mm256_cmp_ps::<_CMP_GE_OQ>(
                    _mm256_andnot_ps(sign, _mm256_sub_ps(x, t)),
                    _mm256_set1_ps(0.5),
                );
                let one = _mm256_or_ps(_mm256_and_ps(x, sign), _mm256_set1_ps(1.0));
                let r = _mm256_add_ps(t, _mm256_and_ps(up, one));
                // NaN to 0, then saturated to i8.
                let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
                let r = _mm256_min_ps(
                    _mm256_max_ps(r, _mm256_set1_ps(-128.0)),
                    _mm256_set1_ps(127.0),
                );
                *q = _mm256_cvtps_epi32(r);
            }
            // Packs interleave the 128-bit halves; the permutation puts the 32 back in order.
            let p = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(y.qs.as_mut_ptr().cast(), p);
            if _mm256_movemask_ps(nan) != 0 {
                y.poison();
            }
        }
    }

    /// A [`Kernel`] on AVX2: a block is `CHUNKS` chunks of 32 elements; the integer lanes of a
    /// block pair are the sum over its chunks of `dot(chunk(w, c), a's chunk c)`, exactly
    /// `Kernel::lanes`.
    pub(super) trait Avx2: Kernel {
        /// Chunks of 32 elements per block (1, or 8 for the super-blocks of 256).
        const CHUNKS: usize;
        /// How far ahead of the block being read to prefetch each weight row, in bytes (0:
        /// not at all). The weights of a mapped file sit in 4 KiB pages, where the hardware
        /// prefetchers stop at each page's end: 1 KiB ahead measured 10% (Q8_0) and 5% (Q4_0)
        /// faster decode on the 0.85 B model, and 13% slower on Q4_K_M, whose super-blocks
        /// are read with more work per byte.
        const PREFETCH: usize;
        /// Weight rows of a prefill tile (2 or 3; measured per type).
        const PM: usize = 2;
        /// The weight block's scalars, unpacked once per block and tile.
        type Prep: Copy;
        /// A weight chunk unpacked into registers.
        type Chunk: Copy;

        /// The weight block's scalars.
        unsafe fn prep(w: &Self, h: super::x86::F16c) -> Self::Prep;
        /// Chunk `c` of the weight block.
        unsafe fn chunk(w: &Self, p: &Self::Prep, c: usize) -> Self::Chunk;
        /// The 8 integer lanes of chunk `c` of a weight block and of an activation block
        /// (`sums8`: the activation block's `ActAux::sums8` entry when `Kernel::SUMS8`,
        /// else dangling).
        unsafe fn dot(
            w: &Self::Chunk,
            a: &Self::Act,
            sums8: *const [i32; LANES],
            c: usize,
        ) -> __m256i;
        /// The weight block's factor of [`Kernel::scale`] from the prepared scalars: the
        /// scale is this times the activation block's (`ActAux::d`), multiplied in f32.
        unsafe fn wd(p: &Self::Prep) -> f32;
        /// [`Kernel::mins`] from the prepared scalars (Q4_K).
        unsafe fn mins_p(_p: &Self::Prep, _a: &Self::Act) -> (f32, i32) {
            (0.0, 0)
        }
    }

    /// The lanes of 4 products each of two vectors of 32 signed bytes, `|w| <= 128` in `abs`
    /// with its signs in `w`, `|a| <= 127`: the pair sums of `maddubs` stay within i16.
    #[inline(always)]
    unsafe fn signed(abs: __m256i, w: __m256i, a: __m256i) -> __m256i {
        _mm256_madd_epi16(
            _mm256_maddubs_epi16(abs, _mm256_sign_epi8(a, w)),
            _mm256_set1_epi16(1),
        )
    }

    impl Avx2 for Q8_0 {
        const CHUNKS: usize = 1;
        const PREFETCH: usize = 1024;
        type Prep = f32;
        type Chunk = (__m256i, __m256i);

        #[inline(always)]
        unsafe fn prep(w: &Self, h: F16c) -> f32 {
            h.f32(w.d)
        }
        #[inline(always)]
        unsafe fn chunk(w: &Self, _: &f32, _: usize) -> (__m256i, __m256i) {
            let q = _mm256_loadu_si256(w.qs.as_ptr().cast());
            (_mm256_sign_epi8(q, q), q)
        }
        #[inline(always)]
        unsafe fn dot(w: &(__m256i, __m256i), a: &Q8_0, _: *const [i32; 8], _: usize) -> __m256i {
            signed(w.0, w.1, _mm256_loadu_si256(a.qs.as_ptr().cast()))
        }
        #[inline(always)]
        unsafe fn wd(p: &f32) -> f32 {
            *p
        }
    }

    impl Avx2 for Q4_0 {
        const CHUNKS: usize = 1;
        const PREFETCH: usize = 1024;
        const PM: usize = 3;
        type Prep = f32;
        type Chunk = __m256i;

        #[inline(always)]
        unsafe fn prep(w: &Self, h: F16c) -> f32 {
            h.f32(w.d)
        }
        /// The 32 quants `q` (0 to 15, not yet minus 8) as bytes in order.
        #[inline(always)]
        unsafe fn chunk(w: &Self, _: &f32, _: usize) -> __m256i {
            let packed = _mm_loadu_si128(w.qs.as_ptr().cast());
            _mm256_and_si256(
                _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed),
                _mm256_set1_epi8(0xF),
            )
        }
        /// `Σ (q - 8) · a` per lane as `Σ q · a - 8 · Σ a`, the activation's `8 · Σ a` from
        /// `sums8`.
        #[inline(always)]
        unsafe fn dot(w: &__m256i, a: &Q8_0, sums8: *const [i32; 8], _: usize) -> __m256i {
            let qa = _mm256_loadu_si256(a.qs.as_ptr().cast());
            _mm256_sub_epi32(
                _mm256_madd_epi16(_mm256_maddubs_epi16(*w, qa), _mm256_set1_epi16(1)),
                _mm256_loadu_si256(sums8.cast()),
            )
        }
        #[inline(always)]
        unsafe fn wd(p: &f32) -> f32 {
            *p
        }
    }

    /// Q4_K's scalars: `d`, `dmin` as f32, the 8 scales and the 8 minimums.
    #[derive(Clone, Copy)]
    pub(super) struct Q4KPrep {
        d: f32,
        dmin: f32,
        scales: __m128i,
        mins: __m128i,
    }

    impl Avx2 for Q4K {
        const CHUNKS: usize = 8;
        const PREFETCH: usize = 0;
        type Prep = Q4KPrep;
        type Chunk = (__m256i, __m256i);

        #[inline(always)]
        unsafe fn prep(w: &Self, h: F16c) -> Q4KPrep {
            // `scale_min_k4` for all 8 sub-blocks at once, in 32-bit words (ggml's AVX2
            // `vec_dot_q4_K_q8_K`): bytes 0..8 the scales, 8..16 the minimums.
            const K1: u32 = 0x3f3f_3f3f;
            const K2: u32 = 0x0f0f_0f0f;
            const K3: u32 = 0x0303_0303;
            let s = &w.scales;
            let word =
                |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
            let (u0, u1, u2) = (word(0), word(1), word(2));
            let u = [
                u0 & K1,
                (u2 & K2) | (((u0 >> 6) & K3) << 4),
                u1 & K1,
                ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4),
            ];
            let v = _mm_set_epi32(u[3] as i32, u[2] as i32, u[1] as i32, u[0] as i32);
            let _ = h;
            Q4KPrep {
                d: f16c(w.d),
                dmin: f16c(w.dmin),
                scales: _mm_cvtepu8_epi16(v),
                mins: _mm_cvtepu8_epi16(_mm_unpackhi_epi64(v, v)),
            }
        }
        #[inline(always)]
        unsafe fn chunk(w: &Self, p: &Q4KPrep, c: usize) -> (__m256i, __m256i) {
            let q = _mm256_loadu_si256(w.qs.as_ptr().add(32 * (c / 2)).cast());
            let q = _mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (c % 2) as i32));
            // The scale of sub-block `c` in every 16-bit lane.
            let sc = _mm_shuffle_epi8(p.scales, _mm_set1_epi16(0x0100 + 0x0202 * c as i16));
            (
                _mm256_and_si256(q, _mm256_set1_epi8(0xF)),
                _mm256_broadcastsi128_si256(sc),
            )
        }
        #[inline(always)]
        unsafe fn dot(w: &(__m256i, __m256i), a: &Q8K, _: *const [i32; 8], c: usize) -> __m256i {
            let qa = _mm256_loadu_si256(a.qs.as_ptr().add(32 * c).cast());
            _mm256_madd_epi16(_mm256_maddubs_epi16(w.0, qa), w.1)
        }
        #[inline(always)]
        unsafe fn wd(p: &Q4KPrep) -> f32 {
            p.d
        }
        #[inline(always)]
        unsafe fn mins_p(p: &Q4KPrep, a: &Q8K) -> (f32, i32) {
            // Σ_j min_j · (bsum_2j + bsum_2j+1): exact in i16 pairs (|bsum| <= 2048) and i32.
            let lo = _mm_loadu_si128(a.bsums.as_ptr().cast());
            let hi = _mm_loadu_si128(a.bsums.as_ptr().add(8).cast());
            let v = _mm_madd_epi16(_mm_hadd_epi16(lo, hi), p.mins);
            let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
            let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v));
            (-(a.d * p.dmin), _mm_cvtsi128_si32(v))
        }
    }

    impl Avx2 for Q6K {
        const CHUNKS: usize = 8;
        const PREFETCH: usize = 0;
        type Prep = f32;
        type Chunk = (__m256i, __m256i);

        #[inline(always)]
        unsafe fn prep(w: &Self, h: F16c) -> f32 {
            {
                let _ = h;
                f16c(w.d)
            }
        }
        #[inline(always)]
        unsafe fn chunk(w: &Self, _: &f32, c: usize) -> (__m256i, __m256i) {
            let (n, k) = (c / 4, c % 4);
            let ql = _mm256_loadu_si256(w.ql.as_ptr().add(64 * n + 32 * (k % 2)).cast());
            let qh = _mm256_loadu_si256(w.qh.as_ptr().add(32 * n).cast());
            // Shifts by a count in a register, not branches on `k`: the same code for every
            // chunk whether or not the compiler unrolls the loop over them.
            let low = _mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (k / 2) as i32));
            let high = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32));
            let q = _mm256_or_si256(
                _mm256_and_si256(low, _mm256_set1_epi8(0xF)),
                _mm256_slli_epi16::<4>(_mm256_and_si256(high, _mm256_set1_epi8(3))),
            );
            let sc = _mm256_set_m128i(
                _mm_set1_epi16(w.scales[2 * c + 1] as i16),
                _mm_set1_epi16(w.scales[2 * c] as i16),
            );
            (q, sc)
        }
        #[inline(always)]
        unsafe fn dot(w: &(__m256i, __m256i), a: &Q8K, _: *const [i32; 8], c: usize) -> __m256i {
            let qa = _mm256_loadu_si256(a.qs.as_ptr().add(32 * c).cast());
            // (q - 32) · a in pairs: q · a - 32 · a, both within i16.
            let p = _mm256_sub_epi16(
                _mm256_maddubs_epi16(w.0, qa),
                _mm256_maddubs_epi16(_mm256_set1_epi8(32), qa),
            );
            _mm256_madd_epi16(p, w.1)
        }
        #[inline(always)]
        unsafe fn wd(p: &f32) -> f32 {
            *p
        }
    }

    /// The tile of weight rows `r0..r0 + RM` × activation rows `s0..s0 + RN`: per block, the
    /// weight blocks' scalars and chunks unpacked once for the `RN` activation rows, the
    /// integer lanes of each pair summed over the chunks, then each output's accumulator
    /// updated as `Kernel::lanes` / `dot_portable` do.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // index loops, not closures (see below)
    unsafe fn tile<K: Avx2, const RM: usize, const RN: usize, const G: bool>(
        w: &[K],
        per_row: usize,
        a: &[K::Act],
        aux: &ActAux,
        r0: usize,
        s0: usize,
        out: Out,
    ) {
        let h = F16c::new();
        // Block `b` of activation row `s0 + j` is at `g0 + step * b + j * next`: in one group
        // (`grouped`) or row after row.
        let (g0, step, next) = if G {
            debug_assert!(s0 % ACT_GROUP + RN <= ACT_GROUP);
            (grouped_at(s0, 0, per_row), ACT_GROUP, 1)
        } else {
            (s0 * per_row, 1, per_row)
        };
        // Wrapping: with no blocks (`per_row` 0) the slices are empty and `g0` may still be
        // `s0 % ACT_GROUP`; nothing is read then.
        let (wp, ap) = (w.as_ptr().add(r0 * per_row), a.as_ptr().wrapping_add(g0));
        let dp = aux.d.as_ptr().wrapping_add(g0);
        // Dangling (never read) unless `K::SUMS8`.
        let sp = aux.sums8.as_ptr().wrapping_add(g0);
        let mut acc = [[_mm256_setzero_ps(); RN]; RM];
        let mut m = [[0f32; RN]; RM];
        for b in 0..per_row {
            if K::PREFETCH > 0 {
                for i in 0..RM {
                    // Never dereferenced: a prefetch past the end is a hint, not an access.
                    let ahead = wp
                        .add(i * per_row + b)
                        .cast::<i8>()
                        .wrapping_add(K::PREFETCH);
                    _mm_prefetch::<_MM_HINT_T0>(ahead);
                }
            }
            // Loops, not closures (`array::from_fn`): a closure is a function of its own,
            // without this one's target features, and the intrinsics in it would not inline.
            let mut wb = [&*wp.add(b); RM];
            for i in 1..RM {
                wb[i] = &*wp.add(i * per_row + b);
            }
            let g = step * b;
            let mut ab = [&*ap.add(g); RN];
            let mut xd = [dp.add(g); RN];
            let mut xs = [sp.wrapping_add(g); RN];
            for j in 1..RN {
                ab[j] = &*ap.add(g + j * next);
                xd[j] = dp.add(g + j * next);
                xs[j] = sp.wrapping_add(g + j * next);
            }
            let mut prep = [K::prep(wb[0], h); RM];
            for i in 1..RM {
                prep[i] = K::prep(wb[i], h);
            }
            // One chunk (Q8_0, Q4_0) and a whole group of activation rows: each pair's lanes
            // go to its accumulator as soon as they are summed, the same operations as below
            // in an order that keeps fewer registers live (below, all the pairs' lanes are
            // held first, and LLVM spilled accumulators to the stack): Q8_0 prefill tiles
            // measured 5% faster in isolation, Q4_0 2%.
            if K::CHUNKS == 1 && !K::MINS && G && RN == ACT_GROUP {
                let mut chunks = [K::chunk(wb[0], &prep[0], 0); RM];
                for i in 1..RM {
                    chunks[i] = K::chunk(wb[i], &prep[i], 0);
                }
                let d4 = _mm_loadu_ps(xd[0]);
                let d8 = _mm256_set_m128(d4, d4);
                let mut s8 = [_mm256_setzero_ps(); RM];
                for i in 0..RM {
                    s8[i] = _mm256_mul_ps(_mm256_set1_ps(K::wd(&prep[i])), d8);
                }
                for j in 0..RN {
                    for i in 0..RM {
                        let l = K::dot(&chunks[i], ab[j], xs[j], 0);
                        let s = match j {
                            0 => _mm256_shuffle_ps::<0x00>(s8[i], s8[i]),
                            1 => _mm256_shuffle_ps::<0x55>(s8[i], s8[i]),
                            2 => _mm256_shuffle_ps::<0xAA>(s8[i], s8[i]),
                            _ => _mm256_shuffle_ps::<0xFF>(s8[i], s8[i]),
                        };
                        acc[i][j] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(l), acc[i][j]);
                    }
                }
                continue;
            }
            let mut lanes = [[_mm256_setzero_si256(); RN]; RM];
            for c in 0..K::CHUNKS {
                let mut chunks = [K::chunk(wb[0], &prep[0], c); RM];
                for i in 1..RM {
                    chunks[i] = K::chunk(wb[i], &prep[i], c);
                }
                for j in 0..RN {
                    for i in 0..RM {
                        lanes[i][j] =
                            _mm256_add_epi32(lanes[i][j], K::dot(&chunks[i], ab[j], xs[j], c));
                    }
                }
            }
            // The 4 activation scales side by side (a whole group), for 4 products at once.
            let four = G && RN == ACT_GROUP;
            let d8 = if four {
                // Unaligned: a load, not a reference to an `__m128` (16-byte alignment).
                let d4 = _mm_loadu_ps(xd[0]);
                _mm256_set_m128(d4, d4)
            } else {
                _mm256_setzero_ps()
            };
            for i in 0..RM {
                let wd = _mm256_set1_ps(K::wd(&prep[i]));
                // The scale `d_w · d_x` (either order: one rounding of the same product), 4 at
                // a time, then each in all 8 lanes.
                let s8 = _mm256_mul_ps(wd, d8);
                let sj = [
                    _mm256_shuffle_ps::<0x00>(s8, s8),
                    _mm256_shuffle_ps::<0x55>(s8, s8),
                    _mm256_shuffle_ps::<0xAA>(s8, s8),
                    _mm256_shuffle_ps::<0xFF>(s8, s8),
                ];
                for j in 0..RN {
                    let s = if four {
                        sj[j]
                    } else {
                        _mm256_mul_ps(wd, _mm256_broadcast_ss(&*xd[j]))
                    };
                    acc[i][j] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(lanes[i][j]), acc[i][j]);
                    if K::MINS {
                        let (c, mb) = K::mins_p(&prep[i], ab[j]);
                        m[i][j] = c.mul_add(mb as f32, m[i][j]);
                    }
                }
            }
        }
        let _ = LANES;
        for i in 0..RM {
            for j in 0..RN {
                *out.ptr.add((s0 + j) * out.stride + out.col0 + r0 + i) =
                    finish(acc[i][j], m[i][j]);
            }
        }
    }

    /// Tiles of `RM` rows from `r0` over activation rows `s0..s1`, `RN` at a time (then one at
    /// a time).
    #[inline(always)]
    unsafe fn tiles<K: Avx2, const RM: usize, const RN: usize, const G: bool>(
        w: &[K],
        per_row: usize,
        a: &[K::Act],
        aux: &ActAux,
        r0: usize,
        (s0, s1): (usize, usize),
        out: Out,
    ) {
        let mut s = s0;
        while s + RN <= s1 {
            tile::<K, RM, RN, G>(w, per_row, a, aux, r0, s, out);
            s += RN;
        }
        while s < s1 {
            tile::<K, RM, 1, G>(w, per_row, a, aux, r0, s, out);
            s += 1;
        }
    }

    /// `super::rows_kernel` on AVX2: one weight row at a time for at most `SMALL_BATCH`
    /// activation rows (decode: the weights read in one sequential stream, up to 4 activation
    /// rows per tile), tiles of `Avx2::PM` weight rows × `ACT_GROUP` activation rows in blocks
    /// of `TOKEN_BLOCK` beyond (prefill); the rows left over one at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_kernel<K: Avx2>(
        w: &[K],
        n: usize,
        per_row: usize,
        a: &[K::Act],
        aux: &ActAux,
        t: usize,
        out: Out,
    ) {
        match (K::PM, grouped_layout::<K>(t)) {
            (3, true) => rows_pm::<K, 3, true>(w, n, per_row, a, aux, t, out),
            (3, false) => rows_pm::<K, 3, false>(w, n, per_row, a, aux, t, out),
            (_, true) => rows_pm::<K, 2, true>(w, n, per_row, a, aux, t, out),
            (_, false) => rows_pm::<K, 2, false>(w, n, per_row, a, aux, t, out),
        }
    }

    /// `rows_kernel` with prefill tiles of `PM` weight rows, the activations grouped (`G`,
    /// `grouped_layout`) or row after row (a function of its own per variant: inlining them
    /// all into `rows_kernel` measured slower code for the types with `PM = 2`).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_pm<K: Avx2, const PM: usize, const G: bool>(
        w: &[K],
        n: usize,
        per_row: usize,
        a: &[K::Act],
        aux: &ActAux,
        t: usize,
        out: Out,
    ) {
        const PN: usize = ACT_GROUP;
        const _: () = assert!(TOKEN_BLOCK.is_multiple_of(ACT_GROUP));

        if t <= SMALL_BATCH {
            for r in 0..n {
                tiles::<K, 1, ACT_GROUP, false>(w, per_row, a, aux, r, (0, t), out);
            }
            return;
        }
        let full = n - n % PM;
        let mut s0 = 0;
        while s0 < t {
            let span = (s0, (s0 + TOKEN_BLOCK).min(t));
            let mut r = 0;
            while r < full {
                tiles::<K, PM, PN, G>(w, per_row, a, aux, r, span, out);
                r += PM;
            }
            while r < n {
                tiles::<K, 1, PN, G>(w, per_row, a, aux, r, span, out);
                r += 1;
            }
            s0 = span.1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::matmul::tests::next;

    /// A xorshift byte.
    fn byte(state: &mut u64) -> u8 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        (*state >> 24) as u8
    }

    /// `n` blocks of `K` with every byte random (every quant and scale bit pattern, Q8_0's
    /// -128 included), then `d` (and `dmin`) set to finite f16 values of 2^-12 to 2^-4.
    fn raw_blocks<K: Kernel>(n: usize, seed: u64, fix: impl Fn(&mut K, u16, u16)) -> Vec<K> {
        let mut s = seed | 1;
        let size = std::mem::size_of::<K>();
        let mut bytes = vec![0u8; n * size];
        bytes.iter_mut().for_each(|b| *b = byte(&mut s));
        let mut blocks: Vec<K> = (0..n)
            // SAFETY: the block types are plain old data, valid for every bit pattern.
            .map(|i| unsafe { std::ptr::read_unaligned(bytes[i * size..].as_ptr().cast::<K>()) })
            .collect();
        for b in &mut blocks {
            let scale = |s: &mut u64| {
                let e = -12 + (byte(s) % 9) as i32;
                let m = 1.0 + byte(s) as f32 / 256.0;
                half::f16::from_f32(m * 2f32.powi(e)).to_bits()
            };
            let (d, dmin) = (scale(&mut s), scale(&mut s));
            fix(b, d, dmin);
        }
        blocks
    }

    fn q8_0s(n: usize, seed: u64) -> Vec<Q8_0> {
        raw_blocks(n, seed, |b: &mut Q8_0, d, _| b.d = d)
    }
    fn q4_0s(n: usize, seed: u64) -> Vec<Q4_0> {
        raw_blocks(n, seed, |b: &mut Q4_0, d, _| b.d = d)
    }
    fn q4ks(n: usize, seed: u64) -> Vec<Q4K> {
        raw_blocks(n, seed, |b: &mut Q4K, d, dmin| {
            b.d = d;
            b.dmin = dmin;
        })
    }
    fn q6ks(n: usize, seed: u64) -> Vec<Q6K> {
        raw_blocks(n, seed, |b: &mut Q6K, d, _| b.d = d)
    }

    /// Activations with a spread of magnitudes (some rows of 1e-3, some of 1e2).
    fn activations(t: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..t * cols)
            .map(|i| {
                let scale = [1.0, 1e-3, 1e2][(i / cols) % 3];
                next(&mut s) * scale
            })
            .collect()
    }

    /// Our blocks as candle's, dequantized by candle (`to_float`).
    fn dequantized<K: Kernel>(w: &[K]) -> Vec<f32> {
        // SAFETY: `K::Candle` is `K`'s mirror.
        let c: &[K::Candle] = unsafe { view(w) };
        let mut out = vec![0f32; c.len() * K::Candle::BLCK_SIZE];
        K::Candle::to_float(c, &mut out);
        out
    }

    /// The activation blocks dequantized by candle.
    fn dequantized_acts<K: Kernel>(a: &[K::Act]) -> Vec<f32> {
        // SAFETY: `K::CandleAct` is `K::Act`'s mirror.
        let c: &[K::CandleAct] = unsafe { view(a) };
        let mut out = vec![0f32; c.len() * K::CandleAct::BLCK_SIZE];
        K::CandleAct::to_float(c, &mut out);
        out
    }

    /// For `rows` random weight rows and `t` activation rows: every output of `matmul` equals
    /// the portable dot product bit for bit (every tile, edge and batch size gives the same
    /// bits), equals the output of the same activation row multiplied alone (batch
    /// invariance), and is within f32 rounding of candle's dequantize-then-multiply in f64 of
    /// the same blocks and the same quantized activations.
    fn check<K: Kernel>(w: &[K], rows: usize, t: usize, seed: u64) {
        let per_row = w.len() / rows;
        let cols = per_row * K::Candle::BLCK_SIZE;
        let x = activations(t, cols, seed);
        // SAFETY: `K::Candle` is `K`'s mirror.
        let cw: &[K::Candle] = unsafe { view(w) };
        let mut y = vec![f32::NAN; t * rows];
        matmul::<K>(cw, rows, cols, &x, t, &mut y);
        let acts = quantize_rows::<K>(&x, t, cols);
        let wf = dequantized(w);
        let af = dequantized_acts::<K>(&acts);
        for i in 0..t {
            let a = &acts[i * per_row..(i + 1) * per_row];
            let mut alone = vec![f32::NAN; rows];
            matmul::<K>(cw, rows, cols, &x[i * cols..(i + 1) * cols], 1, &mut alone);
            let xs = &af[i * cols..(i + 1) * cols];
            for r in 0..rows {
                let got = y[i * rows + r];
                let want = dot_portable(&w[r * per_row..(r + 1) * per_row], a);
                let what = format!(
                    "{} [{rows}x{cols}] t={t} ({i},{r})",
                    std::any::type_name::<K>()
                );
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{what}: {got} vs portable {want}"
                );
                assert_eq!(got.to_bits(), alone[r].to_bits(), "{what}: batch vs alone");
                let ws = &wf[r * cols..(r + 1) * cols];
                let exact: f64 = ws.iter().zip(xs).map(|(&w, &x)| w as f64 * x as f64).sum();
                let wmax = ws.iter().fold(0f64, |m, w| m.max(w.abs() as f64));
                let scale: f64 = xs.iter().map(|x| x.abs() as f64 * 4.0 * wmax).sum();
                assert!(
                    (got as f64 - exact).abs() <= 1e-5 * scale + 1e-30,
                    "{what}: {got} vs f64 {exact} (scale {scale})"
                );
            }
        }
    }

    fn check_all(rows: usize, blocks32: usize, blocks256: usize, t: usize, seed: u64) {
        check(&q8_0s(rows * blocks32, seed), rows, t, seed + 1);
        check(&q4_0s(rows * blocks32, seed + 2), rows, t, seed + 3);
        check(&q4ks(rows * blocks256, seed + 4), rows, t, seed + 5);
        check(&q6ks(rows * blocks256, seed + 6), rows, t, seed + 7);
    }

    /// Every tile and edge: 1 to 9 rows (4-row tiles and the rows left over), a task's 48 and
    /// more, one block or several per row, batches of 1, 2, 3 (one 4 × 3 tile), the decode limit
    /// 8, 9 and 13 (prefill tiles and their edges) and 61 and 64 (past a block of 60 rows).
    #[test]
    fn every_tile_and_batch_gives_the_portable_bits_within_rounding_of_candle() {
        let mut seed = 1;
        for rows in [1, 2, 3, 4, 5, 7, 9, 48, 53] {
            for (b32, b256) in [(1, 1), (3, 2)] {
                for t in [1, 2, 3, 8, 9, 13] {
                    check_all(rows, b32, b256, t, seed);
                    seed += 10;
                }
            }
        }
        for t in [61, 64] {
            check_all(11, 2, 1, t, seed);
            seed += 10;
        }
    }

    /// Real blocks (candle's quantization of random weights, not random bytes) behave the same.
    #[test]
    fn quantized_weights_give_the_portable_bits() {
        fn real<K: Kernel>(rows: usize, cols: usize, seed: u64) -> Vec<K> {
            let x = activations(rows, cols, seed);
            let per_row = cols / K::Candle::BLCK_SIZE;
            let mut c = vec![K::Candle::zeros(); rows * per_row];
            for (xs, ys) in x.chunks_exact(cols).zip(c.chunks_exact_mut(per_row)) {
                K::Candle::from_float(xs, ys);
            }
            // SAFETY: `K` is `K::Candle`'s mirror.
            unsafe { view::<K::Candle, K>(&c) }.to_vec()
        }
        check(&real::<Q8_0>(13, 96, 1), 13, 5, 2);
        check(&real::<Q4_0>(13, 96, 3), 13, 5, 4);
        check(&real::<Q4K>(6, 512, 5), 6, 10, 6);
        check(&real::<Q6K>(6, 512, 7), 6, 10, 8);
    }

    /// Worked by hand. Q8_0: weights `d = 1`, `qs = 1..=32`; activations `d = 0.5`, all `qs = 1`
    /// (`from_float` of 32 values 0.5 · 127 / 127... gives d = 0.5 / 127 and q = 127: set
    /// directly instead): lanes `L[l] = (4l+1) + .. + (4l+4) = 16l + 10`, the output
    /// `0.5 · (10 + 26 + .. + 122) = 0.5 · 528 = 264`. Q4_K: one super-block, `d = 1`,
    /// `dmin = 0.5`, every scale 1 and minimum 2 (`scales[0..4] = 1`, `[4..8] = 2`,
    /// `[8..12] = 0x21`), every quant 3; activations `d = 0.25`, every `q = 2`: each value is
    /// `1 · 1 · 3 - 0.5 · 2 = 2`, each product `2 · 0.5 = 1`, the sum 256; in the module's
    /// terms `0.25 · 1 · Σ 1 · 3 · 2 = 384` and `-(0.25 · 0.5) · Σ_j 2 · 64 = -128`.
    #[test]
    fn worked_cases() {
        let one = half::f16::from_f32(1.0).to_bits();
        let w = Q8_0 {
            d: one,
            qs: std::array::from_fn(|i| i as i8 + 1),
        };
        let a = Q8_0 {
            d: half::f16::from_f32(0.5).to_bits(),
            qs: [1; 32],
        };
        assert_eq!(
            Q8_0::lanes(&w, &a),
            std::array::from_fn(|l| 16 * l as i32 + 10)
        );
        assert_eq!(dot_portable(&[w], &[a]), 264.0);
        let w = Q4K {
            d: one,
            dmin: half::f16::from_f32(0.5).to_bits(),
            scales: [1, 1, 1, 1, 2, 2, 2, 2, 0x21, 0x21, 0x21, 0x21],
            qs: [0x33; 128],
        };
        let a = Q8K {
            d: 0.25,
            qs: [2; 256],
            bsums: [32; 16],
        };
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &w.scales), (1, 2), "sub-block {j}");
        }
        assert_eq!(Q4K::lanes(&w, &a), [8 * 4 * 3 * 2; 8]);
        assert_eq!(Q4K::mins(&w, &a, Soft), (-0.125, 8 * 2 * 64));
        assert_eq!(dot_portable(&[w], &[a]), 256.0);
        // The same through the dispatched kernel (AVX2 here where the CPU has it).
        // SAFETY: mirrors.
        let cw: &[BlockQ4K] = unsafe { view(std::slice::from_ref(&w)) };
        let mut y = [f32::NAN];
        // Activations whose Q8_K is 0.25 · 2 everywhere: 0.5 each (max 0.5 → d = 0.5 / -128
        // ... candle picks d = -max/128 with the sign of the max): checked against portable.
        let x = [0.5f32; 256];
        matmul::<Q4K>(cw, 1, 256, &x, 1, &mut y);
        let acts = quantize_rows::<Q4K>(&x, 1, 256);
        assert_eq!(y[0].to_bits(), dot_portable(&[w], &acts).to_bits());
    }

    /// The AVX2 Q8_0 quantizer gives candle's `from_float` bytes (then the NaN poisoning) for
    /// rows of every magnitude, ties (`x / d` exactly half-way, rounded away from zero), zero,
    /// subnormal, infinite and NaN values.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx2_quantizer_gives_candles_blocks() {
        if !crate::models::matmul::avx2() {
            return;
        }
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for (i, scale) in [1.0, 1e-3, 1e2, 1e-30, 1e-41, 3e38].into_iter().enumerate() {
            rows.push(
                activations(1, 256, i as u64 + 1)
                    .iter()
                    .map(|x| x * scale)
                    .collect(),
            );
        }
        // amax 127 · 2^k: d = 2^k, so x = (n + 0.5) · 2^k are exact ties.
        for k in [-3i32, 0, 5] {
            let u = 2f32.powi(k);
            let mut row: Vec<f32> = (0..64).map(|e| (e as f32 - 31.5) * u).collect();
            row[0] = 127.0 * u;
            row[32] = -127.0 * u;
            rows.push(row);
        }
        let mut special = vec![0f32; 96];
        special[33] = f32::INFINITY;
        special[40] = 1.0;
        special[70] = f32::NAN;
        special[71] = 2.0;
        rows.push(special);
        rows.push(vec![-0.0; 32]);
        for row in rows {
            let n = row.len() / 32;
            let mut fast = vec![Q8_0 { d: 0, qs: [0; 32] }; n];
            let mut slow = fast.clone();
            // SAFETY: the CPU has AVX2 (checked above).
            unsafe { x86::quantize_q8_0(&row, &mut fast) };
            from_float_poisoned::<Q8_0>(&row, &mut slow);
            for (b, (f, s)) in fast.iter().zip(&slow).enumerate() {
                assert_eq!(
                    (f.d, f.qs),
                    (s.d, s.qs),
                    "block {b} of {:?}",
                    &row[32 * b..32 * b + 32]
                );
            }
        }
    }

    /// Zero, empty and non-finite activations: zeros give exact zeros; the lengths of zero
    /// give nothing; a NaN in a row makes that row's outputs NaN and no other row's.
    #[test]
    fn zeros_and_nans_stay_in_their_row() {
        let w = q8_0s(3 * 2, 9);
        // SAFETY: mirrors.
        let cw: &[BlockQ8_0] = unsafe { view(&w) };
        let mut x = vec![0f32; 2 * 64];
        x[64 + 5] = f32::NAN;
        let mut y = vec![1f32; 6];
        matmul::<Q8_0>(cw, 3, 64, &x, 2, &mut y);
        assert_eq!(&y[..3], &[0.0; 3]);
        assert!(y[3..].iter().all(|v| v.is_nan()), "{y:?}");
        let mut empty: [f32; 0] = [];
        matmul::<Q8_0>(cw, 3, 64, &[], 0, &mut empty);
    }
}
