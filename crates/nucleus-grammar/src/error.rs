//! [`GrammarError`]: everything that can go wrong in this crate, as one typed enum.

use crate::GrammarKind;

/// An error of nucleus-grammar. Every variant names the input that was wrong; none is a panic.
///
/// Which calls return which variant:
/// - building a [`crate::TokenEnv`]: [`Tokenizer`](Self::Tokenizer),
///   [`TokenTooLong`](Self::TokenTooLong), [`VocabTooSmall`](Self::VocabTooSmall),
///   [`NoEosToken`](Self::NoEosToken), [`TokenOutOfRange`](Self::TokenOutOfRange) (an EOS id
///   at or above the vocabulary size);
/// - compiling ([`crate::GrammarCompiler::compile`]): [`InvalidSchemaJson`](Self::InvalidSchemaJson),
///   [`TooDeep`](Self::TooDeep), [`Compile`](Self::Compile);
/// - a matcher ([`crate::GrammarMatcher`]): [`TokenRejected`](Self::TokenRejected),
///   [`TokenOutOfRange`](Self::TokenOutOfRange), [`Ended`](Self::Ended),
///   [`RollbackTooFar`](Self::RollbackTooFar), [`BitmaskTooShort`](Self::BitmaskTooShort),
///   [`BitmaskShape`](Self::BitmaskShape), [`Matcher`](Self::Matcher);
/// - encoding text ([`crate::TokenEnv::encode`]): [`Tokenizer`](Self::Tokenizer).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The tokenizer cannot be used: its JSON cannot be serialised or read, its decoder is
    /// neither byte-level nor byte-fallback (so the bytes of its tokens are unknown), or
    /// encoding a text failed. The message is the tokenizer's or llguidance's.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A token is longer than llguidance's token trie can hold ([`crate::MAX_TOKEN_BYTES`]).
    #[error(
        "token {token} is {len} bytes long; the grammar engine takes tokens of at most {max} bytes"
    )]
    TokenTooLong {
        /// The token id.
        token: u32,
        /// Its length in bytes.
        len: usize,
        /// The limit, [`crate::MAX_TOKEN_BYTES`].
        max: usize,
    },
    /// The vocabulary size given is smaller than the tokenizer's (its largest id + 1), or is 0,
    /// or either is above [`crate::MAX_VOCAB_SIZE`].
    #[error("{}", vocab_message(*.vocab_size, *.tokenizer_vocab, *.max))]
    VocabTooSmall {
        /// The vocabulary size passed in.
        vocab_size: usize,
        /// The tokenizer's number of ids (largest id + 1).
        tokenizer_vocab: usize,
        /// The largest vocabulary the trie supports.
        max: usize,
    },
    /// No EOS token id was given: a matcher needs at least one to end a generation.
    #[error("no EOS token id given: pass the ids that end a generation (e.g. <|im_end|>, </s>)")]
    NoEosToken,
    /// A token id at or above the vocabulary size.
    #[error("token id {token} is out of range: the vocabulary has {vocab_size} ids")]
    TokenOutOfRange {
        /// The id.
        token: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// A JSON Schema given as text is not valid JSON (serde_json's message, with line and
    /// column).
    #[error("JSON Schema is not valid JSON: {0}")]
    InvalidSchemaJson(String),
    /// llguidance could not compile the grammar; the message is llguidance's and names the
    /// problem (e.g. `oneOf constraints are not supported`, a regex syntax error, a Lark
    /// parse error with its line), or says that the grammar matches no text or is too large
    /// for llguidance's lexer. It is one line: llguidance's quoted source lines are dropped,
    /// control characters escaped, and it is cut at [`MAX_MESSAGE_LINE`] characters.
    #[error("{kind} does not compile: {message}")]
    Compile {
        /// What was being compiled.
        kind: GrammarKind,
        /// llguidance's message.
        message: String,
    },
    /// The grammar nests deeper than [`crate::MAX_GRAMMAR_DEPTH`] (an upper bound on the depth
    /// of llguidance's recursion when compiling it: JSON nesting and `$ref` chains, Lark rule
    /// chains); refused before llguidance sees it, so that compilation cannot overflow the
    /// stack.
    #[error(
        "{kind} does not compile: it nests too deeply, up to {depth} {what}; the limit is {limit}"
    )]
    TooDeep {
        /// What was being compiled.
        kind: GrammarKind,
        /// The depth found (an upper bound of the recursion it would need).
        depth: u64,
        /// [`crate::MAX_GRAMMAR_DEPTH`].
        limit: usize,
        /// What is counted, e.g. "levels of nested subschemas and `$ref`s".
        what: &'static str,
    },
    /// The grammar does not allow this token here. The matcher is unchanged and still usable.
    #[error("token {token} ({text:?}) is not allowed by the grammar here")]
    TokenRejected {
        /// The token id.
        token: u32,
        /// The token's text (its bytes, invalid UTF-8 replaced by U+FFFD).
        text: String,
    },
    /// An EOS token was committed: the matcher takes no more tokens until it is rolled back.
    #[error("the grammar has ended (an EOS token was committed); roll back to continue")]
    Ended,
    /// `rollback(n)` with `n` above the number of committed tokens.
    #[error("cannot roll back {requested} tokens: only {committed} are committed")]
    RollbackTooFar {
        /// Tokens asked to roll back.
        requested: usize,
        /// Tokens committed (including a committed EOS).
        committed: usize,
    },
    /// A bitmask row shorter than ceil(vocab_size / 32) words.
    #[error(
        "bitmask row has {len} words; the vocabulary of {vocab_size} ids needs at least {needed}"
    )]
    BitmaskTooShort {
        /// The row length in u32 words.
        len: usize,
        /// The words needed, ceil(vocab_size / 32).
        needed: usize,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// A batch bitmask whose length is not `matchers × row_words`.
    #[error("batch bitmask has {len} words, expected {rows} rows of {row_words} words")]
    BitmaskShape {
        /// The bitmask length in u32 words.
        len: usize,
        /// The number of matchers (rows).
        rows: usize,
        /// The words per row given.
        row_words: usize,
    },
    /// llguidance reported an error inside the matcher (e.g. no token can continue the
    /// grammar, a lexer or parser limit was hit). The matcher is unusable from then on.
    #[error("grammar matcher failed: {0}")]
    Matcher(String),
}

