//! Incremental detokenisation and stop strings.
//!
//! [`IncrementalDecoder`] turns a growing list of token ids into text deltas. It decodes each
//! new token in the context of the tokens before it (the approach of Hugging Face TGI and vLLM:
//! decode a window that starts a few tokens back and emit what the new token added), so:
//! - a SentencePiece decoder, which strips one leading space at the start of a decode, strips
//!   it only at the start of the sequence ("beach" then "▁with" gives "beach with");
//! - a byte-fallback sequence (`<0xE4><0xB8><0x96>`) is held back until it forms a whole UTF-8
//!   character: a delta never ends in a broken sequence (U+FFFD) until the request finishes;
//! - bytes that never form a character (a sequence cut off by `max_tokens`, or interrupted)
//!   become one U+FFFD per maximal invalid subsequence, as `String::from_utf8_lossy` and
//!   Python's `errors="replace"` write them ([`ByteTokens`]), not one per byte as the
//!   `ByteFallback` decoder of Hugging Face tokenizers does.
//!
//! [`StopStrings`] holds back text that may be the start of a stop string and cuts the text at
//! the first stop string found (the stop string itself is not emitted, as in vLLM and the
//! OpenAI API).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::Tokenizer;

use crate::error::Result;
use crate::tokenizer::ModelTokenizer;

/// The byte tokens `<0x00>` ... `<0xFF>` of a tokenizer whose decoder has `ByteFallback`
/// (SentencePiece models such as Llama 2's), so that runs of them decode as
/// `String::from_utf8_lossy` does: Hugging Face's `ByteFallback` decoder writes one U+FFFD for
/// every byte of a run that is not valid UTF-8 (`<0xE7><0x8C>` cut off by `max_tokens` gives
/// two), where the Unicode standard's "maximal subparts" practice, followed by
/// `from_utf8_lossy` and Python, writes one per maximal invalid subsequence (one here).
#[derive(Clone, Debug)]
pub struct ByteTokens {
    byte_of: HashMap<u32, u8>,
    id_of: [Option<u32>; 256],
}

impl ByteTokens {
    /// The byte tokens of `tokenizer`, or `None` when its decoder has no `ByteFallback` step
    /// (byte-level BPE decodes runs of bytes with `from_utf8_lossy` already) or its
    /// vocabulary lacks the bytes of U+FFFD (`<0xEF><0xBF><0xBD>`).
    pub fn new(tokenizer: &Tokenizer) -> Option<Arc<Self>> {
        fn has_byte_fallback(d: &DecoderWrapper) -> bool {
            match d {
                DecoderWrapper::ByteFallback(_) => true,
                DecoderWrapper::Sequence(s) => s.get_decoders().iter().any(has_byte_fallback),
                _ => false,
            }
        }
        if !tokenizer.get_decoder().is_some_and(has_byte_fallback) {
            return None;
        }
        let mut byte_of = HashMap::new();
        let mut id_of = [None; 256];
        for b in 0..=255u8 {
            if let Some(id) = tokenizer.token_to_id(&format!("<0x{b:02X}>")) {
                byte_of.insert(id, b);
                id_of[b as usize] = Some(id);
            }
        }
        let replacement = "\u{FFFD}".as_bytes();
        if replacement.iter().any(|&b| id_of[b as usize].is_none()) {
            return None;
        }
        Some(Arc::new(Self { byte_of, id_of }))
    }

    /// `ids` with every maximal run of byte tokens that is not valid UTF-8 replaced by the
    /// byte tokens of its `from_utf8_lossy` text, so that the tokenizer's decoder writes that
    /// text. Borrowed when nothing changes.
    pub fn lossy<'a>(&self, ids: &'a [u32]) -> Cow<'a, [u32]> {
        let mut out: Option<Vec<u32>> = None;
        let mut i = 0;
        while i < ids.len() {
            if !self.byte_of.contains_key(&ids[i]) {
                if let Some(out) = &mut out {
                    out.push(ids[i]);
                }
                i += 1;
                continue;
            }
            let start = i;
            while i < ids.len() && self.byte_of.contains_key(&ids[i]) {
                i += 1;
            }
            let bytes: Vec<u8> = ids[start..i].iter().map(|id| self.byte_of[id]).collect();
            match String::from_utf8_lossy(&bytes) {
                Cow::Borrowed(_) => {
                    if let Some(out) = &mut out {
                        out.extend_from_slice(&ids[start..i]);
                    }
                }
                Cow::Owned(text) => {
                    let out = out.get_or_insert_with(|| ids[..start].to_vec());
                    // Every byte of the lossy text is a byte of the run or of U+FFFD.
                    out.extend(text.bytes().filter_map(|b| self.id_of[b as usize]));
                }
            }
        }
        match out {
            Some(v) => Cow::Owned(v),
            None => Cow::Borrowed(ids),
        }
    }
}

/// Streams text for one sequence. `ids` holds the prompt then the generated tokens.
#[derive(Clone, Debug)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the decode window (context).
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
    /// The tokenizer's byte tokens, when runs of them are decoded lossily ourselves.
    bytes: Option<Arc<ByteTokens>>,
    /// Drop special (control) tokens from the text (the default, as vLLM's
    /// `skip_special_tokens`).
    skip_special: bool,
}

