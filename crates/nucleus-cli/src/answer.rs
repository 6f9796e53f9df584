//! How the JSON-lines commands write their answers, one JSON line each, without building a
//! second copy of a large answer in memory.
//!
//! An answer is first serialised into memory, on the worker threads, when it takes at most
//! [`IN_MEMORY_MAX`] bytes ([`Prepared::new`]); a larger one (a `dist` over a big vocabulary, a
//! large `expanded_x`) is serialised straight into the output writer when its turn comes
//! ([`Prepared::write`]), so the only copy of its data in memory is the operator's own output.
//! A value is written as `{"error": ...}` by [`Reply`], its message cut after
//! [`MESSAGE_MAX_BYTES`] bytes.

use std::borrow::Cow;
use std::io::{self, Write};

use serde::{Serialize, Serializer};

use crate::input::{cut, MESSAGE_MAX_BYTES};

/// Answers of at most this many bytes are serialised into memory in parallel; larger ones are
/// written straight to the output (a block of 1,024 small answers holds at most 256 MiB).
pub const IN_MEMORY_MAX: usize = 256 << 10;

/// One answer line: `Ok(answer)` is written as the answer, `Err(error)` as
/// `{"error": {"kind": ..., "message": ...}}`, the message cut after
/// [`MESSAGE_MAX_BYTES`] bytes (then `...`): this is where every error answer of the three
/// JSON-lines commands is serialised, so none is unbounded (JSON escapes control characters
/// itself; a 100 KB unknown field name made a 200 KB message).
#[derive(Debug)]
pub struct Reply<A, E>(pub Result<A, E>);

/// What an error answer holds: a stable snake_case `kind` and a `message` in words.
pub trait ErrorAnswer {
    /// The kind (`invalid_row`, `allocation`, ...).
    fn kind(&self) -> &str;
    /// What was wrong (written cut after [`MESSAGE_MAX_BYTES`] bytes).
    fn message(&self) -> &str;
}

impl<T: ErrorAnswer + ?Sized> ErrorAnswer for &T {
    fn kind(&self) -> &str {
        (**self).kind()
    }
    fn message(&self) -> &str {
        (**self).message()
    }
}

#[derive(Serialize)]
struct ErrorLine<'a> {
    error: ErrorFields<'a>,
}

#[derive(Serialize)]
struct ErrorFields<'a> {
    kind: &'a str,
    message: Cow<'a, str>,
}

impl<A: Serialize, E: ErrorAnswer> Serialize for Reply<A, E> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match &self.0 {
            Ok(answer) => answer.serialize(s),
            Err(error) => ErrorLine {
                error: ErrorFields {
                    kind: error.kind(),
                    message: cut(error.message(), MESSAGE_MAX_BYTES),
                },
            }
            .serialize(s),
        }
    }
}

/// An error object `{"kind", "message"}` for the lines the streaming loop answers itself
/// (`input_too_large`, `allocation`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorObject {
    /// A stable snake_case name.
    pub kind: &'static str,
    /// What was wrong.
    pub message: String,
}

impl ErrorAnswer for ErrorObject {
    fn kind(&self) -> &str {
        self.kind
    }
    fn message(&self) -> &str {
        &self.message
    }
}

/// `{"error": {"kind", "message"}}` as a line (without newline), written by [`Reply`].
pub fn error_line(kind: &'static str, message: String) -> Vec<u8> {
    let error = ErrorObject { kind, message };
    // A struct of two strings serialises.
    serde_json::to_vec(&Reply::<(), _>(Err(error))).unwrap_or_default()
}

/// A `Vec<u8>` writer that holds at most `max` bytes and reserves fallibly: a write past
/// `max`, or one whose memory cannot be had, fails (and the caller falls back).
struct Capped {
    bytes: Vec<u8>,
    max: usize,
}

