//! A model's default sampling parameters from its `generation_config.json`, as vLLM takes them.
//!
//! vLLM (`vllm/config/model.py`, `ModelConfig.get_diff_sampling_param`) reads exactly six
//! fields of a model's generation_config.json, `repetition_penalty`, `temperature`, `top_k`,
//! `top_p`, `min_p` and `max_new_tokens` (its `max_tokens`), and makes each one that is present
//! and not `null` the default of a request that does not set it; every other field (`do_sample`
//! included) is ignored. Its `--generation-config` flag: `auto` reads the model's, `vllm`
//! ignores it, a folder reads that folder's file. [`GenerationDefaults`] is that set of
//! fields.

use std::path::Path;

use serde_json::Value;

use crate::error::{invalid, Result};

/// The file name read in a model folder.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// The sampling defaults of a model's `generation_config.json` (module docs): each field is
/// `Some` when the file sets it (not `null`). Values are checked against the sampling
/// contract's ranges when read, so a default never makes a request invalid.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    /// `temperature`, `>= 0` and finite (0 is greedy).
    pub temperature: Option<f64>,
    /// `top_k`, an integer `>= -1` (0 and -1 are off, as in nucleus-sampling).
    pub top_k: Option<i64>,
    /// `top_p`, in `(0, 1]`.
    pub top_p: Option<f64>,
    /// `min_p`, in `[0, 1]`.
    pub min_p: Option<f64>,
    /// `repetition_penalty`, `> 0` and finite.
    pub repetition_penalty: Option<f64>,
    /// `max_new_tokens`, at least 1: the default most tokens per completion.
    pub max_new_tokens: Option<usize>,
}

impl GenerationDefaults {
    /// Reads `dir/generation_config.json`; no file is no defaults (`Ok(Default)`).
    ///
    /// # Errors
    /// [`crate::EngineError::InvalidModel`] naming the file: not a JSON object, over 64 MiB, or
    /// one of the six fields of the wrong type or outside its range (the message names the
    /// field and the value); [`crate::EngineError::Io`] when it cannot be read.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join(GENERATION_CONFIG_FILE);
        match crate::loader::hf::read_optional_json(&path, GENERATION_CONFIG_FILE)? {
            None => Ok(Self::default()),
            Some(json) => Self::from_json(&json).map_err(|m| invalid(&path, m)),
        }
    }

    /// The defaults of a parsed generation_config.json object; `Err` says which field is wrong.
    pub fn from_json(json: &Value) -> std::result::Result<Self, String> {
        let field = |key: &str| json.get(key).filter(|v| !v.is_null());
        let number = |key: &str, ok: fn(f64) -> bool, range: &str| {
            field(key)
                .map(|v| match v.as_f64() {
                    Some(x) if ok(x) => Ok(x),
                    _ => Err(format!("`{key}` is {v}, expected a number {range}")),
                })
                .transpose()
        };
        let integer = |key: &str, min: i64| {
            field(key)
                .map(|v| match v.as_i64() {
                    Some(x) if x >= min => Ok(x),
                    _ => Err(format!("`{key}` is {v}, expected an integer >= {min}")),
                })
                .transpose()
        };
        Ok(Self {
            temperature: number("temperature", |t| t.is_finite() && t >= 0.0, ">= 0")?,
            top_k: integer("top_k", -1)?,
            top_p: number("top_p", |p| p > 0.0 && p <= 1.0, "in (0, 1]")?,
            min_p: number("min_p", |p| (0.0..=1.0).contains(&p), "in [0, 1]")?,
            repetition_penalty: number("repetition_penalty", |r| r.is_finite() && r > 0.0, "> 0")?,
            max_new_tokens: integer("max_new_tokens", 1)?
                .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        })
    }

    /// The fields set, as `name=value` in vLLM's order, for messages ("taken from the model's
    /// generation_config.json: temperature=0.6, top_p=0.95").
    pub fn describe(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(v) = self.repetition_penalty {
            out.push(format!("repetition_penalty={v}"));
        }
        if let Some(v) = self.temperature {
            out.push(format!("temperature={v}"));
        }
        if let Some(v) = self.top_k {
            out.push(format!("top_k={v}"));
        }
        if let Some(v) = self.top_p {
            out.push(format!("top_p={v}"));
        }
        if let Some(v) = self.min_p {
            out.push(format!("min_p={v}"));
        }
        if let Some(v) = self.max_new_tokens {
            out.push(format!("max_new_tokens={v}"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_the_six_fields_and_ignores_the_rest() {
        let g = GenerationDefaults::from_json(&json!({
            "do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
            "min_p": null, "repetition_penalty": 1.05, "max_new_tokens": 512,
            "eos_token_id": [151645, 151643]
        }))
        .unwrap();
        assert_eq!(
            g,
            GenerationDefaults {
                temperature: Some(0.6),
                top_k: Some(20),
                top_p: Some(0.95),
                min_p: None,
                repetition_penalty: Some(1.05),
                max_new_tokens: Some(512),
            }
        );
        assert_eq!(
            g.describe(),
            [
                "repetition_penalty=1.05",
                "temperature=0.6",
                "top_k=20",
                "top_p=0.95",
                "max_new_tokens=512"
            ]
        );
    }

    #[test]
    fn out_of_range_values_name_the_field() {
        for (doc, key) in [
            (json!({"temperature": -1}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_k": 1.5}), "top_k"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"min_p": 2}), "min_p"),
            (json!({"repetition_penalty": 0}), "repetition_penalty"),
            (json!({"max_new_tokens": 0}), "max_new_tokens"),
            (json!({"temperature": "hot"}), "temperature"),
        ] {
            let e = GenerationDefaults::from_json(&doc).unwrap_err();
            assert!(e.starts_with(&format!("`{key}` is ")), "{e}");
        }
    }
}