/// The message of [`GrammarError::VocabTooSmall`]: which of its rules is broken.
fn vocab_message(vocab_size: usize, tokenizer_vocab: usize, max: usize) -> String {
    if tokenizer_vocab > max {
        format!(
            "the tokenizer's ids go up to {}: the grammar engine takes at most {max} ids",
            tokenizer_vocab - 1
        )
    } else if vocab_size > max {
        format!("vocabulary size {vocab_size} is more than the {max} ids the grammar engine takes")
    } else if vocab_size == 0 {
        "vocabulary size 0: a logits row needs at least one id".to_string()
    } else {
        format!(
            "vocabulary size {vocab_size} is smaller than the tokenizer's {tokenizer_vocab} ids \
             (its largest id + 1)"
        )
    }
}

/// The longest [`GrammarError::Compile`] message, in characters (it is one line).
pub const MAX_MESSAGE_LINE: usize = 300;

impl GrammarError {
    /// [`GrammarError::Compile`] with llguidance's `message` made one line fit for a terminal
    /// ([`one_line`]: llguidance quotes the grammar's lines, which may be megabytes long).
    pub(crate) fn compile(kind: GrammarKind, message: &str) -> Self {
        // llguidance names its own option; nucleus's is the JSON Schema mode (the start of
        // llguidance's sentence is kept).
        let message = one_line(message).replace(
            "Enable 'coerce_one_of' option to approximate oneOf with anyOf",
            "Enable relaxed mode (`--json-schema-mode relaxed`, JsonSchemaMode::Relaxed) to \
             compile oneOf as anyOf",
        );
        GrammarError::Compile { kind, message }
    }

    /// [`GrammarError::Matcher`] with llguidance's message cut to its first line: the lines
    /// after it are a dump of the parser's internal state, not something a user can act on.
    pub(crate) fn matcher(message: &str) -> Self {
        let first = message.lines().next().unwrap_or("").trim();
        let first = first.split("<state>").next().unwrap_or(first).trim();
        let first = &one_line(first);
        if first.contains("too many expressions constructed") {
            return GrammarError::Matcher(format!(
                "{first}: the grammar is too large for llguidance's lexer from here on \
                 (counted repetitions multiply: `a{{1000}}{{1000}}` is a million states)"
            ));
        }
        GrammarError::Matcher(first.to_string())
    }
}

/// llguidance's `message` as one line fit for a terminal: its first line and the `error:`
/// lines of a regex-syntax report (the quoted source lines and their carets are dropped: the
/// first line gives the position), a panic's `<backtrace>` dropped and its assertion said in
/// words, control characters escaped (`\u{1b}`), cut at [`MAX_MESSAGE_LINE`] characters as
/// written (an escape counts for its length).
pub(crate) fn one_line(message: &str) -> String {
    let message = message.split("<backtrace>").next().unwrap_or("").trim();
    let mut lines = message.lines();
    let mut line = lines.next().unwrap_or("").trim().to_string();
    for rest in lines {
        if let Some(what) = rest.trim().strip_prefix("error:") {
            line.push(' ');
            line.push_str(what.trim());
        }
    }
    let line = match line.strip_prefix("panic: ") {
        Some(p) if p.contains("grammar.symbols.len() < u16::MAX") => format!(
            "the grammar has more symbols than llguidance can number (its symbol ids are \
             16-bit: at most 65,525) ({p})"
        ),
        Some(p) => format!("llguidance failed an internal check ({p})"),
        None => line,
    };
    let mut out = String::new();
    let mut chars = 0;
    for c in line.chars() {
        let escaped: Vec<char> = match c.is_control() {
            true => c.escape_default().collect(),
            false => vec![c],
        };
        if chars + escaped.len() > MAX_MESSAGE_LINE {
            out.push_str("...");
            break;
        }
        chars += escaped.len();
        out.extend(escaped);
    }
    out
}

/// `Result` with [`GrammarError`].
pub type Result<T, E = GrammarError> = std::result::Result<T, E>;