impl Write for Capped {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.len() > self.max - self.bytes.len() {
            return Err(io::Error::other("answer larger than the in-memory limit"));
        }
        self.bytes
            .try_reserve(buf.len())
            .map_err(|_| io::Error::from(io::ErrorKind::OutOfMemory))?;
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// `value` serialised into memory if it takes at most `max` bytes and the memory is there.
pub fn to_bytes_within<T: Serialize + ?Sized>(value: &T, max: usize) -> Option<Vec<u8>> {
    let mut w = Capped {
        bytes: Vec::new(),
        max,
    };
    serde_json::to_writer(&mut w, value).ok().map(|()| w.bytes)
}

/// `value` as one line in memory (without newline), however large; an `allocation` error line
/// when the memory for it cannot be had. (The per-line functions `answer_line` of the commands,
/// callable on bytes, use this; the commands themselves stream large answers.)
pub fn to_line<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    to_bytes_within(value, usize::MAX).unwrap_or_else(|| {
        error_line(
            "allocation",
            "the answer could not be held in memory".to_string(),
        )
    })
}

/// An answer ready to be written: serialised already when small, else kept to be serialised
/// straight into the output.
pub enum Prepared<T> {
    /// The answer's JSON, without newline.
    Bytes(Vec<u8>),
    /// An answer larger than [`IN_MEMORY_MAX`] (or one whose memory was not there).
    Value(T),
}

impl<T: Serialize> Prepared<T> {
    /// Serialises `value` into memory when it takes at most [`IN_MEMORY_MAX`] bytes (freeing
    /// `value`), else keeps it.
    pub fn new(value: T) -> Self {
        match to_bytes_within(&value, IN_MEMORY_MAX) {
            Some(bytes) => Prepared::Bytes(bytes),
            None => Prepared::Value(value),
        }
    }

    /// Writes the answer and a newline to `out`.
    ///
    /// # Errors
    /// Writing fails.
    pub fn write(&self, out: &mut dyn Write) -> io::Result<()> {
        match self {
            Prepared::Bytes(bytes) => out.write_all(bytes)?,
            Prepared::Value(value) => write_json(value, out)?,
        }
        out.write_all(b"\n")
    }
}

/// Serialises `value` straight into `out` (no newline).
///
/// # Errors
/// Writing fails.
pub fn write_json<T: Serialize + ?Sized>(value: &T, out: &mut dyn Write) -> io::Result<()> {
    serde_json::to_writer(&mut *out, value).map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_answers_are_serialised_in_memory_and_large_ones_streamed_alike() {
        let small: Reply<Vec<u32>, ErrorObject> = Reply(Ok(vec![1, 2]));
        let big: Reply<Vec<u32>, ErrorObject> = Reply(Ok(vec![7; IN_MEMORY_MAX]));
        let error: Reply<Vec<u32>, ErrorObject> = Reply(Err(ErrorObject {
            kind: "shape",
            message: "m".into(),
        }));
        let mut out = Vec::new();
        for value in [small, big, error] {
            let prepared = Prepared::new(value);
            prepared.write(&mut out).unwrap();
        }
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "[1,2]");
        assert_eq!(lines[1].len(), 2 * IN_MEMORY_MAX + 1);
        assert_eq!(lines[2], r#"{"error":{"kind":"shape","message":"m"}}"#);
        assert!(to_bytes_within(&vec![7u32; 10], 5).is_none());
        assert_eq!(to_line(&[1u8]), b"[1]");
    }

    #[test]
    fn an_error_answer_s_message_is_cut_at_the_bound() {
        let long = "é".repeat(MESSAGE_MAX_BYTES);
        let line = error_line("invalid_row", long);
        let value: serde_json::Value = serde_json::from_slice(&line).unwrap();
        let message = value["error"]["message"].as_str().unwrap();
        assert_eq!(message.len(), MESSAGE_MAX_BYTES + 3);
        assert!(message.ends_with("é..."), "{message}");
        assert_eq!(value["error"]["kind"], "invalid_row");
    }
}
