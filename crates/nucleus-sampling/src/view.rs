//! [`LogitsView`]: a checked, borrowed `[batch, row_len]` matrix of f32 logits.

use crate::error::ShapeError;

/// An element type of a logits matrix: f32, or the 16-bit types LM heads often produce
/// (`half::f16`, `half::bf16`). Computation is always f32 (spec/sampling.md, "Inputs"): a
/// 16-bit row is widened into a per-thread buffer once, exactly (every f16 and bf16 value is an
/// f32 value).
pub trait LogitValue: Copy + Send + Sync + 'static {
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
    /// The row itself when it already is f32 (no copy).
    fn as_f32(row: &[Self]) -> Option<&[f32]>;
}

impl LogitValue for f32 {
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn as_f32(row: &[Self]) -> Option<&[f32]> {
        Some(row)
    }
}

impl LogitValue for half::f16 {
    #[inline]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline]
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl LogitValue for half::bf16 {
    #[inline]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    #[inline]
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

/// What the values of a row are (spec/sampling.md, "Inputs").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InputKind {
    /// Unnormalised log-probabilities: the LM head's output. -inf masks a token.
    #[default]
    Logits,
    /// Non-negative weights (probabilities, not necessarily normalised), as FlashInfer's
    /// `*_from_probs` functions take them. 0 masks a token. Penalties and `logit_bias` are not
    /// defined on them (an error); temperature must be 1 (no-op) or greedy.
    Probs,
}

/// A borrowed logits matrix `[batch, row_len]` of f32 (default), f16 or bf16 ([`LogitValue`]),
/// row-major, with a row stride.
///
/// Row `i` starts at `data[i * row_stride]` and holds `row_len` values, of which the first
/// `vocab_size` are token ids; the ids `vocab_size..row_len` are padding (embedding tables
/// rounded up, e.g. 151,936 rows for a 151,665-token tokenizer) and are never candidates.
/// The shape is checked once, in [`LogitsView::new`].
#[derive(Clone, Copy, Debug)]
pub struct LogitsView<'a, T: LogitValue = f32> {
    data: &'a [T],
    batch: usize,
    row_len: usize,
    row_stride: usize,
    vocab_size: usize,
    kind: InputKind,
}

impl<'a, T: LogitValue> LogitsView<'a, T> {
    /// Wraps `data` as `[batch, row_len]` with `row_stride` elements between row starts.
    ///
    /// # Errors
    /// [`ShapeError`] when `row_len > row_stride`, `vocab_size` is 0, above `row_len` or above
    /// `u32::MAX`, or `data` is shorter than `(batch - 1) * row_stride + row_len`.
    pub fn new(
        data: &'a [T],
        batch: usize,
        row_len: usize,
        row_stride: usize,
        vocab_size: usize,
    ) -> Result<Self, ShapeError> {
        if row_len > row_stride {
            return Err(ShapeError::RowLongerThanStride {
                row_len,
                row_stride,
            });
        }
        if vocab_size == 0 || vocab_size > row_len {
            return Err(ShapeError::BadVocabSize {
                vocab_size,
                row_len,
            });
        }
        if u32::try_from(vocab_size).is_err() {
            return Err(ShapeError::VocabTooLarge { vocab_size });
        }
        let needed = if batch == 0 {
            0
        } else {
            (batch - 1)
                .checked_mul(row_stride)
                .and_then(|n| n.checked_add(row_len))
                .unwrap_or(usize::MAX)
        };
        if data.len() < needed {
            return Err(ShapeError::DataTooShort {
                len: data.len(),
                batch,
                row_stride,
                row_len,
                needed,
            });
        }
        Ok(Self {
            data,
            batch,
            row_len,
            row_stride,
            vocab_size,
            kind: InputKind::Logits,
        })
    }

    /// The same matrix read as `kind` (default [`InputKind::Logits`]).
    pub fn with_kind(mut self, kind: InputKind) -> Self {
        self.kind = kind;
        self
    }

    /// Whether the rows hold logits or probabilities.
    pub fn kind(&self) -> InputKind {
        self.kind
    }

    /// A dense `[batch, vocab]` matrix: stride and row length equal `vocab`, no padding.
    ///
    /// # Errors
    /// As [`LogitsView::new`].
    pub fn dense(data: &'a [T], batch: usize, vocab: usize) -> Result<Self, ShapeError> {
        Self::new(data, batch, vocab, vocab, vocab)
    }

    /// Number of rows.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Elements in a row (vocabulary plus padding).
    pub fn row_len(&self) -> usize {
        self.row_len
    }

    /// Elements between row starts.
    pub fn row_stride(&self) -> usize {
        self.row_stride
    }

    /// Token ids per row: ids `0..vocab_size` are candidates.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The candidate part of row `i`: `vocab_size` logits. Panics if `i >= batch`.
    pub fn row(&self, i: usize) -> &'a [T] {
        assert!(
            i < self.batch,
            "row {i} out of range for batch {}",
            self.batch
        );
        let start = i * self.row_stride;
        &self.data[start..start + self.vocab_size]
    }
}
