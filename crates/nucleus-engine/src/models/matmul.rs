//! The matrix products of the weights kept in their stored type: `y [t, rows] = x [t, cols] ·
//! W^T` for f32 activations `x` and a row-major `W [rows, cols]` of f16, bf16 or f32 values
//! ([`matmul`]). The quantized types' products are [`crate::models::qmatmul`]'s, which share
//! this module's task runner and final reduction.
//!
//! # One order per output, whatever the batch
//! Every output value `y[s, r]` is one dot product of weight row `r` and activation row `s`,
//! computed in one fixed order: 8 f32 lanes, lane `l` accumulating the products of the elements
//! `8 c + l` (`c = 0, 1, ..`) with fused multiply-adds, the lanes reduced as
//! `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))` (the AVX2 horizontal sum: halves, then
//! pairs), plus the row's tail (`cols mod 8` elements) accumulated in order from 0. Each weight
//! value is converted to f32 as it is read (exact: every f16 and bf16 value is an f32 value).
//! The order depends neither on `t` nor on the place of the row in the batch, nor on how the
//! kernels tile the product, nor on the thread count or the instruction set (AVX2 + FMA + F16C,
//! or portable Rust with `f32::mul_add`: bit-identical, unit-tested), so a sequence's logits
//! are the same alone, in any batch, in prefill and in decode, for these weights.
//!
//! # The kernels (x86-64 with AVX2, FMA and F16C)
//! Both keep one 8-lane accumulator per output in a register:
//! - `t <= SMALL_BATCH` (decode): tiles of 8 weight rows × 1 activation row. A decode step reads
//!   every weight once and is bound by memory; eight rows read at once are eight streams from
//!   memory instead of one, more cache-line fills in flight (llama.cpp's tinyBLAS reads 4:
//!   `ggml/src/ggml-cpu/llamafile/sgemm.cpp`, `tinyBLAS::gemm_bloc`; 4, 10 and 12 rows were
//!   tried, and 8 was the fastest here). On the 0.85 B random model, F16 decode went from
//!   0.90x llama.cpp's speed with one row at a time to 1.09x (BENCHMARKS.md, "Generation").
//! - `t > SMALL_BATCH` (prefill): tiles of 6 weight rows × 2 activation rows for f16, 4 × 3
//!   for bf16 and f32 (the faster of the two for each type here; 12 accumulators, the
//!   activation vectors and a weight vector within the 16 AVX2 registers), the rows of a task
//!   outermost and the activations in blocks of [`TOKEN_BLOCK`] rows, so the weights are read
//!   from memory once per block and the activations come from the caches. 0.87x to 0.91x
//!   the speed of the `gemm` crate on the same weights converted to f32 at load, without the
//!   f32 copy (BENCHMARKS.md, "Generation": prompt processing against the build before issue
//!   23).
//!   llama.cpp's tinyBLAS uses 4 × 3 tiles.
//!
//! Rows are split over rayon's pool (the process's thread count, [`crate::threads`]) in tasks
//! of [`TASK_ROWS`] rows; tasks write disjoint columns of `y`.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::__m256;
#[cfg(target_arch = "x86_64")]
use std::sync::OnceLock;

use rayon::prelude::*;

/// The most activation rows multiplied by the decode tiles (8 weight rows × 1 activation row);
/// more go through the prefill tiles (6 × 2). Both give the same bits (the module docs).
pub(crate) const SMALL_BATCH: usize = 8;

/// Weight rows per task (a multiple of both tiles' rows, 8 and 6).
pub(super) const TASK_ROWS: usize = 48;

/// Activation rows per block of the prefill tiles (a multiple of their 2 and 3 rows): 60 rows
/// of 5,632 f32 values are 1.3 MiB, read from the caches once per tile of weight rows.
pub(super) const TOKEN_BLOCK: usize = 60;

/// Lanes of each output's accumulator (one AVX2 register).
pub(super) const LANES: usize = 8;

/// A weight element: f32, or the bits of an f16 or bf16 value.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// Whether the prefill tiles are 6 weight rows × 2 activation rows (f16) rather than 4 × 3
    /// (bf16 and f32): the faster shape for each type on the 0.85 B model's matrices here.
    const WIDE_PREFILL_TILES: bool;

    /// The value as f32 (exact).
    fn to_f32(self) -> f32;

    /// 8 values at `p` as f32 (an AVX2 + F16C context: called from the dispatched kernels).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
}

