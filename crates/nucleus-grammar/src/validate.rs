//! [`validate_text`]: does a whole text, tokenised as a model would write it, match a grammar?
//! The logic of `nucleus grammar validate`.

use crate::compiler::{GrammarCompiler, GrammarOptions, GrammarSpec};
use crate::error::{GrammarError, Result};

/// The verdict of [`validate_text`]. `Display` writes the line `nucleus grammar validate`
/// prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Validation {
    /// Every token is accepted and the grammar may end after the last one: `accepted`.
    Accepted {
        /// Tokens of the text.
        tokens: usize,
    },
    /// The grammar rejects token `index` (counted from 0) of the text:
    /// `rejected at token I (id N, text "...")`, the text escaped as a Rust string literal.
    Rejected {
        /// Position of the first rejected token.
        index: usize,
        /// Its id.
        token: u32,
        /// Its text.
        text: String,
    },
    /// Every token is accepted but the text is incomplete (EOS is not allowed after it):
    /// `rejected at end of text (the grammar cannot end here)`.
    Incomplete {
        /// Tokens of the text.
        tokens: usize,
    },
}

impl Validation {
    /// Whether the text was accepted.
    pub fn is_accepted(&self) -> bool {
        matches!(self, Validation::Accepted { .. })
    }
}

impl std::fmt::Display for Validation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Validation::Accepted { .. } => write!(f, "accepted"),
            Validation::Rejected { index, token, text } => {
                write!(f, "rejected at token {index} (id {token}, text {text:?})")
            }
            Validation::Incomplete { .. } => {
                write!(f, "rejected at end of text (the grammar cannot end here)")
            }
        }
    }
}

/// Validates `text` against `spec`: tokenises it with the compiler's tokenizer as a generated
/// continuation ([`crate::TokenEnv::encode`]: no BOS, no dummy prefix space), then checks, with
/// a fresh matcher and without committing anything, that every token is accepted and that the
/// grammar may end after the last one — exactly what a constrained generation of this token
/// sequence followed by EOS would need. The grammar comes from the compiler's cache.
///
/// Validation is by bytes, so any tokenisation of an accepted text is accepted. Text that
/// spells a special token (`</s>`) is ordinary text here, as it is to a grammar.
///
/// Errors: those of [`GrammarCompiler::compile`] and [`crate::TokenEnv::encode`];
/// [`GrammarError::Matcher`] when llguidance fails on the text (a lexer or parser limit, e.g.
/// a bounded repetition of hundreds of thousands of items): that is no verdict on the text.
pub fn validate_text(
    compiler: &GrammarCompiler,
    spec: &GrammarSpec,
    options: &GrammarOptions,
    text: &str,
) -> Result<Validation> {
    let env = compiler.token_env();
    let tokens = env.encode(text)?;
    let mut matcher = compiler.matcher(spec, options)?;
    // Token by token as generation commits them: a token the grammar refuses is a rejection;
    // llguidance failing (a lexer or parser limit) is an error, not a verdict.
    for (index, &token) in tokens.iter().enumerate() {
        match matcher.commit(token) {
            Ok(()) => {}
            Err(GrammarError::TokenRejected { token, text }) => {
                return Ok(Validation::Rejected { index, token, text });
            }
            Err(e) => return Err(e),
        }
    }
    if let Some(message) = matcher.error() {
        return Err(GrammarError::matcher(&message));
    }
    Ok(if matcher.may_end() {
        Validation::Accepted {
            tokens: tokens.len(),
        }
    } else {
        Validation::Incomplete {
            tokens: tokens.len(),
        }
    })
}
