//! [`validate_text`]: does a whole text, tokenised as a model would write it, match a grammar?
//! The logic of `nucleus grammar validate`.

use crate::compiler::{GrammarCompiler, GrammarOptions, GrammarSpec};
use crate::error::Result;

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
/// Validation is by bytes, so any tokenisation of an accepted text is accepted. A text that
/// spells an EOS token ends there: tokens after it are rejected.
///
/// Errors: those of [`GrammarCompiler::compile`] and [`crate::TokenEnv::encode`].
pub fn validate_text(
    compiler: &GrammarCompiler,
    spec: &GrammarSpec,
    options: &GrammarOptions,
    text: &str,
) -> Result<Validation> {
    let env = compiler.token_env();
    let tokens = env.encode(text)?;
    let mut matcher = compiler.matcher(spec, options)?;
    let len = tokens.len();
    let text_ends_with_eos = tokens.last().is_some_and(|&t| env.is_eos(t));
    let mut with_eos = tokens.clone();
    with_eos.push(env.eos_token_ids()[0]);
    let n = matcher.validate_tokens(&with_eos);
    Ok(
        if n == len + 1 || (n == len && text_ends_with_eos && len > 0) {
            Validation::Accepted { tokens: len }
        } else if n == len {
            Validation::Incomplete { tokens: len }
        } else {
            Validation::Rejected {
                index: n,
                token: tokens[n],
                text: env.token_text(tokens[n]),
            }
        },
    )
}
