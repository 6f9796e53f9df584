//! What the CLI writes besides its answers, written so that no write can crash it.
//!
//! - [`error`] and [`warning`]: a message as one `error: ...` / `warning: ...` line on
//!   stderr, its control characters escaped (`\u{1b}`, `\n`) and cut after
//!   [`MESSAGE_MAX_BYTES`] bytes with `...` ([`shown_within`]), here, so that no caller can
//!   forget either; [`note`]: a line of the CLI's own text (the statistics of `generate`),
//!   written the same way.
//! - [`panic_hook`]: the one line of an internal error.
//! - [`Output`]: stdout, whose write errors say `writing the output: ...`.
//!
//! A stderr that cannot be written (`2>/dev/full`, a closed pipe) is ignored, and the exit
//! status stays what it would have been: `eprintln!` panics there, and the panic hook's own
//! `eprintln!` then panicked again, which aborts the process (SIGABRT, exit status 134).

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::input::{shown_within, MESSAGE_MAX_BYTES};

/// Writes `message` as the line `error: MESSAGE` on stderr (escaped and cut); a failed write
/// is ignored.
pub fn error(message: &str) {
    write_line("error: ", message);
}

/// Set by [`set_quiet`]: [`warning`] and [`note`] write nothing.
static QUIET: AtomicBool = AtomicBool::new(false);

/// `--quiet`: from now on nothing but errors goes to stderr ([`warning`] and [`note`] write
/// nothing; [`always`] still writes).
pub fn set_quiet(quiet: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
}

/// Whether [`set_quiet`] silenced warnings and notes.
pub fn is_quiet() -> bool {
    QUIET.load(Ordering::Relaxed)
}

/// Writes `message` as the line `warning: MESSAGE` on stderr (escaped and cut), unless
/// [`set_quiet`]; a failed write is ignored.
pub fn warning(message: &str) {
    if !is_quiet() {
        write_line("warning: ", message);
    }
}

/// Writes `text` as one line on stderr (escaped and cut), unless [`set_quiet`]; a failed write
/// is ignored.
pub fn note(text: &str) {
    if !is_quiet() {
        write_line("", text);
    }
}

/// Writes `text` as one line on stderr (escaped and cut), even with [`set_quiet`]: what a user
/// must see although it is not an error (a completion the schema rejects); a failed write is
/// ignored.
pub fn always(text: &str) {
    write_line("", text);
}

/// The panic hook of the `nucleus` binary: one line, `nucleus: internal error: ...`, and no
/// backtrace; it never panics itself (a second panic aborts the process).
pub fn panic_hook(info: &std::panic::PanicHookInfo<'_>) {
    write_line("nucleus: internal error: ", &info.to_string());
}

/// `prefix` and `message` (escaped and cut) as one line, in one write to stderr, whose
/// failure is ignored.
fn write_line(prefix: &str, message: &str) {
    let line = format!("{prefix}{}\n", shown_within(message, MESSAGE_MAX_BYTES));
    let _ = io::stderr().lock().write_all(line.as_bytes());
}

/// A writer (stdout) whose errors say what failed: `writing the output: No space left on
/// device (os error 28)`, of the same [`io::ErrorKind`] (so that a closed pipe, `BrokenPipe`,
/// still ends a run quietly).
#[derive(Debug)]
pub struct Output<W>(pub W);

impl<W: Write> Write for Output<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf).map_err(writing)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush().map_err(writing)
    }
}

/// `e`, its message led by `writing the output: `.
fn writing(e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("writing the output: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer whose every write fails with `kind`.
    struct Failing(io::ErrorKind);

    impl Write for Failing {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(self.0.into())
        }
        fn flush(&mut self) -> io::Result<()> {
            Err(self.0.into())
        }
    }

    #[test]
    fn output_errors_say_writing_the_output_and_keep_their_kind() {
        let e = Output(Failing(io::ErrorKind::BrokenPipe))
            .write_all(b"x")
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
        assert!(e.to_string().starts_with("writing the output: "), "{e}");
    }
}
