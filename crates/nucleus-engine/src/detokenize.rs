//! Incremental detokenisation and stop strings.
//!
//! [`IncrementalDecoder`] turns a growing list of token ids into text deltas. It decodes each
//! new token in the context of the tokens before it (the approach of Hugging Face TGI and vLLM:
//! decode a window that starts a few tokens back and emit what the new token added), so:
//! - a SentencePiece decoder, which strips one leading space at the start of a decode, strips
//!   it only at the start of the sequence ("beach" then "▁with" gives "beach with");
//! - a byte-fallback sequence (`<0xE4><0xB8><0x96>`) is held back until it forms a whole UTF-8
//!   character: a delta never ends in a broken sequence (U+FFFD) until the request finishes.
//!
//! [`StopStrings`] holds back text that may be the start of a stop string and cuts the text at
//! the first stop string found (the stop string itself is not emitted, as in vLLM and the
//! OpenAI API).

use tokenizers::Tokenizer;

use crate::error::{EngineError, Result};

/// Streams text for one sequence. `ids` holds the prompt then the generated tokens.
#[derive(Clone, Debug)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the decode window (context).
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
}

impl IncrementalDecoder {
    /// A decoder whose context is the prompt: prompt text is never emitted by [`Self::push`].
    pub fn new(prompt_ids: &[u32]) -> Self {
        // A window of a few prompt tokens is enough context for any decoder we know.
        Self {
            ids: prompt_ids.to_vec(),
            prefix_offset: prompt_ids.len().saturating_sub(6),
            read_offset: prompt_ids.len(),
        }
    }

    /// Adds one generated token and returns the text it completes (possibly empty: an
    /// incomplete UTF-8 sequence is held back).
    ///
    /// # Errors
    /// [`EngineError::Tokenizer`] when the tokenizer cannot decode the ids.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        self.emit(tokenizer, false)
    }

    /// The text held back at the end of a request (an incomplete UTF-8 tail, written with
    /// U+FFFD as the tokenizer decodes it).
    ///
    /// # Errors
    /// As [`Self::push`].
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        self.emit(tokenizer, true)
    }

    fn emit(&mut self, tokenizer: &Tokenizer, flush: bool) -> Result<String> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let decode = |ids: &[u32]| {
            tokenizer
                .decode(ids, true)
                .map_err(|e| EngineError::Tokenizer(e.to_string()))
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
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return StopCheck {
                text,
                stopped: true,
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
