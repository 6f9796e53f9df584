//! [`EngineError`]: what can go wrong loading a model or running requests.

use std::path::{Path, PathBuf};

/// Errors of nucleus-engine. Each names the input that was wrong.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A file could not be opened or read.
    #[error("cannot read {}: {source}", shown_path(path))]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file (or model folder) is not a model we can load: a corrupt or truncated GGUF or
    /// safetensors file, a missing tensor, key or field, a wrong shape.
    #[error("invalid model file {}: {message}", shown_path(path))]
    InvalidModel {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// The model is of an architecture, `model_type`, tokenizer kind or feature (a `rope_type`,
    /// sliding-window attention) we do not run.
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
    /// The memory a model needs could not be had (checked before the allocation, which would
    /// otherwise abort the process).
    #[error("cannot hold {what}: {bytes} bytes could not be allocated")]
    OutOfMemory {
        /// What needed the memory (e.g. "the f32 weights of DIR").
        what: String,
        /// How many bytes.
        bytes: u64,
    },
    /// Sampling failed for a request.
    #[error("sampling failed: {0}")]
    Sampling(#[from] nucleus_sampling::SampleError),
    /// A request's grammar could not be used: it failed to compile (the message names the
    /// problem), the tokenizer cannot serve grammars (no EOS token, a token llguidance cannot
    /// take), or a rollback went past the grammar's start.
    #[error("grammar: {0}")]
    Grammar(#[from] nucleus_grammar::GrammarError),
    /// A chat template could not be found, parsed or rendered, or a conversation given to it
    /// was malformed ([`crate::chat_template`]). The message names the template's origin (a file
    /// path, `tokenizer_config.json`, a GGUF key), the line when the template is at fault, and
    /// the problem (a syntax error, an undefined call, the text of `raise_exception`), cut to
    /// [`MAX_MESSAGE_BYTES`] with control characters escaped.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// An MoE layer's routing refused its input (nucleus-moe's message names the rule: a NaN
    /// or +inf router logit means the hidden states overflowed).
    #[error("MoE routing: {0}")]
    Moe(#[from] nucleus_moe::MoeError),
}

/// `InvalidModel` for `path`, its message [`bounded`] (control characters escaped, cut to
/// [`MAX_MESSAGE_BYTES`]): how every loader reports a file it refuses.
pub(crate) fn invalid(path: &Path, message: impl Into<String>) -> EngineError {
    EngineError::InvalidModel {
        path: path.to_path_buf(),
        message: bounded(message),
    }
}

/// `Result` with [`EngineError`].
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// The longest message (in bytes) that an error about a model file carries: every
/// `InvalidModel` and tokenizer message is cut to this length, so that nothing a file holds
/// (a 2 MB token array where a number belongs, a long string) makes a long error.
pub const MAX_MESSAGE_BYTES: usize = 400;

/// The most bytes of one escaped text from a file (a key, a tensor name, a string value) that
/// an error message shows; longer texts are cut and their length given.
pub const MAX_QUOTED_BYTES: usize = 80;

/// Text from a file (a metadata key, a tensor name, a string value) as it may appear in a message:
/// between backticks, each character escaped as Rust's `char::escape_debug` does (control
/// characters as `\n`, `\u{1b}`, ...; backslashes doubled; quotes left as they are), each byte of
/// invalid UTF-8 as `\xNN`, and at most [`MAX_QUOTED_BYTES`] bytes of that (then `…` and the
/// text's length in bytes). So a hostile name never reaches a terminal raw, nor makes a long
/// message.
///
/// ```text
/// b"blk.0\x1b[2J\xff"  ->  `blk.0\u{1b}[2J\xff`
/// ```
pub(crate) fn quote(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut out = String::from("`");
    let mut cut = false;
    'chunks: for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            let before = out.len();
            match c {
                '"' | '\'' => out.push(c),
                _ => out.extend(c.escape_debug()),
            }
            if out.len() > MAX_QUOTED_BYTES + 1 {
                out.truncate(before);
                cut = true;
                break 'chunks;
            }
        }
        for b in chunk.invalid() {
            let before = out.len();
            let _ = write!(out, "\\x{b:02x}");
            if out.len() > MAX_QUOTED_BYTES + 1 {
                out.truncate(before);
                cut = true;
                break 'chunks;
            }
        }
    }
    out.push('`');
    if cut {
        let _ = write!(out, "… ({} bytes)", bytes.len());
    }
    out
}

/// The most bytes of a path that a message shows ([`shown_path`]).
pub const MAX_PATH_BYTES: usize = 256;

/// A path as messages show it: control and format characters escaped as in `quote`, bytes
/// of invalid UTF-8 as `\xNN`, cut after [`MAX_PATH_BYTES`] bytes with `…` (a path given by a
/// user or an environment variable is text that must not reach a terminal raw either).
pub fn shown_path(path: &Path) -> String {
    use std::fmt::Write;
    let bytes = path.as_os_str().as_encoded_bytes();
    let mut out = String::new();
    'chunks: for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            if out.len() >= MAX_PATH_BYTES {
                break 'chunks;
            }
            if needs_escape(c) {
                out.extend(c.escape_debug());
            } else {
                out.push(c);
            }
        }
        for b in chunk.invalid() {
            if out.len() >= MAX_PATH_BYTES {
                break 'chunks;
            }
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    if out.len() >= MAX_PATH_BYTES && out.len() < bytes.len() + 1 {
        out.push('…');
    }
    out
}

/// `message` made safe to print as one line: every character that `char::escape_debug` escapes
/// other than backslashes and quotes (control characters, bidirectional and other format
/// characters, unassigned code points) escaped as it does, and cut to at most
/// [`MAX_MESSAGE_BYTES`] bytes, ending in `…` when cut. The last line of defence for messages that embed another library's text (candle's,
/// tokenizers'); text we take from a file is [`quote`]d where the message is made.
pub(crate) fn bounded(message: impl Into<String>) -> String {
    let message = message.into();
    if message.len() <= MAX_MESSAGE_BYTES && !message.chars().any(needs_escape) {
        return message;
    }
    let mut out = String::new();
    let mut over = false;
    for c in message.chars() {
        if needs_escape(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
        if out.len() > MAX_MESSAGE_BYTES {
            over = true;
            break;
        }
    }
    if over {
        let mut cut = MAX_MESSAGE_BYTES - '…'.len_utf8();
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push('…');
    }
    out
}

/// Whether [`bounded`] escapes `c`: `char::escape_debug` would, and it is no backslash or quote
/// (which are printable, and which the escapes of [`quote`] already contain).
fn needs_escape(c: char) -> bool {
    !matches!(c, '\\' | '"' | '\'') && c.escape_debug().nth(1).is_some()
}

/// The message of a candle error without the backtrace candle attaches when `RUST_BACKTRACE`
/// is set: errors are one line for the user.
pub(crate) fn candle_message(e: &candle_core::Error) -> String {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, .. } => candle_message(inner),
        E::Context { inner, context } => format!("{context}: {}", candle_message(inner)),
        E::WithPath { inner, path } => format!("{}: {}", shown_path(path), candle_message(inner)),
        other => other.to_string().replace('\n', "; "),
    }
}
