//! The typed error of every operator of this crate ([`MoeError`]).

/// Why a call was refused. Every variant names the violated rule of spec/moe_routing.md in its
/// message; [`MoeError::kind`] gives a stable machine-readable category. A refused call writes
/// nothing and allocates nothing the caller sees.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MoeError {
    /// A tensor's length or shape does not match the others (e.g. `x` is not `[N, H]`).
    #[error("{tensor}: {message}")]
    Shape {
        /// The tensor's name as in the spec (`x`, `expert_idx`, `scale`, ...).
        tensor: &'static str,
        /// What was expected and what was given.
        message: String,
    },
    /// One attribute is outside its allowed range.
    #[error("attribute {name} = {value}: {rule}")]
    Attribute {
        /// The attribute's name as in the spec (`expert_num`, `active_num`, ...).
        name: &'static str,
        /// The value given, formatted.
        value: String,
        /// The rule, in words (`"1 <= expert_num <= 10240"`).
        rule: &'static str,
    },
    /// Attributes or inputs that are each legal but not together (e.g. drop/pad mode with
    /// scatter indices, or i8 `x` with quantisation).
    #[error("{rule} ({detail})")]
    Combination {
        /// The rule, in words.
        rule: &'static str,
        /// The values that break it.
        detail: String,
    },
    /// A value that the operator cannot compute with: a NaN or +inf gating logit, a NaN `x`
    /// value to quantise, a non-finite quantisation parameter.
    #[error("non-finite value {value:?} in {tensor} at row {row}, column {col}: {rule}")]
    NonFinite {
        /// The tensor's name.
        tensor: &'static str,
        /// Row of the first offending value.
        row: usize,
        /// Column of the first offending value.
        col: usize,
        /// The value.
        value: f32,
        /// The rule, in words.
        rule: &'static str,
    },
    /// An output larger than memory: `expanded_x` in drop/pad mode is `[E, C, H]` and in
    /// dropless mode `[N * K, H]`, both can be far larger than the inputs.
    #[error("cannot allocate {tensor}: {bytes} bytes ({shape})")]
    Allocation {
        /// The output's name.
        tensor: &'static str,
        /// The bytes it needs.
        bytes: u128,
        /// Its shape, in words.
        shape: String,
    },
    /// An index (a routing index or an expert id) that does not point at a row.
    #[error("{tensor}[{position}] = {value}: {rule}")]
    Index {
        /// The tensor's name.
        tensor: &'static str,
        /// Flat position of the first offending index.
        position: usize,
        /// The index.
        value: i64,
        /// The rule, in words.
        rule: &'static str,
    },
}

impl MoeError {
    /// A stable snake_case category: `shape`, `attribute`, `combination`, `non_finite`, `index`,
    /// `allocation`.
    pub fn kind(&self) -> &'static str {
        match self {
            MoeError::Shape { .. } => "shape",
            MoeError::Attribute { .. } => "attribute",
            MoeError::Combination { .. } => "combination",
            MoeError::NonFinite { .. } => "non_finite",
            MoeError::Index { .. } => "index",
            MoeError::Allocation { .. } => "allocation",
        }
    }

    pub(crate) fn shape(tensor: &'static str, message: impl Into<String>) -> Self {
        MoeError::Shape {
            tensor,
            message: message.into(),
        }
    }

    pub(crate) fn attribute(
        name: &'static str,
        value: impl std::fmt::Debug,
        rule: &'static str,
    ) -> Self {
        MoeError::Attribute {
            name,
            value: format!("{value:?}"),
            rule,
        }
    }

    /// Reserves room for exactly `len` elements in the cleared `v`, or the typed error.
    pub(crate) fn reserve<U>(
        v: &mut Vec<U>,
        len: usize,
        tensor: &'static str,
        shape: impl FnOnce() -> String,
    ) -> Result<(), Self> {
        v.clear();
        v.try_reserve_exact(len).map_err(|_| MoeError::Allocation {
            tensor,
            bytes: len as u128 * std::mem::size_of::<U>() as u128,
            shape: shape(),
        })
    }

    pub(crate) fn combination(rule: &'static str, detail: impl Into<String>) -> Self {
        MoeError::Combination {
            rule,
            detail: detail.into(),
        }
    }
}