/// The bits of an IEEE binary16 value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct F16(pub u16);

/// The bits of a bfloat16 value (the top 16 bits of an f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Bf16(pub u16);

impl Elem for F16 {
    const WIDE_PREFILL_TILES: bool = true;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
}

impl Elem for Bf16 {
    const WIDE_PREFILL_TILES: bool = false;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        use std::arch::x86_64::*;
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
    }
}

impl Elem for f32 {
    const WIDE_PREFILL_TILES: bool = false;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

/// `y [t, rows] = x [t, cols] · w^T` for `w [rows, cols]` (row-major), `x` and `y` row-major
/// f32, in the module docs' order.
pub(crate) fn matmul<E: Elem>(
    w: &[E],
    rows: usize,
    cols: usize,
    x: &[f32],
    t: usize,
    y: &mut [f32],
) {
    debug_assert_eq!(w.len(), rows * cols);
    by_tasks(
        rows,
        cols,
        x,
        t,
        y,
        || (),
        |_, r0, n, out| {
            // SAFETY: the task writes columns r0..r0 + n of `y` only (`by_tasks`).
            unsafe { rows_kernel(&w[r0 * cols..(r0 + n) * cols], n, cols, x, t, out) };
        },
    );
}

/// Runs `task(state, r0, n, out)` for each block of [`TASK_ROWS`] weight rows `r0..r0 + n`
/// of the product `y [t, rows] = x [t, cols] · W^T`, over rayon's pool when it has more than
/// one thread (`state` from `init`, one per thread); `out` is `y` with the task's rows at
/// columns `r0..r0 + n`, which only that task writes.
///
/// # Panics
/// When `x` is not `t * cols` values or `y` not `t * rows` (a caller's bug: the public paths
/// check the lengths first).
pub(super) fn by_tasks<S>(
    rows: usize,
    cols: usize,
    x: &[f32],
    t: usize,
    y: &mut [f32],
    init: impl Fn() -> S + Send + Sync,
    task: impl Fn(&mut S, usize, usize, Out) + Send + Sync,
) {
    // Real checks, once per product: the kernels read `x` and write `y` through pointers.
    assert_eq!(x.len(), t * cols, "activations of [{t}, {cols}]");
    assert_eq!(y.len(), t * rows, "output of [{t}, {rows}]");
    if t == 0 || rows == 0 {
        return;
    }
    let out = Out {
        ptr: y.as_mut_ptr(),
        stride: rows,
        col0: 0,
    };
    let run = |state: &mut S, i: usize| {
        let r0 = i * TASK_ROWS;
        task(state, r0, TASK_ROWS.min(rows - r0), out.at(r0));
    };
    let tasks = rows.div_ceil(TASK_ROWS);
    if rayon::current_num_threads() > 1 {
        (0..tasks).into_par_iter().for_each_init(&init, run);
    } else {
        let mut state = init();
        (0..tasks).for_each(|i| run(&mut state, i));
    }
}

/// The output `y [t, stride]` the tasks of one product write, each its own columns: a kernel's
/// weight row `r` is column `col0 + r`.
#[derive(Clone, Copy)]
pub(crate) struct Out {
    pub(super) ptr: *mut f32,
    pub(super) stride: usize,
    pub(super) col0: usize,
}

impl Out {
    /// The same output, a kernel's rows starting at column `col0`.
    pub(super) fn at(self, col0: usize) -> Self {
        Self { col0, ..self }
    }
}

// SAFETY: the tasks of one product write disjoint columns of `y` (see `matmul`) and finish
// before it returns; `y` outlives them.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// `y[s, out.col0 + r] = dot(w row r, x row s)` for the `n` rows of `w` and the `t` rows of
/// `x` (dispatched).
///
/// # Safety
/// `out` holds `t` rows of `out.stride >= out.col0 + n` values, and no other thread writes
/// columns `out.col0..out.col0 + n` meanwhile.
unsafe fn rows_kernel<E: Elem>(w: &[E], n: usize, cols: usize, x: &[f32], t: usize, out: Out) {
    debug_assert!(w.len() >= n * cols && x.len() >= t * cols);
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked once by `avx2`); the lengths are the
        // caller's.
        return x86::rows_kernel(w, n, cols, x, t, out);
    }
    for s in 0..t {
        let xs = &x[s * cols..(s + 1) * cols];
        for r in 0..n {
            *out.ptr.add(s * out.stride + out.col0 + r) =
                dot_portable(&w[r * cols..(r + 1) * cols], xs);
        }
    }
}

