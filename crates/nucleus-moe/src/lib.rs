//! MoE routing operators with the Ascend NPU contracts (`../shared/spec/moe_routing.md`, the
//! operator of torch_npu's `npu_moe_init_routing_v2` and the operators around it), on the CPU.
//!
//! A complete MoE layer runs on these operators:
//!
//! 1. gating: [`moe_gating_top_k_softmax`] (softmax then top-k, optional renormalisation,
//!    finished rows) or [`moe_gating_top_k`] (DeepSeek-V3 grouped routing) gives each token's
//!    `expert_idx [N, K]` and weights `[N, K]`;
//! 2. [`moe_init_routing`] sorts the `N * K` routes by expert (a stable counting sort,
//!    O(N*K + E)) and copies (optionally quantises to int8) each token's row once per route into
//!    `expanded_x`, so every expert's rows are contiguous; `expert_tokens` says how many;
//! 3. the caller runs each expert on its rows;
//! 4. [`moe_token_unpermute`] / [`moe_finalize_routing`] combine each token's expert outputs
//!    with its weights (`-1` routes contribute nothing).
//!
//! Tensors are flat row-major slices with their sizes given beside them; elements are `f32`,
//! `f16`, `bf16` (and `i8` for `x`), see [`Element`]. Every rule of the spec is checked, and a
//! violated rule is a [`MoeError`] that names it; nothing panics on user input. An error
//! refuses the whole call (naming the row and column where it applies): routing is one step of
//! one forward pass, which cannot go on without every token's route. [`moe_init_routing_into`]
//! and [`moe_finalize_routing_into`] write into buffers reused from call to call, as an engine
//! does (a fresh `expanded_x` of hundreds of MB costs page faults).
//!
//! Where the spec is silent, these operators decide (each is tested):
//! - `active_num` is ignored in drop/pad mode (as `expert_capacity` is outside it);
//! - the key-value limit `expert_num <= 5120` and drop/pad's "count type" apply whether or not
//!   `expert_tokens_num_flag` is set;
//! - only rows that some route places are quantised, so a NaN in a row no route places never
//!   fails a call; static quantisation refuses NaN and saturates +-inf; dynamic quantisation
//!   refuses a non-finite `x * smooth`; a row whose scale underflows to 0 gives q = 0, s = 0;
//! - finished rows of the softmax gating get expert id E with their weights computed as for
//!   any row (vLLM's `topk_softmax`);
//! - gating refuses NaN and +inf logits, and (softmax) a row of only -inf.

mod error;
mod gating;
mod init_routing;
mod unpermute;

pub use error::MoeError;
pub use gating::{
    moe_gating_top_k, moe_gating_top_k_softmax, GatingOutput, GroupSelectMode, GroupedTopKParams,
    NormType,
};
pub use init_routing::{
    moe_init_routing, moe_init_routing_into, DropPadMode, ExpandedX, ExpertTokensNumType,
    MoeInitRoutingAttrs, MoeInitRoutingInput, MoeInitRoutingOutput, QuantMode, RowIdxType,
    MAX_EXPERT_NUM, MAX_EXPERT_NUM_KEY_VALUE,
};
pub use unpermute::{
    moe_finalize_routing, moe_finalize_routing_into, moe_token_unpermute, FinalizeRoutingInput,
};

use half::{bf16, f16};

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
    /// Signed 8-bit integer (the quantised `expanded_x`, or an already-quantised `x`).
    I8,
}

impl DType {
    /// `"f32"`, `"f16"`, `"bf16"`, `"i8"`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::I8 => "i8",
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i8 {}
}

/// An element type of `x` / `expanded_x`: `f32`, `f16`, `bf16` or `i8`. Arithmetic (quantisation)
/// is done in f32 after an exact widening.
pub trait Element:
    Copy + Send + Sync + Default + PartialEq + std::fmt::Debug + 'static + sealed::Sealed
{
    /// The element's [`DType`].
    const DTYPE: DType;
    /// The value as f32 (exact for every implementing type).
    fn to_f32(self) -> f32;
}

/// A floating-point [`Element`] (`f32`, `f16`, `bf16`): gating logits, expert outputs.
pub trait FloatElement: Element {
    /// The f32 value rounded to this type (round to nearest even).
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}
impl FloatElement for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}
impl FloatElement for f16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}
impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    /// The exact widening, as a shift (half's conversion adds a NaN branch that stops
    /// vectorisation; a NaN keeps its payload here).
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}
impl FloatElement for bf16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
impl Element for i8 {
    const DTYPE: DType = DType::I8;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
}

/// Work below this many bytes is done on the calling thread: a rayon dispatch costs a few µs,
/// and at 256 KiB two threads were no faster than one (BENCHMARKS.md, MoE routing).
pub(crate) const PARALLEL_MIN_BYTES: usize = 1024 * 1024;
