//! Loading a GGUF file: [`load_gguf`] reads the model (a [`crate::Transformer`]) and its
//! tokenizer ([`ModelTokenizer`]) from one file, plus the metadata helpers both use.
//!
//! GGUF is llama.cpp's file format: a header, typed key/value metadata (`general.architecture`,
//! `llama.*` hyper-parameters, `tokenizer.ggml.*`), tensor descriptions and aligned tensor data
//! (spec: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>). The header is parsed once,
//! by our checked parser ([`crate::gguf::read_content`]); tensor data is read by candle
//! (`candle_core::quantized::gguf_file::Content::tensor`). What we read from the metadata is
//! checked here, so that a missing key, a wrong type or a corrupt file is an [`EngineError`],
//! never a panic, and its message is short and printable (values described by
//! [`crate::gguf::describe`], never printed whole); the typed accessors (`md_u64`, …) live
//! beside the parser in [`crate::gguf`].

use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file;
use candle_core::Device;

use crate::error::{invalid, EngineError, Result};
use crate::gguf::md_u64;
use crate::loader::gguf_model::MappedFiles;
use crate::loader::LoadedModel;
use crate::tokenizer::ModelTokenizer;

/// Reads a Llama-architecture model and its tokenizer from the GGUF file at `path`, with the
/// weights on `device`.
///
/// Semantics: [`crate::gguf::read_content`] parses and checks the header, metadata and tensor
/// descriptions (once), then the `llama` mapping reads the weights and hyper-parameters (see
/// [`crate::loader`] for the metadata keys and tensor names)
/// and [`ModelTokenizer::from_gguf`] the tokenizer; their warnings end up in
/// [`LoadedModel::warnings`]. The tokenizer may not hold more tokens than the
/// model's vocabulary (the token embedding's rows); fewer is fine (padded vocabularies).
///
/// Errors:
/// - [`EngineError::Io`] when the file cannot be opened or read;
/// - [`EngineError::InvalidModel`] when `path` is not a regular file (a directory, a device, a
///   FIFO: never opened, so never blocked on);
/// - [`EngineError::InvalidModel`] (naming `path`, the key or tensor and its value, in at most
///   [`crate::error::MAX_MESSAGE_BYTES`] bytes with file text escaped) when it is not a GGUF
///   file, is truncated or corrupt (every check of [`crate::gguf::read_content`]), lacks a
///   tensor or metadata key, has a tensor of the wrong shape, has malformed tokenizer metadata,
///   or a BOS or EOS id outside the vocabulary;
/// - [`EngineError::Unsupported`] for an architecture other than `llama`, `qwen2`, `qwen3`,
///   or a tokenizer kind other than `llama` / `gpt2`.
pub fn load_gguf(path: &Path, device: &Device) -> Result<LoadedModel> {
    let _span = tracing::debug_span!("load_gguf", path = %path.display()).entered();
    let (content, mut reader) = open_gguf(path)?;
    match split_count(&content, path)? {
        None => {
            let mapped = MappedFiles {
                parts: map_file(reader.get_ref(), path)
                    .map(|m| (0, m))
                    .into_iter()
                    .collect(),
            };
            load_content(content, &mut reader, Some(&mapped), path, device)
        }
        Some(count) => {
            let (merged, mut joined) = join_splits(content, reader, path, count)?;
            let mapped = MappedFiles {
                parts: joined
                    .files
                    .iter()
                    .zip(&joined.bases)
                    .filter_map(|(file, &base)| Some((base, map_file(file, path)?)))
                    .collect(),
            };
            load_content(merged, &mut joined, Some(&mapped), path, device)
        }
    }
}

/// `split.count` when the file is the first of several (llama.cpp's `gguf-split` keys:
/// `split.no` from 0, `split.count`); `None` for a whole file.
///
/// # Errors
/// `InvalidModel` when the file is a later split (`split.no` > 0: the first must be given) or
/// the keys are malformed.
fn split_count(content: &gguf_file::Content, path: &Path) -> Result<Option<u64>> {
    let count = md_u64(content, "split.count").map_err(|m| invalid(path, m))?;
    let no = md_u64(content, "split.no").map_err(|m| invalid(path, m))?;
    match (count, no) {
        (None | Some(0 | 1), _) => Ok(None),
        (Some(count), Some(0) | None) if count <= MAX_SPLITS => Ok(Some(count)),
        (Some(count), Some(no)) if no < count => Err(invalid(
            path,
            format!(
                "split {} of {count} of a split GGUF model (split.no {no}): pass the first \
                 split, whose name ends in -00001-of-{count:05}.gguf",
                no + 1
            ),
        )),
        (Some(count), no) => Err(invalid(
            path,
            format!("split.count {count} with split.no {no:?} (at most {MAX_SPLITS} splits)"),
        )),
    }
}

