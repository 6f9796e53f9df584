//! What every command that reads input shares: the `--max-input-bytes` flag ([`InputLimit`]),
//! reading a file given by a flag within that limit ([`read_file`], [`read_stdin`]), JSON
//! lines read within it ([`LineReader`]), a tensor copied out of a file's bytes into memory
//! reserved first ([`copy_tensor`]), and how names and messages are echoed ([`shown`],
//! [`shown_path`], [`shown_within`], [`cut`]).
//!
//! # The limit
//!
//! `--max-input-bytes N` (default 1 GiB: `1G`) bounds one JSON line and one input file.
//! N is a byte count, optionally followed by `K`, `M` or `G` (either case: 1024, 1024², 1024³
//! bytes); 0 is refused.
//!
//! - A JSON line (stdin or `--input`) longer than N bytes, not counting its `\n` (a `\r`
//!   counts), whatever it holds (blank too), is answered in its place by `{"error": {"kind": "input_too_large", ...}}`
//!   ([`Line::TooLarge`]) as soon as byte N + 1 arrives; its other bytes are skipped without
//!   being held, up to the next newline; the lines after it are answered as usual.
//! - A file (`--params`, `--attrs` when a file, `--logits`, `--tensors`, `--text`,
//!   `--grammar`, `--json-schema` when a file, `--tokenizer`) larger than N bytes is refused
//!   before it is read: from its size for a regular file, after at most N + 1 bytes for a pipe
//!   or a device. GGUF models (`--model`) are not limited: they are many gigabytes, and the
//!   model loader checks their sizes against the file.

use std::fmt;
use std::io::{self, BufRead, Read};
use std::path::Path;

use clap::Args;

/// The default of `--max-input-bytes`: 1 GiB.
pub const DEFAULT_MAX_INPUT_BYTES: u64 = 1 << 30;

/// The value of `--max-input-bytes`: at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxInputBytes(pub u64);

impl Default for MaxInputBytes {
    fn default() -> Self {
        MaxInputBytes(DEFAULT_MAX_INPUT_BYTES)
    }
}

impl MaxInputBytes {
    /// The limit as a `usize` (saturated on 32-bit targets, where no more can be held anyway).
    pub fn bytes(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }
}

impl fmt::Display for MaxInputBytes {
    /// `1073741824 bytes (1G)`, or `1000 bytes` when N is no multiple of 1024.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0;
        write!(f, "{n} bytes")?;
        for (shift, suffix) in [(30, 'G'), (20, 'M'), (10, 'K')] {
            if n >= 1 << shift && n.is_multiple_of(1 << shift) {
                return write!(f, " ({}{suffix})", n >> shift);
            }
        }
        Ok(())
    }
}

/// Parses `--max-input-bytes`: a decimal byte count, optionally followed by `K`, `M` or `G`
/// (either case; powers of 1024). 0 is refused.
///
/// # Errors
/// Not a number, an unknown suffix, 0, or more than `u64::MAX` bytes.
pub fn parse_max_input_bytes(s: &str) -> Result<MaxInputBytes, String> {
    let (digits, shift) = match s.as_bytes().last() {
        Some(b'k' | b'K') => (&s[..s.len() - 1], 10),
        Some(b'm' | b'M') => (&s[..s.len() - 1], 20),
        Some(b'g' | b'G') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "expected a byte count, optionally followed by K, M or G (powers of 1024), got `{}`",
            shown(s)
        ));
    }
    let n = digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(|| format!("`{}` is more than {} bytes", shown(s), u64::MAX))?;
    if n == 0 {
        return Err("must be at least 1 byte".to_string());
    }
    Ok(MaxInputBytes(n))
}

/// The flag `--max-input-bytes`, flattened into every command that reads input.
#[derive(Args, Debug, Clone, Copy, Default)]
pub struct InputLimit {
    /// Most bytes of one JSON line and of one input file (not of a GGUF model); K, M, G are
    /// powers of 1024. A longer line is answered with an `input_too_large` error, a larger
    /// file is refused.
    #[arg(
        long = "max-input-bytes",
        value_name = "N",
        default_value = "1G",
        value_parser = parse_max_input_bytes
    )]
    pub max_input_bytes: MaxInputBytes,
}

