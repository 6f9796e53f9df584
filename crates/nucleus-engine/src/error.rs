//! [`EngineError`]: what can go wrong loading a model or running requests.

use std::path::PathBuf;

/// Errors of nucleus-engine. Each names the input that was wrong.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not a GGUF model we can load (bad magic, truncated, missing tensor or key).
    #[error("invalid model file {path}: {message}")]
    InvalidModel {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// The GGUF file holds an architecture or tokenizer kind we do not run.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// No model was given and none could be fetched.
    #[error("no model available: {0}")]
    ModelNotFound(String),
    /// The tokenizer failed on some text or ids.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// A tensor operation failed (shapes, dtypes): a bug or a malformed model.
    #[error("tensor error: {}", candle_message(.0))]
    Candle(#[from] candle_core::Error),
    /// A request was malformed (bad parameters, empty prompt without BOS, too long).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Sampling failed for a request.
    #[error("sampling failed: {0}")]
    Sampling(#[from] nucleus_sampling::SampleError),
    /// A request's grammar could not be used: it failed to compile (the message names the
    /// problem), the tokenizer cannot serve grammars (no EOS token, a token llguidance cannot
    /// take), or a rollback went past the grammar's start.
    #[error("grammar: {0}")]
    Grammar(#[from] nucleus_grammar::GrammarError),
}

/// `Result` with [`EngineError`].
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// The message of a candle error without the backtrace candle attaches when `RUST_BACKTRACE`
/// is set: errors are one line for the user.
pub(crate) fn candle_message(e: &candle_core::Error) -> String {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, .. } => candle_message(inner),
        E::Context { inner, context } => format!("{context}: {}", candle_message(inner)),
        E::WithPath { inner, path } => format!("{}: {}", path.display(), candle_message(inner)),
        other => other.to_string().replace('\n', "; "),
    }
}