/// The most files of a split GGUF model (llama.cpp writes `-00001-of-00NNN`).
const MAX_SPLITS: u64 = 9999;

/// The files of a split GGUF model read as one: `first` (`content`, `reader`, at `path`, named
/// `PREFIX-00001-of-0000N.gguf`) and its siblings `PREFIX-0000K-of-0000N.gguf`, each parsed
/// and checked by [`crate::gguf::read_content`] on its own, their tensors merged into one
/// description (the metadata is the first file's, as llama.cpp's `gguf-split` writes it) and
/// read through one reader over the files end to end.
///
/// # Errors
/// `InvalidModel` naming the file: a name without the split pattern, a missing or corrupt
/// sibling, a sibling whose `split.no` / `split.count` disagree, a tensor in two files.
fn join_splits(
    mut content: gguf_file::Content,
    reader: BufReader<File>,
    path: &Path,
    count: u64,
) -> Result<(gguf_file::Content, Joined)> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| invalid(path, "a split GGUF file name must be UTF-8"))?;
    let suffix = format!("-00001-of-{count:05}.gguf");
    let prefix = name.strip_suffix(&suffix).ok_or_else(|| {
        invalid(
            path,
            format!(
                "split 1 of {count} of a split GGUF model, but its name does not end in \
                 {suffix}, so its other splits cannot be found"
            ),
        )
    })?;
    let mut files = vec![reader.into_inner()];
    let mut bases = vec![0u64];
    let mut end = std::fs::metadata(path)
        .map_err(|source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    // Tensor offsets become offsets into the files joined end to end.
    let mut infos: std::collections::HashMap<String, gguf_file::TensorInfo> = content
        .tensor_infos
        .drain()
        .map(|(n, mut info)| {
            info.offset += content.tensor_data_offset;
            (n, info)
        })
        .collect();
    for k in 2..=count {
        let sibling = path.with_file_name(format!("{prefix}-{k:05}-of-{count:05}.gguf"));
        let meta = std::fs::metadata(&sibling).map_err(|_| {
            invalid(
                &sibling,
                format!(
                    "missing: split {k} of {count} of {}",
                    crate::error::shown_path(path)
                ),
            )
        })?;
        if !meta.is_file() {
            return Err(invalid(
                &sibling,
                format!(
                    "not a regular file ({})",
                    crate::hub::file_kind(&meta.file_type())
                ),
            ));
        }
        let file = File::open(&sibling).map_err(|source| EngineError::Io {
            path: sibling.clone(),
            source,
        })?;
        let mut r = BufReader::new(file);
        let part = crate::gguf::read_content(&mut r, &sibling)?;
        let no = md_u64(&part, "split.no").map_err(|m| invalid(&sibling, m))?;
        let c = md_u64(&part, "split.count").map_err(|m| invalid(&sibling, m))?;
        if no != Some(k - 1) || c != Some(count) {
            return Err(invalid(
                &sibling,
                format!(
                    "split.no {no:?} and split.count {c:?}, expected {} and {count}",
                    k - 1
                ),
            ));
        }
        for (n, mut info) in part.tensor_infos {
            info.offset += end + part.tensor_data_offset;
            if infos.insert(n.clone(), info).is_some() {
                return Err(invalid(
                    &sibling,
                    format!(
                        "tensor {} is in two splits",
                        crate::error::quote(n.as_bytes())
                    ),
                ));
            }
        }
        bases.push(end);
        end += meta.len();
        files.push(r.into_inner());
    }
    content.tensor_infos = infos;
    content.tensor_data_offset = 0;
    Ok((
        content,
        Joined {
            files,
            bases,
            len: end,
            pos: 0,
        },
    ))
}

/// Several files read as one, end to end (the splits of a GGUF model), for tensor reads.
struct Joined {
    files: Vec<File>,
    /// Where each file starts in the joined stream.
    bases: Vec<u64>,
    /// The files' lengths together.
    len: u64,
    pos: u64,
}