impl IncrementalDecoder {
    /// A decoder whose context is the prompt: prompt text is never emitted by [`Self::push`].
    pub fn new(prompt_ids: &[u32]) -> Self {
        // A window of a few prompt tokens is enough context for any decoder we know.
        Self {
            ids: prompt_ids.to_vec(),
            prefix_offset: prompt_ids.len().saturating_sub(6),
            read_offset: prompt_ids.len(),
            bytes: None,
            skip_special: true,
        }
    }

    /// Whether special (control) tokens are left out of the text (default true; vLLM's
    /// `skip_special_tokens`).
    pub fn skip_special_tokens(mut self, skip: bool) -> Self {
        self.skip_special = skip;
        self
    }

    /// Decodes runs of byte tokens with `from_utf8_lossy`'s replacement rule (see
    /// [`ByteTokens`]); `None` leaves decoding to the tokenizer alone.
    pub fn with_byte_tokens(mut self, bytes: Option<Arc<ByteTokens>>) -> Self {
        self.bytes = bytes;
        self
    }

    /// Adds one generated token and returns the text it completes (possibly empty: an
    /// incomplete UTF-8 sequence is held back).
    ///
    /// # Errors
    /// [`crate::EngineError::Tokenizer`] when the tokenizer cannot decode the ids (one outside the
    /// vocabulary).
    pub fn push(&mut self, tokenizer: &ModelTokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        self.emit(tokenizer, false)
    }

    /// The text held back at the end of a request: an incomplete UTF-8 tail, written with
    /// one U+FFFD per maximal invalid subsequence when [`Self::with_byte_tokens`] was given
    /// the tokenizer's byte tokens, else as the tokenizer decodes it.
    ///
    /// # Errors
    /// As [`Self::push`].
    pub fn finish(&mut self, tokenizer: &ModelTokenizer) -> Result<String> {
        self.emit(tokenizer, true)
    }

    /// Decodes with [`ModelTokenizer::decode`] (special tokens skipped unless
    /// [`Self::skip_special_tokens`] said otherwise), so added tokens of a
    /// byte-level vocabulary come out as their text, as llama.cpp's `token_to_piece` gives them.
    fn emit(&mut self, tokenizer: &ModelTokenizer, flush: bool) -> Result<String> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let decode = |ids: &[u32]| {
            let ids = match &self.bytes {
                Some(bytes) => bytes.lossy(ids),
                None => Cow::Borrowed(ids),
            };
            tokenizer.decode(&ids, self.skip_special)
        };
        let prefix_text = decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let new_text = decode(&self.ids[self.prefix_offset..])?;
        let complete = !new_text.ends_with('\u{FFFD}');
        if new_text.len() > prefix_text.len() && (complete || flush) {
            if let Some(delta) = new_text.get(prefix_text.len()..) {
                let delta = delta.to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                return Ok(delta);
            }
        }
        Ok(String::new())
    }
}

/// Stop-string matching over streamed text.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
}

/// What [`StopStrings::push`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopCheck {
    /// Text safe to emit now.
    pub text: String,
    /// Whether a stop string was found (the text stops before it).
    pub stopped: bool,
    /// The stop string found (the one that starts first; of those, the first given).
    pub matched: Option<String>,
}

impl StopStrings {
    /// Stop strings to look for; empty strings are ignored.
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Adds a text delta. Returns the text that can be emitted: everything before the first
    /// stop string (and then `stopped`), or everything but the longest tail that is a proper
    /// prefix of some stop string.
    pub fn push(&mut self, delta: &str) -> StopCheck {
        self.pending.push_str(delta);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = first {
            let text = self.pending[..at].to_string();
            let matched = Some(stop.clone());
            self.pending.clear();
            return StopCheck {
                text,
                stopped: true,
                matched,
            };
        }
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.pending, s))
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let text = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopCheck {
            text,
            stopped: false,
            matched: None,
        }
    }

    /// The text still held back (emitted when the request finishes for another reason).
    pub fn take_pending(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// The length in bytes of the longest suffix of `text` that is a proper prefix of `stop`.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = stop.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k)
                && stop.is_char_boundary(k)
                && text.ends_with(&stop[..k])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = StopStrings::new(&stops);
        let mut out = String::new();
        for d in deltas {
            let c = s.push(d);
            out += &c.text;
            if c.stopped {
                return (out, true);
            }
        }
        out += &s.take_pending();
        (out, false)
    }

    #[test]
    fn stop_string_split_across_deltas_is_cut() {
        assert_eq!(
            run(&["the end"], &["and th", "e e", "nd!"]),
            ("and ".into(), true)
        );
    }

    #[test]
    fn possible_stop_prefix_is_held_then_released() {
        let stops = vec!["STOP".to_string()];
        let mut s = StopStrings::new(&stops);
        assert_eq!(s.push("go ST").text, "go ");
        assert_eq!(s.push("ay").text, "STay");
    }

    #[test]
    fn earliest_of_several_stop_strings_wins() {
        assert_eq!(run(&["c", "ab"], &["xxabc"]), ("xx".into(), true));
    }

    #[test]
    fn no_stop_strings_passes_everything() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn multibyte_hold_respects_char_boundaries() {
        assert_eq!(run(&["é!"], &["café", "?"]), ("café?".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }
}
