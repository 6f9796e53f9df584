//! Exit statuses shared by every command (`nucleus grammar validate` keeps grep's convention
//! instead: 0 accepted, 1 rejected, 2 any error):
//!
//! - 0: the work was done (in the JSON-lines commands, an error answer is an answer);
//! - 1: a failure at run time: an unreadable or unusable input file, a file larger than
//!   `--max-input-bytes`, a missing model, a size whose memory cannot be had, a failed write;
//! - 2: a flag value outside its type or domain, or a flag that has no effect in the given
//!   combination: clap's own message and usage hint, or one `error: ...` line from a
//!   [`UsageError`] for the checks clap cannot express.

use std::fmt;

/// A flag value outside its domain, or a flag that has no effect with the others: exit
/// status 2. Commands return it inside their `anyhow::Error`, and `main` picks the status by
/// downcasting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageError(pub String);

impl UsageError {
    /// A usage error with this message.
    pub fn new(message: impl Into<String>) -> Self {
        UsageError(message.into())
    }
}

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// The exit status of a usage error.
pub const USAGE_STATUS: u8 = 2;

/// Whether `e` (or one of its causes) is a [`UsageError`], or a benchmark parameter out of
/// its domain ([`nucleus_bench::ParamError`]: `nucleus bench` passes its flags on as
/// parameters, and the error names the flag).
pub fn is_usage(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<UsageError>().is_some()) || nucleus_bench::is_param_error(e)
}

/// The one-line message of `e`: its text, then each cause whose text it does not already
/// include (`cannot read the grammar X: No such file or directory`), joined by `: `. anyhow's
/// `{:#}` prints every cause, so an error whose message already quotes its source (the
/// engine's `grammar: JSON Schema does not compile: ...`) was printed twice.
pub fn message(e: &anyhow::Error) -> String {
    let mut line = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !line.contains(&cause) {
            line.push_str(": ");
            line.push_str(&cause);
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error whose message quotes its source, as the engine's `Grammar(#[from] ...)` does.
    #[derive(Debug)]
    struct Quoting(std::io::Error);

    impl fmt::Display for Quoting {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "grammar: {}", self.0)
        }
    }

    impl std::error::Error for Quoting {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_already_in_the_message_is_not_repeated() {
        let io = || std::io::Error::other("no such thing");
        let quoting = anyhow::Error::from(Quoting(io()));
        assert_eq!(
            format!("{quoting:#}"),
            "grammar: no such thing: no such thing"
        );
        assert_eq!(message(&quoting), "grammar: no such thing");
        let context = anyhow::Error::from(io()).context("cannot read X");
        assert_eq!(message(&context), "cannot read X: no such thing");
    }
}