impl Read for Joined {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::io::SeekFrom;
        // The file holding `pos`: the last whose base is at most `pos`.
        let i = self
            .bases
            .partition_point(|&b| b <= self.pos)
            .saturating_sub(1);
        let file = &mut self.files[i];
        file.seek(SeekFrom::Start(self.pos - self.bases[i]))?;
        let limit = match self.bases.get(i + 1) {
            Some(&next) => ((next - self.pos) as usize).min(buf.len()),
            None => buf.len(),
        };
        let n = file.read(&mut buf[..limit])?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for Joined {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        use std::io::SeekFrom;
        let pos = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
        };
        self.pos = pos.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek outside the splits")
        })?;
        Ok(self.pos)
    }
}

/// [`load_gguf`] on a GGUF file already open, or in memory (`std::io::Cursor`): the same
/// checks and results; `path` only names the file in messages.
///
/// # Errors
/// As [`load_gguf`].
pub fn load_gguf_from<R: Read + Seek>(
    reader: &mut R,
    path: &Path,
    device: &Device,
) -> Result<LoadedModel> {
    let content = crate::gguf::read_content(reader, path)?;
    if split_count(&content, path)?.is_some() {
        return Err(invalid(
            path,
            "split 1 of a split GGUF model: load it from its path (`load_gguf`), where its \
             other splits are",
        ));
    }
    load_content(content, reader, None, path, device)
}

/// A read-only map of `file` with its pages read in (`MAP_POPULATE`, as llama.cpp maps its
/// models), or `None` (logged) when it cannot be mapped: the tensors are then read.
fn map_file(file: &File, path: &Path) -> Option<Arc<memmap2::Mmap>> {
    // SAFETY: the map is read-only; as with every engine that maps its weights (llama.cpp,
    // candle, safetensors), another process truncating or rewriting the file while it is
    // loaded is outside the contract.
    match unsafe { memmap2::MmapOptions::new().populate().map(file) } {
        Ok(map) => Some(Arc::new(map)),
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "cannot map the file; reading it");
            None
        }
    }
}

/// The tokenizer of a parsed GGUF description, errors naming `path`.
fn tokenizer_of(content: &gguf_file::Content, path: &Path) -> Result<ModelTokenizer> {
    ModelTokenizer::from_gguf(content).map_err(|e| match e {
        EngineError::Tokenizer(message) => invalid(path, format!("tokenizer: {message}")),
        // The tokenizer does not know the file: name it, as the model's messages do.
        EngineError::Unsupported(message) => {
            EngineError::Unsupported(format!("{}: {message}", crate::error::shown_path(path)))
        }
        other => other,
    })
}

/// The tokenizer of the GGUF file `path` from its metadata alone (a vocab-only file, without
/// tensors, is fine): [`crate::gguf::read_content`] then [`ModelTokenizer::from_gguf`]; no
/// tensor is read.
///
/// # Errors
/// As [`load_gguf`]'s for the header and the tokenizer metadata.
pub fn load_gguf_tokenizer(path: &Path) -> Result<ModelTokenizer> {
    let (content, _) = open_gguf(path)?;
    tokenizer_of(&content, path)
}

/// The model and tokenizer of a parsed GGUF description, tensors read from `reader`.
fn load_content<R: Read + Seek>(
    content: gguf_file::Content,
    reader: &mut R,
    mapped: Option<&MappedFiles>,
    path: &Path,
    device: &Device,
) -> Result<LoadedModel> {
    let mut model =
        crate::loader::gguf_model::transformer_from_gguf(&content, reader, mapped, path, device)?;
    let tokenizer = tokenizer_of(&content, path)?;
    let n_tokens = tokenizer.tokenizer.get_vocab_size(false);
    let vocab_size = model.config().vocab_size;
    if n_tokens > vocab_size {
        return Err(invalid(
            path,
            format!(
                "the tokenizer has {n_tokens} tokens but the model's vocabulary \
                 (token_embd.weight rows) is {vocab_size}"
            ),
        ));
    }
    let warnings = tokenizer.warnings.clone();
    model.set_special_ids(tokenizer.bos_token_id, tokenizer.eos_token_ids.clone());
    Ok(LoadedModel {
        model: Box::new(model),
        tokenizer,
        warnings,
    })
}

/// Opens a GGUF file and reads its header (our checked parser), leaving the reader after it.
/// Only regular files are opened: a FIFO would block, and a device has no length.
fn open_gguf(path: &Path) -> Result<(gguf_file::Content, BufReader<File>)> {
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            return Err(invalid(
                path,
                format!(
                    "not a regular file ({})",
                    crate::hub::file_kind(&meta.file_type())
                ),
            ));
        }
    }
    let file = File::open(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut reader = BufReader::new(file);
    let content = crate::gguf::read_content(&mut reader, path)?;
    Ok((content, reader))
}