/// Most bytes of an echoed user string (a file or tensor name) in a message.
pub const SHOWN_MAX_BYTES: usize = 256;

/// `text` as error messages echo it: control characters escaped (`\n`, `\u{1b}`), cut after
/// [`SHOWN_MAX_BYTES`] bytes with `...` (so a hostile name cannot flood or forge a line).
pub fn shown(text: &str) -> String {
    shown_within(text, SHOWN_MAX_BYTES)
}

/// The most bytes of one message: an `error:` or `warning:` line on stderr
/// ([`crate::report`]), the message of an error answer ([`crate::answer`]), a library's
/// message quoted by [`not_safetensors`]. A longer one is cut there and ends in `...`.
pub const MESSAGE_MAX_BYTES: usize = 1024;

/// The message for bytes that are not a safetensors file: the safetensors crate's own, which
/// quotes the file's header (a dtype name, a tensor name), escaped and cut as [`shown`] does,
/// at [`MESSAGE_MAX_BYTES`].
pub fn not_safetensors(e: &safetensors::SafeTensorError) -> String {
    format!(
        "not a safetensors file: {}",
        shown_within(&e.to_string(), MESSAGE_MAX_BYTES)
    )
}

/// `text` with control characters escaped, cut after `max` bytes (then `...`).
pub fn shown_within(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if out.len() >= max {
            out.push_str("...");
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// `text` cut after at most `max` bytes, at a character boundary, then `...`; unchanged when
/// it is no longer (the messages of JSON answers, whose control characters JSON escapes).
pub fn cut(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    std::borrow::Cow::Owned(format!("{}...", &text[..end]))
}

/// The `len` values of a tensor copied out of a file's bytes into a vector reserved first
/// (`try_reserve_exact`), so that a tensor within `--max-input-bytes` whose copy the machine
/// cannot hold is a message, not an abort; a value that fails its conversion (`Err`) stops
/// the copy with that error.
///
/// # Errors
/// [`TensorCopyError::Memory`] naming the tensor and the bytes when the vector cannot be
/// reserved; [`TensorCopyError::Value`] with the first value's error.
pub fn copy_tensor<T, E>(
    name: &str,
    len: usize,
    values: impl Iterator<Item = Result<T, E>>,
) -> Result<Vec<T>, TensorCopyError<E>> {
    let mut v = Vec::new();
    if v.try_reserve_exact(len).is_err() {
        return Err(TensorCopyError::Memory(format!(
            "cannot hold tensor `{}` in memory: {len} values of {} bytes ({} bytes)",
            shown(name),
            std::mem::size_of::<T>(),
            (len as u128) * std::mem::size_of::<T>() as u128
        )));
    }
    for value in values.take(len) {
        v.push(value.map_err(TensorCopyError::Value)?);
    }
    Ok(v)
}

/// [`copy_tensor`] of values that cannot fail their conversion.
///
/// # Errors
/// The message of [`TensorCopyError::Memory`].
pub fn copy_values<T>(
    name: &str,
    len: usize,
    values: impl Iterator<Item = T>,
) -> Result<Vec<T>, String> {
    copy_tensor(name, len, values.map(Ok::<T, std::convert::Infallible>)).map_err(|e| match e {
        TensorCopyError::Memory(m) => m,
        TensorCopyError::Value(never) => match never {},
    })
}

/// The little-endian words of `W` bytes of a tensor's data.
pub fn words<const W: usize>(raw: &[u8]) -> impl Iterator<Item = [u8; W]> + '_ {
    raw.chunks_exact(W).map(|b| {
        let mut w = [0u8; W];
        w.copy_from_slice(b);
        w
    })
}

/// An integer tensor's data (`dtype` I32, or I64 as PyTorch writes its default integer type)
/// copied out as i32 values ([`copy_tensor`]); `None` for any other dtype. An I64 value
/// outside i32 stops the copy with `out_of_range(flat index, value)`.
pub fn copy_i32_tensor<E>(
    name: &str,
    dtype: safetensors::Dtype,
    raw: &[u8],
    out_of_range: impl Fn(usize, i64) -> E,
) -> Option<Result<Vec<i32>, TensorCopyError<E>>> {
    Some(match dtype {
        safetensors::Dtype::I32 => copy_tensor(
            name,
            raw.len() / 4,
            words::<4>(raw).map(|w| Ok(i32::from_le_bytes(w))),
        ),
        safetensors::Dtype::I64 => copy_tensor(
            name,
            raw.len() / 8,
            words::<8>(raw)
                .map(i64::from_le_bytes)
                .enumerate()
                .map(|(i, v)| i32::try_from(v).map_err(|_| out_of_range(i, v))),
        ),
        _ => return None,
    })
}

/// Why [`copy_tensor`] failed.
#[derive(Debug)]
pub enum TensorCopyError<E> {
    /// The copy cannot be held in memory: a message for the run's one `error:` line (exit
    /// status 1).
    Memory(String),
    /// A value's own error.
    Value(E),
}

/// A path as error messages echo it ([`shown`] of its lossy UTF-8 form).
pub fn shown_path(path: &Path) -> String {
    shown(&path.to_string_lossy())
}

/// Why a file given by a flag was not read.
#[derive(Debug)]
pub enum FileError {
    /// The file could not be opened or read, or is a directory (an unusable input, exit 1).
    Unreadable(String),
    /// The file is larger than `--max-input-bytes`.
    TooLarge(String),
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FileError::Unreadable(m) | FileError::TooLarge(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for FileError {}

/// Reads the file `path` given by `flag` (`"--logits"`), refusing one larger than `limit`
/// before reading it (regular files: from their size) or after `limit + 1` bytes (pipes,
/// devices).
///
/// # Errors
/// [`FileError::Unreadable`] for a file that cannot be opened or read, a directory, or one
/// that cannot be held in memory; [`FileError::TooLarge`] for one larger than `limit`.
pub fn read_file(flag: &str, path: &Path, limit: MaxInputBytes) -> Result<Vec<u8>, FileError> {
    let name = shown_path(path);
    let unreadable =
        |e: io::Error| FileError::Unreadable(format!("cannot read {flag} {name}: {e}"));
    let file = std::fs::File::open(path).map_err(unreadable)?;
    let meta = file.metadata().map_err(unreadable)?;
    if meta.is_dir() {
        return Err(unreadable(io::ErrorKind::IsADirectory.into()));
    }
    if meta.is_file() && meta.len() > limit.0 {
        return Err(FileError::TooLarge(format!(
            "{flag} {name} is {} bytes, more than the --max-input-bytes limit of {limit}",
            meta.len()
        )));
    }
    let expected = if meta.is_file() { meta.len() } else { 0 };
    read_limited(file, flag, &name, expected, limit)
}

/// Reads standard input for `flag` (`--text -`), at most `limit` bytes.
///
/// # Errors
/// As [`read_file`].
pub fn read_stdin(flag: &str, limit: MaxInputBytes) -> Result<Vec<u8>, FileError> {
    read_limited(io::stdin().lock(), flag, "- (stdin)", 0, limit)
}

/// Reads at most `limit + 1` bytes of `source`, `expected` of them reserved first.
fn read_limited(
    source: impl Read,
    flag: &str,
    name: &str,
    expected: u64,
    limit: MaxInputBytes,
) -> Result<Vec<u8>, FileError> {
    let mut bytes = Vec::new();
    let reserve = usize::try_from(expected.min(limit.0)).unwrap_or(usize::MAX);
    bytes.try_reserve_exact(reserve).map_err(|_| {
        FileError::Unreadable(format!(
            "cannot hold {flag} {name} in memory ({expected} bytes)"
        ))
    })?;
    source
        .take(limit.0.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| FileError::Unreadable(format!("cannot read {flag} {name}: {e}")))?;
    if bytes.len() as u64 > limit.0 {
        return Err(FileError::TooLarge(format!(
            "{flag} {name} holds more than the --max-input-bytes limit of {limit}"
        )));
    }
    Ok(bytes)
}

/// One line of JSON-lines input ([`LineReader::next_line`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// The line's bytes, without its `\n` (a leading byte-order mark removed from the first).
    Text(Vec<u8>),
    /// A line longer than the limit: its bytes are skipped up to the next newline.
    TooLarge,
    /// A line within the limit that could not be held in memory (the allocation failed after
    /// `read` bytes); its other bytes are skipped as for [`Line::TooLarge`].
    Unallocatable {
        /// Bytes of the line read when the allocation failed.
        read: usize,
    },
}

/// The UTF-8 byte order mark, removed from the start of the input (Windows editors write it).
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Splits a byte stream into lines of at most `limit` bytes each (not counting the `\n`),
/// holding at most `limit` bytes of a line: a longer one is [`Line::TooLarge`] as soon as its
/// byte `limit + 1` is read, and its remaining bytes are then skipped in constant memory.
pub struct LineReader<R> {
    inner: R,
    limit: usize,
    /// No line has been returned yet (the byte order mark is removed from the first).
    first: bool,
    /// Inside a line that was answered as too large: skip up to the next newline first.
    skipping: bool,
}

impl<R: BufRead> LineReader<R> {
    /// Lines of `inner`, at most `limit` bytes each.
    pub fn new(inner: R, limit: MaxInputBytes) -> Self {
        Self {
            inner,
            limit: limit.bytes(),
            first: true,
            skipping: false,
        }
    }

    /// The next line; `None` at the end of the input.
    ///
    /// # Errors
    /// A read error of the underlying stream (`Interrupted` is retried).
    pub fn next_line(&mut self) -> io::Result<Option<Line>> {
        if self.skipping {
            loop {
                let buf = fill(&mut self.inner)?;
                if buf.is_empty() {
                    self.skipping = false;
                    return Ok(None);
                }
                match buf.iter().position(|&b| b == b'\n') {
                    Some(i) => {
                        self.inner.consume(i + 1);
                        self.skipping = false;
                        break;
                    }
                    None => {
                        let n = buf.len();
                        self.inner.consume(n);
                    }
                }
            }
        }
        let mut line = Vec::new();
        loop {
            let buf = fill(&mut self.inner)?;
            if buf.is_empty() {
                return Ok((!line.is_empty()).then(|| self.finish(line)));
            }
            let (chunk_len, newline) = match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (i, true),
                None => (buf.len(), false),
            };
            let used = chunk_len + usize::from(newline);
            let total = line.len().saturating_add(chunk_len);
            if total > self.limit {
                self.inner.consume(used);
                self.skipping = !newline;
                self.first = false;
                return Ok(Some(Line::TooLarge));
            }
            if total > line.capacity() {
                // Grow by doubling, but never past the limit (a line of 600 MiB under a 1 GiB
                // limit must not reserve 1.2 GiB).
                let want = total.max(line.capacity().saturating_mul(2)).min(self.limit);
                if line.try_reserve_exact(want - line.len()).is_err() {
                    let read = line.len();
                    drop(line);
                    self.inner.consume(used);
                    self.skipping = !newline;
                    self.first = false;
                    return Ok(Some(Line::Unallocatable { read }));
                }
            }
            line.extend_from_slice(&buf[..chunk_len]);
            self.inner.consume(used);
            if newline {
                return Ok(Some(self.finish(line)));
            }
        }
    }

    fn finish(&mut self, mut line: Vec<u8>) -> Line {
        if std::mem::take(&mut self.first) && line.starts_with(BOM) {
            line.drain(..BOM.len());
        }
        Line::Text(line)
    }
}

/// `fill_buf`, retried on `Interrupted`.
fn fill<R: BufRead>(r: &mut R) -> io::Result<&[u8]> {
    loop {
        match r.fill_buf() {
            // The end of the input: not read again (a terminal would wait for a second ^D).
            Ok([]) => return Ok(&[]),
            // Data is buffered: the call below returns it without reading (returning `b`
            // from inside the loop is what the borrow checker cannot yet accept).
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    r.fill_buf()
}

/// The message of a [`Line::TooLarge`] answer.
pub fn too_large_message(limit: MaxInputBytes) -> String {
    format!(
        "the line is longer than the --max-input-bytes limit of {limit}: it was skipped (raise the limit with --max-input-bytes N)"
    )
}

/// The message of a [`Line::Unallocatable`] answer.
pub fn unallocatable_message(read: usize) -> String {
    format!(
        "the line could not be held in memory (the allocation failed after {read} bytes): it was skipped"
    )
}

/// Opens `--input PATH` for reading: `-` is stdin; a directory is refused up front (opening
/// one succeeds on Unix, and only the first read would fail, without the path).
///
/// # Errors
/// The file cannot be opened, or is a directory.
pub fn open_input(path: &Path) -> io::Result<Box<dyn Read + Send>> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(io::stdin()));
    }
    let file = std::fs::File::open(path)?;
    if file.metadata()?.is_dir() {
        return Err(io::ErrorKind::IsADirectory.into());
    }
    Ok(Box::new(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], limit: u64) -> Vec<Line> {
        // A tiny buffer, so that lines and the limit straddle buffer refills.
        let reader = io::BufReader::with_capacity(3, input);
        let mut r = LineReader::new(reader, MaxInputBytes(limit));
        let mut out = Vec::new();
        while let Some(line) = r.next_line().unwrap() {
            out.push(line);
        }
        out
    }

    fn text(s: &str) -> Line {
        Line::Text(s.as_bytes().to_vec())
    }

    #[test]
    fn lines_at_the_limit_pass_and_longer_ones_are_skipped_to_their_newline() {
        assert_eq!(
            lines(b"abcd\nabcde\nab\n\nxyz", 4),
            [
                text("abcd"),
                Line::TooLarge,
                text("ab"),
                text(""),
                text("xyz")
            ]
        );
        // A last line without newline beyond the limit; one that is too large at the end.
        assert_eq!(lines(b"ab\nabcdefgh", 4), [text("ab"), Line::TooLarge]);
        assert_eq!(lines(b"abcdefgh\n", 4), [Line::TooLarge]);
        assert_eq!(lines(b"", 4), []);
    }

    #[test]
    fn the_byte_order_mark_is_removed_from_the_first_line_only() {
        assert_eq!(
            lines(b"\xEF\xBB\xBFab\n\xEF\xBB\xBFcd\n", 100),
            [text("ab"), Line::Text(b"\xEF\xBB\xBFcd".to_vec())]
        );
    }

    #[test]
    fn a_too_large_line_is_reported_before_its_end_arrives() {
        // An endless line: the answer must not wait for its newline.
        let endless = io::BufReader::with_capacity(8, io::repeat(b'0'));
        let mut r = LineReader::new(endless, MaxInputBytes(100));
        assert_eq!(r.next_line().unwrap(), Some(Line::TooLarge));
    }

    #[test]
    fn max_input_bytes_takes_counts_and_binary_suffixes() {
        let p = |s| parse_max_input_bytes(s).map(|m| m.0);
        assert_eq!(p("1"), Ok(1));
        assert_eq!(p("1000"), Ok(1000));
        assert_eq!(p("4k"), Ok(4096));
        assert_eq!(p("3M"), Ok(3 << 20));
        assert_eq!(p("1G"), Ok(1 << 30));
        for bad in [
            "0",
            "0K",
            "",
            "K",
            "1.5G",
            "-1",
            "1T",
            "1 G",
            "99999999999999999999",
        ] {
            assert!(p(bad).is_err(), "{bad:?}");
        }
        assert_eq!(MaxInputBytes(1 << 30).to_string(), "1073741824 bytes (1G)");
        assert_eq!(MaxInputBytes(1000).to_string(), "1000 bytes");
        assert_eq!(MaxInputBytes(3072).to_string(), "3072 bytes (3K)");
    }

    #[test]
    fn cut_keeps_short_text_and_cuts_long_text_at_a_character_boundary() {
        assert_eq!(cut("abc", 3), "abc");
        assert_eq!(cut("abcd", 3), "abc...");
        // "é" is two bytes: a cut inside it goes back to its start.
        assert_eq!(cut("aéb", 2), "a...");
    }

    #[test]
    fn shown_escapes_control_characters_and_caps_the_length() {
        assert_eq!(shown("a\nb\u{1b}c"), "a\\nb\\u{1b}c");
        let long = "x".repeat(1000);
        let s = shown(&long);
        assert_eq!(s.len(), SHOWN_MAX_BYTES + 3);
        assert!(s.ends_with("..."));
        assert_eq!(
            shown(&"y".repeat(SHOWN_MAX_BYTES)),
            "y".repeat(SHOWN_MAX_BYTES)
        );
    }
}