/// The portable dot product of one row: the module docs' lanes, tree and tail.
pub(crate) fn dot_portable<E: Elem>(w: &[E], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let body = n - n % LANES;
    let mut acc = [0f32; LANES];
    for (wc, xc) in w[..body]
        .chunks_exact(LANES)
        .zip(x[..body].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] = wc[l].to_f32().mul_add(xc[l], acc[l]);
        }
    }
    reduce(&acc) + tail(w, x, body, n)
}

/// The tail `body..n` of a dot product, accumulated in order from 0.
#[inline(always)]
fn tail<E: Elem>(w: &[E], x: &[f32], body: usize, n: usize) -> f32 {
    let mut tail = 0f32;
    for j in body..n {
        tail = w[j].to_f32().mul_add(x[j], tail);
    }
    tail
}

/// The fixed reduction of the 8 lanes: `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
pub(super) fn reduce(acc: &[f32; LANES]) -> f32 {
    let h = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    let q = [h[0] + h[2], h[1] + h[3]];
    q[0] + q[1]
}

/// Whether the CPU runs the AVX2 kernels (AVX2, FMA and F16C), detected once.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2() -> bool {
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    })
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::{tail, Elem, Out, LANES, SMALL_BATCH, TOKEN_BLOCK};

    /// The 8 lanes of an accumulator reduced in `super::reduce`'s order (halves, then pairs),
    /// plus the tail.
    #[inline(always)]
    pub(in crate::models) unsafe fn finish(a: __m256, tail: f32) -> f32 {
        let h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let q = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let s = _mm_add_ss(q, _mm_shuffle_ps::<0b01>(q, q));
        _mm_cvtss_f32(s) + tail
    }

    /// The tile of weight rows `r0..r0 + RM` × activation rows `s0..s0 + RN`: one 8-lane
    /// accumulator per output over the body of the rows, then each output finished with its
    /// tail.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // acc[j][i], indexed by both loops
    unsafe fn tile<E: Elem, const RM: usize, const RN: usize>(
        w: &[E],
        cols: usize,
        x: &[f32],
        r0: usize,
        s0: usize,
        out: Out,
    ) {
        let body = cols - cols % LANES;
        let (wp, xp) = (w.as_ptr().add(r0 * cols), x.as_ptr().add(s0 * cols));
        let mut acc = [[_mm256_setzero_ps(); RM]; RN];
        let mut k = 0;
        while k < body {
            let mut b = [_mm256_setzero_ps(); RN];
            for (j, b) in b.iter_mut().enumerate() {
                *b = _mm256_loadu_ps(xp.add(j * cols + k));
            }
            for i in 0..RM {
                let a = E::load8(wp.add(i * cols + k));
                for j in 0..RN {
                    acc[j][i] = _mm256_fmadd_ps(a, b[j], acc[j][i]);
                }
            }
            k += LANES;
        }
        for (j, acc) in acc.iter().enumerate() {
            let xs = &x[(s0 + j) * cols..(s0 + j + 1) * cols];
            for (i, &a) in acc.iter().enumerate() {
                let ws = &w[(r0 + i) * cols..(r0 + i + 1) * cols];
                let v = finish(a, tail(ws, xs, body, cols));
                *out.ptr.add((s0 + j) * out.stride + out.col0 + r0 + i) = v;
            }
        }
    }

    /// Tiles of `RM` rows from `r0` over activation rows `s0..s1`, `RN` at a time (then one at
    /// a time).
    #[inline(always)]
    unsafe fn tiles<E: Elem, const RM: usize, const RN: usize>(
        w: &[E],
        cols: usize,
        x: &[f32],
        r0: usize,
        (s0, s1): (usize, usize),
        out: Out,
    ) {
        let mut s = s0;
        while s + RN <= s1 {
            tile::<E, RM, RN>(w, cols, x, r0, s, out);
            s += RN;
        }
        while s < s1 {
            tile::<E, RM, 1>(w, cols, x, r0, s, out);
            s += 1;
        }
    }

    /// The last `rows` (fewer than `RM`) rows from `r0`, as tiles of that many rows.
    #[inline(always)]
    unsafe fn edge<E: Elem, const RN: usize>(
        w: &[E],
        rows: usize,
        cols: usize,
        x: &[f32],
        r0: usize,
        span: (usize, usize),
        out: Out,
    ) {
        match rows {
            0 => {}
            1 => tiles::<E, 1, RN>(w, cols, x, r0, span, out),
            2 => tiles::<E, 2, RN>(w, cols, x, r0, span, out),
            3 => tiles::<E, 3, RN>(w, cols, x, r0, span, out),
            4 => tiles::<E, 4, RN>(w, cols, x, r0, span, out),
            5 => tiles::<E, 5, RN>(w, cols, x, r0, span, out),
            6 => tiles::<E, 6, RN>(w, cols, x, r0, span, out),
            _ => tiles::<E, 7, RN>(w, cols, x, r0, span, out),
        }
    }

    /// `super::rows_kernel` on AVX2: decode tiles (8 × 1) for at most `SMALL_BATCH`
    /// activation rows, prefill tiles (6 × 2) beyond.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_kernel<E: Elem>(
        w: &[E],
        n: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        out: Out,
    ) {
        if t <= SMALL_BATCH {
            let full = n - n % 8;
            let mut r = 0;
            while r < full {
                // The 8 rows stay in the L1 cache for the t activation rows.
                tiles::<E, 8, 1>(w, cols, x, r, (0, t), out);
                r += 8;
            }
            edge::<E, 1>(w, n - full, cols, x, full, (0, t), out);
            return;
        }
        if E::WIDE_PREFILL_TILES {
            prefill::<E, 6, 2>(w, n, cols, x, t, out);
        } else {
            prefill::<E, 4, 3>(w, n, cols, x, t, out);
        }
    }

    /// The prefill tiles, `RM` weight rows × `RN` activation rows, over activation blocks of
    /// `TOKEN_BLOCK` rows.
    #[inline(always)]
    unsafe fn prefill<E: Elem, const RM: usize, const RN: usize>(
        w: &[E],
        n: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        out: Out,
    ) {
        let full = n - n % RM;
        let mut s0 = 0;
        while s0 < t {
            let span = (s0, (s0 + TOKEN_BLOCK).min(t));
            let mut r = 0;
            while r < full {
                tiles::<E, RM, RN>(w, cols, x, r, span, out);
                r += RM;
            }
            edge::<E, RN>(w, n - full, cols, x, full, span, out);
            s0 = span.1;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A deterministic pseudo-random f32 in [-1, 1) (xorshift).
    pub(crate) fn next(state: &mut u64) -> f32 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn random<E: Elem>(n: usize, seed: u64, make: impl Fn(f32) -> E) -> Vec<E> {
        let mut s = seed | 1;
        (0..n).map(|_| make(next(&mut s))).collect()
    }

    fn f16s(n: usize, seed: u64) -> Vec<F16> {
        random(n, seed, |v| F16(half::f16::from_f32(v).to_bits()))
    }

    fn bf16s(n: usize, seed: u64) -> Vec<Bf16> {
        random(n, seed, |v| Bf16(half::bf16::from_f32(v).to_bits()))
    }

    fn f32s(n: usize, seed: u64) -> Vec<f32> {
        random(n, seed, |v| v)
    }

    /// Every output of `matmul` equals the portable dot product bit for bit (so every tile,
    /// edge, batch size and instruction set gives the same bits) and is within f32 rounding of
    /// an f64 reference.
    fn check<E: Elem>(w: &[E], rows: usize, cols: usize, t: usize, seed: u64) {
        let mut s = seed;
        let x: Vec<f32> = (0..t * cols).map(|_| next(&mut s)).collect();
        let mut y = vec![f32::NAN; t * rows];
        matmul(w, rows, cols, &x, t, &mut y);
        for i in 0..t {
            let xs = &x[i * cols..(i + 1) * cols];
            for r in 0..rows {
                let ws = &w[r * cols..(r + 1) * cols];
                let got = y[i * rows + r];
                let want = dot_portable(ws, xs);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "[{rows}x{cols}] t={t} ({i},{r}): {got} vs {want}"
                );
                let exact: f64 = ws
                    .iter()
                    .zip(xs)
                    .map(|(w, &x)| w.to_f32() as f64 * x as f64)
                    .sum();
                assert!(
                    (got as f64 - exact).abs() <= 1e-5 * (cols as f64).sqrt().max(1.0),
                    "[{rows}x{cols}] t={t} ({i},{r}): {got} vs f64 {exact}"
                );
            }
        }
    }

    #[test]
    fn every_tile_and_batch_gives_the_portable_bits() {
        // Rows around the tiles (8 and 6) and the tasks (48); columns with and without tails;
        // batches around SMALL_BATCH, the prefill tiles' rows (2 and 3) and TOKEN_BLOCK.
        let shapes = [
            (1, 1),
            (3, 40),
            (7, 8),
            (13, 33),
            (49, 17),
            (97, 64),
            (50, 2051),
        ];
        for (k, &(rows, cols)) in shapes.iter().enumerate() {
            let seed = 17 + k as u64;
            let (wf, wb, w32) = (
                f16s(rows * cols, seed),
                bf16s(rows * cols, seed),
                f32s(rows * cols, seed),
            );
            for t in [1, 2, 3, SMALL_BATCH, SMALL_BATCH + 1, 20, TOKEN_BLOCK + 3] {
                if cols > 1000 && t > SMALL_BATCH + 1 {
                    continue;
                }
                check(&wf, rows, cols, t, 5 + t as u64);
                check(&wb, rows, cols, t, 6 + t as u64);
                check(&w32, rows, cols, t, 7 + t as u64);
            }
        }
    }

    /// A row's result is the same alone, at any place in a decode batch, and in a prefill
    /// batch (the module docs' invariance).
    #[test]
    fn results_do_not_depend_on_the_batch() {
        let (rows, cols) = (70, 2051);
        let w = f16s(rows * cols, 3);
        let t = 40;
        let mut s = 42;
        let x: Vec<f32> = (0..t * cols).map(|_| next(&mut s)).collect();
        let mut all = vec![0f32; t * rows];
        matmul(&w, rows, cols, &x, t, &mut all);
        let mut some = vec![0f32; SMALL_BATCH * rows];
        matmul(
            &w,
            rows,
            cols,
            &x[5 * cols..(5 + SMALL_BATCH) * cols],
            SMALL_BATCH,
            &mut some,
        );
        for i in 0..t {
            let mut one = vec![0f32; rows];
            matmul(&w, rows, cols, &x[i * cols..(i + 1) * cols], 1, &mut one);
            for r in 0..rows {
                assert_eq!(
                    one[r].to_bits(),
                    all[i * rows + r].to_bits(),
                    "row {i} out {r}"
                );
                if (5..5 + SMALL_BATCH).contains(&i) {
                    assert_eq!(one[r].to_bits(), some[(i - 5) * rows + r].to_bits());
                }
            }
        }
    }

    /// The portable order, worked by hand: lanes of 8, the tree `((l0 + l4) + (l2 + l6)) +
    /// ((l1 + l5) + (l3 + l7))`, then the tail in order.
    #[test]
    fn the_reduction_order_is_the_documented_one() {
        // 1e8 and -1e8 (lanes 0 and 4) cancel only when added first.
        let x: Vec<f32> = vec![1e8, 1.0, 1.0, 1.0, -1e8, 1.0, 1.0, 1.0, 0.5, 0.25];
        let w = vec![Bf16(half::bf16::from_f32(1.0).to_bits()); x.len()];
        // (1e8 + -1e8) + (1 + 1) = 2 for lanes 0/4 and 2/6; (1 + 1) + (1 + 1) = 4 for the odd
        // lanes; 2 + 4 = 6, then the tail 0.5 + 0.25.
        assert_eq!(dot_portable(&w, &x), 6.75);
        let mut y = [0f32; 1];
        matmul(&w, 1, x.len(), &x, 1, &mut y);
        assert_eq!(y[0], 6.75);
    }

    #[test]
    fn conversions_are_exact() {
        assert_eq!(F16(0x7c00).to_f32(), f32::INFINITY);
        assert!(F16(0x7e00).to_f32().is_nan());
        assert_eq!(F16(0x0001).to_f32(), 2f32.powi(-24));
        assert_eq!(F16(0x8000).to_f32().to_bits(), (-0f32).to_bits());
        assert_eq!(Bf16(0x3f80).to_f32(), 1.0);
        assert_eq!(Bf16(0xc040).to_f32(), -3.0);
    }
}
