//! Our GGUF header parser: [`read_content`] reads a GGUF file's header, metadata and tensor
//! descriptions into candle's [`Content`], refusing every corrupt value before it can do harm.
//!
//! GGUF (spec: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>) is a header (magic
//! `GGUF`, version, tensor and metadata counts), typed key/value metadata, one description per
//! tensor (name, dimensions, ggml type, offset) and the tensor data, each tensor at an offset
//! that is a multiple of `general.alignment` from the start of the data section, which is itself
//! aligned. Every count and length in it is chosen by whoever wrote the file, so the parser:
//!
//! - checks every length against the bytes left in the file *before* allocating for it, and
//!   allocates fallibly (`try_reserve`), so no file makes it abort or ask for more memory than a
//!   small multiple of the file's size (at most about 32 bytes per byte of the file), and at most
//!   [`MAX_METADATA_ELEMENTS`] array elements in all;
//! - bounds the nesting of arrays ([`MAX_ARRAY_DEPTH`]; llama.cpp refuses arrays of arrays
//!   altogether), so no file drives its recursion deep;
//! - does all offset and size arithmetic checked, never wrapping;
//! - never panics (no indexing a file can steer, no `unwrap`), and names the field and the value
//!   in every error, with text from the file escaped and cut ([`crate::error::MAX_MESSAGE_BYTES`]).
//!
//! The checks are llama.cpp's (`ggml/src/gguf.cpp`, `gguf_init_from_reader`) where they apply,
//! plus the spec's rules it does not enforce, plus a layout check of the tensor data (llama.cpp
//! instead requires every tensor to start exactly where the previous one's padded data ends; we
//! accept any order and gaps, as the spec does, but no overlap). Tensor data itself is read later
//! by candle's `Content::tensor`, which then only sees descriptions that passed these checks.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use candle_core::quantized::GgmlDType;

use crate::error::{bounded, quote, EngineError, Result};

/// The alignment of tensor data when `general.alignment` is absent (the GGUF spec).
pub const DEFAULT_ALIGNMENT: u32 = 32;
/// The smallest `general.alignment` we accept: the spec says it "must be a multiple of 8", and
/// llama.cpp requires a power of two, so the alignments we accept are the powers of two from 8.
pub const MIN_ALIGNMENT: u32 = 8;
/// The longest string value, in bytes (llama.cpp's `GGUF_MAX_STRING_LENGTH`).
pub const MAX_STRING_LENGTH: u64 = 1 << 30;
/// The most elements of one array (llama.cpp's `GGUF_MAX_ARRAY_ELEMENTS`).
pub const MAX_ARRAY_LENGTH: u64 = 1 << 30;
/// The longest metadata key, in bytes (the spec: "at most 2^16-1 bytes long").
pub const MAX_KEY_LENGTH: u64 = 65_535;
/// The longest tensor name, in bytes: llama.cpp's `GGML_MAX_NAME` (64) less its terminating
/// NUL. (The spec says at most 64; llama.cpp refuses 64.)
pub const MAX_TENSOR_NAME_LENGTH: u64 = 63;
/// The most dimensions of a tensor (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// The most array elements of all metadata values together. Each becomes a 32-byte candle
/// `Value` in memory, so this bounds the metadata's memory at 512 MiB whatever the file holds
/// (real models hold about a million: Llama 3's 128,256 tokens, scores, types and 280,147
/// merges; Gemma's 256,000 tokens).
pub const MAX_METADATA_ELEMENTS: u64 = 1 << 24;
/// The most levels of arrays in one metadata value: an array of arrays of scalars is 2. The spec
/// allows nesting; llama.cpp refuses any array of arrays; candle allowed 64 levels.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// GGUF value type ids (the spec's `gguf_metadata_value_type`).
const TYPE_STRING: u32 = 8;
const TYPE_ARRAY: u32 = 9;
const TYPE_NAMES: [&str; 13] = [
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array",
    "uint64", "int64", "float64",
];

/// Smallest encoding of one value of type `ty` (a known type): the bound that array lengths are
/// checked against before anything is allocated for them.
fn min_encoded_size(ty: u32) -> u64 {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        TYPE_STRING => 8,    // the u64 length of an empty string
        TYPE_ARRAY => 4 + 8, // element type and length of an empty array
        _ => 8,              // u64, i64, f64
    }
}

/// The candle type of a ggml type id (ggml's `enum ggml_type`), `None` for ids candle has no
/// type for (removed ones such as 4 and 5, the i-quants, the integer types, unknown ids). The
/// same table as candle's own (`GgmlDType::from_u32`, crate-private there).
pub fn ggml_dtype(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// The GGUF spec's name of a value's type (`uint32`, `string`, `array`, ...).
pub fn type_name(value: &Value) -> &'static str {
    match value {
        Value::U8(_) => "uint8",
        Value::I8(_) => "int8",
        Value::U16(_) => "uint16",
        Value::I16(_) => "int16",
        Value::U32(_) => "uint32",
        Value::I32(_) => "int32",
        Value::U64(_) => "uint64",
        Value::I64(_) => "int64",
        Value::F32(_) => "float32",
        Value::F64(_) => "float64",
        Value::Bool(_) => "bool",
        Value::String(_) => "string",
        Value::Array(_) => "array",
    }
}

/// A metadata value as a short phrase for an error message: its type and, for a scalar, its
/// value (`uint32 7`; a string escaped and cut, as every text from a file in our messages), for
/// an array its length and element type (`array of 32000 string`), never its elements. At most a
/// few dozen bytes plus one quoted string.
pub fn describe(value: &Value) -> String {
    match value {
        Value::U8(v) => format!("uint8 {v}"),
        Value::I8(v) => format!("int8 {v}"),
        Value::U16(v) => format!("uint16 {v}"),
        Value::I16(v) => format!("int16 {v}"),
        Value::U32(v) => format!("uint32 {v}"),
        Value::I32(v) => format!("int32 {v}"),
        Value::U64(v) => format!("uint64 {v}"),
        Value::I64(v) => format!("int64 {v}"),
        Value::F32(v) => format!("float32 {v}"),
        Value::F64(v) => format!("float64 {v}"),
        Value::Bool(v) => format!("bool {v}"),
        Value::String(s) => format!("string {}", quote(s.as_bytes())),
        Value::Array(a) => match a.first() {
            None => "empty array".to_string(),
            Some(first) => format!("array of {} {}", a.len(), type_name(first)),
        },
    }
}

/// Reads the header, metadata and tensor descriptions of the GGUF file in `reader` (from its
/// start, whatever its position) into candle's [`Content`], with `tensor_data_offset` the
/// absolute offset of the data section. `path` is only used in errors.
///
/// What is checked (llama.cpp's `gguf_init_from_reader` in `ggml/src/gguf.cpp`, and the GGUF
/// spec):
/// - the magic is the bytes `GGUF`; the version is 2 or 3 (llama.cpp no longer reads version 1;
///   a version whose low 16 bits are zero is reported as a file of the other byte order);
/// - the tensor and metadata counts fit in the bytes that follow at their smallest encodings;
/// - every string and array length fits in the bytes left (before anything is allocated), and
///   below [`MAX_STRING_LENGTH`], [`MAX_ARRAY_LENGTH`], [`MAX_KEY_LENGTH`],
///   [`MAX_TENSOR_NAME_LENGTH`]; arrays nest at most [`MAX_ARRAY_DEPTH`] levels;
/// - keys and tensor names are non-empty (keys) and valid UTF-8 (the spec's strings are UTF-8;
///   string *values* that are not are decoded lossily, as candle does, since real files have
///   such token pieces); trailing NUL bytes of strings are dropped, as candle does;
/// - no key and no tensor name appears twice (llama.cpp refuses both);
/// - every value type is known, and a bool is the byte 0 or 1 (the spec);
/// - `general.alignment`, when present, is a uint32 (the spec's type; llama.cpp refuses other
///   types too) that is a power of two (llama.cpp) and at least [`MIN_ALIGNMENT`] (the spec:
///   a multiple of 8); [`DEFAULT_ALIGNMENT`] when absent;
/// - a tensor has at most [`MAX_DIMS`] dimensions, each and their product at most `i64::MAX`
///   (llama.cpp's `int64_t ne`), a known ggml type ([`ggml_dtype`]), a row length (`ne[0]`)
///   that is a multiple of its type's block size (so is its element count), and a byte size
///   that fits in `usize`;
/// - every tensor's offset is a multiple of the alignment (the spec), and its data lies inside
///   the file and overlaps no other tensor's data (no two non-empty tensors share a byte).
///
/// # Errors
/// [`EngineError::InvalidModel`] naming `path`, the field (key, tensor, header field) and the
/// offending value, for any of the above or a truncated file; [`EngineError::Io`] when reading
/// or seeking fails for another reason than the end of the file.
///
/// Never panics, on any bytes, and allocates at most about 32 bytes per byte of the file (the
/// worst case: one candle `Value` per element of a one-byte array).
pub fn read_content<R: Read + Seek>(reader: &mut R, path: &Path) -> Result<Content> {
    let io = |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    };
    let len = reader.seek(SeekFrom::End(0)).map_err(io)?;
    reader.seek(SeekFrom::Start(0)).map_err(io)?;
    let mut input = Input {
        reader,
        path,
        pos: 0,
        len,
        elements: 0,
    };

    let magic = input.array::<4>(&|| "the magic `GGUF`".to_string())?;
    if &magic != b"GGUF" {
        return Err(input.invalid(format!(
            "not a GGUF file: it starts with {}, not `GGUF`",
            quote(&magic)
        )));
    }
    let version = input.u32(&|| "the GGUF version".to_string())?;
    let magic = match version {
        2 => VersionedMagic::GgufV2,
        3 => VersionedMagic::GgufV3,
        0 => return Err(input.invalid("GGUF version 0 is not a version")),
        v if v & 0xFFFF == 0 => {
            return Err(input.invalid(format!(
                "GGUF version {v:#010x}: the file is probably of the other byte order \
                 (big-endian); only little-endian GGUF files are read"
            )))
        }
        1 => {
            return Err(input.invalid(
                "GGUF version 1 is not supported (neither is it by llama.cpp); convert the \
                 model again",
            ))
        }
        v => {
            return Err(input.invalid(format!(
                "GGUF version {v} is not supported (versions 2 and 3 are)"
            )))
        }
    };

    let n_tensors = input.u64(&|| "the tensor count".to_string())?;
    let n_kv = input.u64(&|| "the metadata count".to_string())?;
    // Each metadata entry takes at least a key length, a type and one byte; each tensor
    // description a name length, a dimension count, a type and an offset.
    let needed = n_kv
        .checked_mul(8 + 4 + 1)
        .zip(n_tensors.checked_mul(8 + 4 + 4 + 8))
        .and_then(|(a, b)| a.checked_add(b));
    if needed.is_none_or(|n| n > input.left()) {
        return Err(input.invalid(format!(
            "the header declares {n_tensors} tensors and {n_kv} metadata entries, more than the \
             {} bytes that follow can hold",
            input.left()
        )));
    }

    let mut metadata: HashMap<String, Value> = HashMap::new();
    // Bounded by the check above: at most one entry per 13 bytes of the file.
    metadata
        .try_reserve(n_kv as usize)
        .map_err(|_| input.invalid(format!("cannot allocate {n_kv} metadata entries")))?;
    for i in 0..n_kv {
        let key =
            input.string_bytes(MAX_KEY_LENGTH, &|| format!("the key of metadata entry {i}"))?;
        let key = String::from_utf8(key).map_err(|e| {
            input.invalid(format!(
                "the key of metadata entry {i}, {}, is not valid UTF-8",
                quote(e.as_bytes())
            ))
        })?;
        if key.is_empty() {
            return Err(input.invalid(format!("metadata entry {i} has an empty key")));
        }
        if metadata.contains_key(&key) {
            return Err(input.invalid(format!(
                "metadata key {} appears twice (again as entry {i}); llama.cpp refuses \
                 duplicate keys too",
                quote(key.as_bytes())
            )));
        }
        let what = || format!("metadata {}", quote(key.as_bytes()));
        let ty = input.u32(&|| format!("the value type of {}", what()))?;
        let value = read_value(&mut input, ty, 0, &what)?;
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) => *a,
        Some(other) => {
            return Err(input.invalid(format!(
                "metadata `general.alignment` is {}; the GGUF spec says it is a uint32",
                describe(other)
            )))
        }
    };
    if alignment == 0 {
        return Err(input
            .invalid("metadata `general.alignment` is 0; it must be a power of two, at least 8"));
    }
    if !alignment.is_power_of_two() {
        return Err(input.invalid(format!(
            "metadata `general.alignment` is {alignment}, not a power of two (llama.cpp \
             requires one)"
        )));
    }
    if alignment < MIN_ALIGNMENT {
        return Err(input.invalid(format!(
            "metadata `general.alignment` is {alignment}, not a multiple of 8 (the GGUF spec \
             requires one)"
        )));
    }
    let align = u64::from(alignment);

    let mut tensor_infos: HashMap<String, TensorInfo> = HashMap::new();
    // At most one per 24 bytes of the file (checked above).
    tensor_infos
        .try_reserve(n_tensors as usize)
        .map_err(|_| input.invalid(format!("cannot allocate {n_tensors} tensor descriptions")))?;
    // (name, offset, size in bytes) of each tensor, for the layout checks below.
    let mut layout: Vec<(String, u64, u64)> = Vec::new();
    layout
        .try_reserve_exact(n_tensors as usize)
        .map_err(|_| input.invalid(format!("cannot allocate {n_tensors} tensor descriptions")))?;
    for i in 0..n_tensors {
        let name = input.string_bytes(MAX_TENSOR_NAME_LENGTH, &|| {
            format!("the name of tensor {i}")
        })?;
        let name = String::from_utf8(name).map_err(|e| {
            input.invalid(format!(
                "the name of tensor {i}, {}, is not valid UTF-8",
                quote(e.as_bytes())
            ))
        })?;
        let q = quote(name.as_bytes());
        if tensor_infos.contains_key(&name) {
            return Err(input.invalid(format!(
                "tensor {i} repeats the name {q} of an earlier tensor; llama.cpp refuses \
                 duplicate tensor names too"
            )));
        }
        let n_dims = input.u32(&|| format!("the dimension count of tensor {q}"))?;
        if n_dims > MAX_DIMS {
            return Err(input.invalid(format!(
                "tensor {q} has {n_dims} dimensions; ggml allows at most {MAX_DIMS}"
            )));
        }
        let mut ne = [1u64; MAX_DIMS as usize];
        for (d, n) in ne.iter_mut().enumerate().take(n_dims as usize) {
            *n = input.u64(&|| format!("dimension {d} of tensor {q}"))?;
            if *n > i64::MAX as u64 {
                return Err(input.invalid(format!(
                    "tensor {q}: dimension {d} is {n}, more than an int64 holds"
                )));
            }
        }
        let dims = &ne[..n_dims as usize];
        let elems = ne
            .iter()
            .try_fold(1u64, |acc, &n| acc.checked_mul(n))
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or_else(|| {
                input.invalid(format!(
                    "tensor {q} of dimensions {dims:?} has more elements than an int64 holds"
                ))
            })?;
        let type_id = input.u32(&|| format!("the ggml type of tensor {q}"))?;
        let dtype = ggml_dtype(type_id).ok_or_else(|| {
            input.invalid(format!(
                "tensor {q} has ggml type {type_id}, which is unknown or not supported"
            ))
        })?;
        let block = dtype.block_size() as u64;
        if !ne[0].is_multiple_of(block) {
            return Err(input.invalid(format!(
                "tensor {q} of type {dtype:?} has rows of {} elements (dimension 0), not a \
                 multiple of its block size {block}",
                ne[0]
            )));
        }
        let bytes = (elems / block)
            .checked_mul(dtype.type_size() as u64)
            .filter(|&b| usize::try_from(b).is_ok())
            .ok_or_else(|| {
                input.invalid(format!(
                    "tensor {q} of dimensions {dims:?} and type {dtype:?} has a size in bytes \
                     that overflows"
                ))
            })?;
        let offset = input.u64(&|| format!("the data offset of tensor {q}"))?;
        let shape = dims
            .iter()
            .rev()
            .map(|&n| usize::try_from(n))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|_| input.invalid(format!("tensor {q}: dimensions {dims:?} exceed usize")))?;
        tensor_infos.insert(
            name.clone(),
            TensorInfo {
                ggml_dtype: dtype,
                shape: shape.into(),
                offset,
            },
        );
        layout.push((name, offset, bytes));
    }

    let header_end = input.pos;
    let data_offset = header_end.checked_next_multiple_of(align).ok_or_else(|| {
        input.invalid(format!(
            "the header ends at offset {header_end}, which cannot be padded to the alignment"
        ))
    })?;
    if n_tensors > 0 && data_offset > len {
        return Err(input.invalid(format!(
            "the tensor data would start at offset {data_offset} (the header's end {header_end} \
             padded to the alignment {alignment}), past the end of the file ({len} bytes)"
        )));
    }
    check_layout(&input, &layout, align, data_offset)?;

    Ok(Content {
        magic,
        metadata,
        tensor_infos,
        tensor_data_offset: data_offset,
    })
}

/// The spec's and our layout rules for tensor data: each tensor's offset (from the data section
/// at `data_offset`) a multiple of `align`, its bytes inside the file, no two non-empty tensors
/// sharing a byte.
fn check_layout<R>(
    input: &Input<'_, R>,
    layout: &[(String, u64, u64)],
    align: u64,
    data_offset: u64,
) -> Result<()> {
    let mut spans: Vec<(u64, u64, &str)> = Vec::new();
    spans
        .try_reserve_exact(layout.len())
        .map_err(|_| input.invalid("cannot allocate the tensor layout"))?;
    for (name, offset, bytes) in layout {
        let q = || quote(name.as_bytes());
        if !offset.is_multiple_of(align) {
            return Err(input.invalid(format!(
                "tensor {} has data offset {offset}, not a multiple of the alignment {align} \
                 (general.alignment, default {DEFAULT_ALIGNMENT})",
                q()
            )));
        }
        let start = data_offset.checked_add(*offset);
        match start.and_then(|s| s.checked_add(*bytes)) {
            Some(end) if end <= input.len => spans.push((data_offset + offset, end, name.as_str())),
            _ => {
                return Err(input.invalid(format!(
                    "tensor {} needs {bytes} bytes at data offset {offset} (file offset \
                     {data_offset} + {offset}), past the end of the file ({} bytes)",
                    q(),
                    input.len
                )))
            }
        }
    }
    spans.retain(|&(start, end, _)| end > start);
    spans.sort_unstable();
    // Sorted by start, the spans are disjoint exactly when each ends before the next starts.
    for pair in spans.windows(2) {
        let [(a_start, a_end, a), (b_start, b_end, b)] = pair else {
            continue;
        };
        if b_start < a_end {
            return Err(input.invalid(format!(
                "the data of tensors {} (bytes {a_start}..{a_end}) and {} (bytes \
                 {b_start}..{b_end}) overlap",
                quote(a.as_bytes()),
                quote(b.as_bytes())
            )));
        }
    }
    Ok(())
}

/// One metadata value of type `ty`; `what` names it for errors (`metadata `key``, with `[i]`
/// for array elements). `depth` is the number of arrays around it.
fn read_value<R: Read>(
    input: &mut Input<'_, R>,
    ty: u32,
    depth: usize,
    what: &dyn Fn() -> String,
) -> Result<Value> {
    Ok(match ty {
        0 => Value::U8(u8::from_le_bytes(input.array(what)?)),
        1 => Value::I8(i8::from_le_bytes(input.array(what)?)),
        2 => Value::U16(u16::from_le_bytes(input.array(what)?)),
        3 => Value::I16(i16::from_le_bytes(input.array(what)?)),
        4 => Value::U32(u32::from_le_bytes(input.array(what)?)),
        5 => Value::I32(i32::from_le_bytes(input.array(what)?)),
        6 => Value::F32(f32::from_le_bytes(input.array(what)?)),
        7 => match input.array::<1>(what)? {
            [0] => Value::Bool(false),
            [1] => Value::Bool(true),
            [b] => {
                return Err(input.invalid(format!(
                    "{} is a bool stored as the byte {b}; the GGUF spec allows only 0 and 1",
                    what()
                )))
            }
        },
        TYPE_STRING => {
            let bytes = input.string_bytes(MAX_STRING_LENGTH, what)?;
            Value::String(match String::from_utf8(bytes) {
                Ok(s) => s,
                Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
            })
        }
        TYPE_ARRAY => read_array(input, depth, what)?,
        10 => Value::U64(u64::from_le_bytes(input.array(what)?)),
        11 => Value::I64(i64::from_le_bytes(input.array(what)?)),
        12 => Value::F64(f64::from_le_bytes(input.array(what)?)),
        _ => return Err(input.invalid(format!("{} has value type {ty}, which is unknown", what()))),
    })
}

/// The rest of an array value (after its type id): element type, length, elements.
fn read_array<R: Read>(
    input: &mut Input<'_, R>,
    depth: usize,
    what: &dyn Fn() -> String,
) -> Result<Value> {
    let elem = input.u32(&|| format!("the element type of {}", what()))?;
    let Some(elem_name) = TYPE_NAMES.get(elem as usize) else {
        return Err(input.invalid(format!(
            "{} is an array of value type {elem}, which is unknown",
            what()
        )));
    };
    if elem == TYPE_ARRAY && depth + 1 >= MAX_ARRAY_DEPTH {
        return Err(input.invalid(format!(
            "{} nests arrays more than {MAX_ARRAY_DEPTH} deep",
            what()
        )));
    }
    let n = input.u64(&|| format!("the length of {}", what()))?;
    if n > MAX_ARRAY_LENGTH {
        return Err(input.invalid(format!(
            "{} is an array of {n} elements, more than {MAX_ARRAY_LENGTH}",
            what()
        )));
    }
    let needed = n.checked_mul(min_encoded_size(elem));
    if needed.is_none_or(|b| b > input.left()) {
        return Err(input.invalid(format!(
            "truncated: {} is an array of {n} {elem_name}, more than the {} bytes left hold",
            what(),
            input.left()
        )));
    }
    input.elements = input.elements.saturating_add(n);
    if input.elements > MAX_METADATA_ELEMENTS {
        return Err(input.invalid(format!(
            "{} brings the metadata's array elements to {}, more than {MAX_METADATA_ELEMENTS} \
             in all",
            what(),
            input.elements
        )));
    }
    let mut values = Vec::new();
    // Bounded by the check above: at most one element per byte left.
    values
        .try_reserve_exact(n as usize)
        .map_err(|_| input.invalid(format!("cannot allocate {n} elements for {}", what())))?;
    for j in 0..n {
        values.push(read_value(input, elem, depth + 1, &|| {
            format!("{}[{j}]", what())
        })?);
    }
    Ok(Value::Array(values))
}

/// The file being parsed: the reader, where it is, how long the file is.
struct Input<'a, R> {
    reader: &'a mut R,
    path: &'a Path,
    /// Bytes read so far: the reader's position. Never above `len`.
    pos: u64,
    /// The file's length.
    len: u64,
    /// Array elements read so far, of all metadata values ([`MAX_METADATA_ELEMENTS`]).
    elements: u64,
}

impl<R> Input<'_, R> {
    fn left(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    /// `InvalidModel` for this file.
    fn invalid(&self, message: impl Into<String>) -> EngineError {
        EngineError::InvalidModel {
            path: self.path.to_path_buf(),
            message: bounded(message),
        }
    }

    fn truncated(&self, n: u64, what: &dyn Fn() -> String) -> EngineError {
        self.invalid(format!(
            "truncated: {} needs {n} bytes at offset {}, the file has {} bytes",
            what(),
            self.pos,
            self.len
        ))
    }
}

impl<R: Read> Input<'_, R> {
    /// Fills `buf` from the file, after checking that the file has that many bytes left.
    fn fill(&mut self, buf: &mut [u8], what: &dyn Fn() -> String) -> Result<()> {
        let n = buf.len() as u64;
        if n > self.left() {
            return Err(self.truncated(n, what));
        }
        match self.reader.read_exact(buf) {
            Ok(()) => {
                self.pos += n;
                Ok(())
            }
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => Err(self.invalid(format!(
                "truncated: {} at offset {}: the file ended before its length of {} bytes \
                 (did it change while being read?)",
                what(),
                self.pos,
                self.len
            ))),
            Err(source) => Err(EngineError::Io {
                path: self.path.to_path_buf(),
                source,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let mut buf = [0u8; N];
        self.fill(&mut buf, what)?;
        Ok(buf)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A GGUF string (u64 length, then the bytes) of at most `max` bytes, without its trailing
    /// NUL bytes (candle drops them too: some writers add them).
    fn string_bytes(&mut self, max: u64, what: &dyn Fn() -> String) -> Result<Vec<u8>> {
        let n = self.u64(&|| format!("the length of {}", what()))?;
        if n > max {
            return Err(self.invalid(format!("{} is {n} bytes long, more than {max}", what())));
        }
        if n > self.left() {
            return Err(self.truncated(n, what));
        }
        let mut bytes = Vec::new();
        // n is at most the bytes left in the file.
        bytes
            .try_reserve_exact(n as usize)
            .map_err(|_| self.invalid(format!("cannot allocate {n} bytes for {}", what())))?;
        bytes.resize(n as usize, 0);
        self.fill(&mut bytes, what)?;
        while bytes.last() == Some(&0) {
            bytes.pop();
        }
        Ok(bytes)
    }
}

// The typed metadata accessors the loaders and the tokenizer read keys with (they describe a
// wrong value with `describe`, never print it whole).

/// A metadata value as a non-negative integer. `Ok(None)` when the key is absent; `Err` (a
/// message naming the key) when it holds a non-integer or a negative value.
pub(crate) fn md_u64(content: &Content, key: &str) -> Result<Option<u64>, String> {
    let Some(value) = content.metadata.get(key) else {
        return Ok(None);
    };
    value_to_u64(value).map(Some).ok_or_else(|| {
        format!(
            "metadata `{key}` is {}, expected a non-negative integer",
            describe(value)
        )
    })
}

/// A metadata value as `usize` (see [`md_u64`]); values beyond `usize` are an error.
pub(crate) fn md_usize(content: &Content, key: &str) -> Result<Option<usize>, String> {
    md_u64(content, key)?
        .map(|v| usize::try_from(v).map_err(|_| format!("metadata `{key}` = {v} is too large")))
        .transpose()
}

/// A metadata value as `f64` (from F32, F64 or an integer). `Ok(None)` when absent.
pub(crate) fn md_f64(content: &Content, key: &str) -> Result<Option<f64>, String> {
    let Some(value) = content.metadata.get(key) else {
        return Ok(None);
    };
    let v = match value {
        Value::F32(v) => f64::from(*v),
        Value::F64(v) => *v,
        other => match value_to_u64(other) {
            Some(v) => v as f64,
            None => {
                return Err(format!(
                    "metadata `{key}` is {}, expected a number",
                    describe(value)
                ))
            }
        },
    };
    Ok(Some(v))
}

/// A metadata value as a string. `Ok(None)` when absent.
pub(crate) fn md_str<'a>(content: &'a Content, key: &str) -> Result<Option<&'a str>, String> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(other) => Err(format!(
            "metadata `{key}` is {}, expected a string",
            describe(other)
        )),
    }
}

/// A metadata value as a bool. `Ok(None)` when absent.
pub(crate) fn md_bool(content: &Content, key: &str) -> Result<Option<bool>, String> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(format!(
            "metadata `{key}` is {}, expected a bool",
            describe(other)
        )),
    }
}

/// A metadata value as an array. `Ok(None)` when absent.
pub(crate) fn md_array<'a>(content: &'a Content, key: &str) -> Result<Option<&'a [Value]>, String> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a.as_slice())),
        Some(other) => Err(format!(
            "metadata `{key}` is {}, expected an array",
            describe(other)
        )),
    }
}

/// An integer value of any GGUF integer type, `None` for other types and negative values.
pub(crate) fn value_to_u64(value: &Value) -> Option<u64> {
    match *value {
        Value::U8(v) => Some(u64::from(v)),
        Value::U16(v) => Some(u64::from(v)),
        Value::U32(v) => Some(u64::from(v)),
        Value::U64(v) => Some(v),
        Value::I8(v) => u64::try_from(v).ok(),
        Value::I16(v) => u64::try_from(v).ok(),
        Value::I32(v) => u64::try_from(v).ok(),
        Value::I64(v) => u64::try_from(v).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn parse(bytes: &[u8]) -> Result<Content> {
        read_content(&mut Cursor::new(bytes), Path::new("test.gguf"))
    }

    fn message(r: Result<Content>) -> String {
        match r {
            Err(EngineError::InvalidModel { message, .. }) => message,
            Err(other) => panic!("expected InvalidModel, got {other:?}"),
            Ok(_) => panic!("parsed"),
        }
    }

    /// A v3 header with `n_tensors` tensors and `n_kv` metadata entries, then `rest`.
    fn header(n_tensors: u64, n_kv: u64, rest: &[u8]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b.extend(rest);
        b
    }

    fn string(s: &[u8]) -> Vec<u8> {
        let mut b = (s.len() as u64).to_le_bytes().to_vec();
        b.extend(s);
        b
    }

    #[test]
    fn empty_file_and_header_only_file() {
        let m = message(parse(b""));
        assert!(m.contains("the magic `GGUF` needs 4 bytes"), "{m}");
        let c = parse(&header(0, 0, &[])).unwrap();
        assert!(c.metadata.is_empty() && c.tensor_infos.is_empty());
        assert_eq!(c.tensor_data_offset, 32);
    }

    #[test]
    fn arrays_nested_a_million_deep_stop_at_the_depth_bound() {
        // key "k", type array of arrays of arrays ..., each of length 1.
        let mut rest = string(b"k");
        rest.extend(TYPE_ARRAY.to_le_bytes());
        for _ in 0..1_000_000 {
            rest.extend(TYPE_ARRAY.to_le_bytes());
            rest.extend(1u64.to_le_bytes());
        }
        let m = message(parse(&header(0, 1, &rest)));
        assert!(m.contains("nests arrays more than 8 deep"), "{m}");
        assert!(m.starts_with("metadata `k`[0][0][0][0][0][0][0]"), "{m}");
    }

    /// 17 million one-byte elements fit in a 17 MB file but would be 540 MB of candle values:
    /// refused once the metadata's elements pass the budget, whatever the arrays.
    #[test]
    fn metadata_elements_past_the_budget_are_refused() {
        let per = MAX_METADATA_ELEMENTS / 2;
        let mut rest = Vec::new();
        for key in [b"a", b"b"] {
            rest.extend(string(key));
            rest.extend(TYPE_ARRAY.to_le_bytes());
            rest.extend(0u32.to_le_bytes()); // uint8 elements
            rest.extend(per.to_le_bytes());
            rest.extend(std::iter::repeat_n(1u8, per as usize));
        }
        // Exactly the budget is read.
        let c = parse(&header(0, 2, &rest)).unwrap();
        assert_eq!(c.metadata.len(), 2);
        rest.extend(string(b"c"));
        rest.extend(TYPE_ARRAY.to_le_bytes());
        rest.extend(0u32.to_le_bytes());
        rest.extend(1u64.to_le_bytes());
        rest.push(1);
        let m = message(parse(&header(0, 3, &rest)));
        assert_eq!(
            m,
            format!(
                "metadata `c` brings the metadata's array elements to {}, more than {} in all",
                MAX_METADATA_ELEMENTS + 1,
                MAX_METADATA_ELEMENTS
            )
        );
    }

    #[test]
    fn seven_nested_arrays_are_read() {
        let mut rest = string(b"k");
        rest.extend(TYPE_ARRAY.to_le_bytes());
        for _ in 0..MAX_ARRAY_DEPTH - 1 {
            rest.extend(TYPE_ARRAY.to_le_bytes());
            rest.extend(1u64.to_le_bytes());
        }
        rest.extend(4u32.to_le_bytes());
        rest.extend(1u64.to_le_bytes());
        rest.extend(7u32.to_le_bytes());
        let c = parse(&header(0, 1, &rest)).unwrap();
        let mut v = &c.metadata["k"];
        let mut depth = 0;
        while let Value::Array(a) = v {
            v = &a[0];
            depth += 1;
        }
        assert_eq!(
            (depth, format!("{v:?}")),
            (MAX_ARRAY_DEPTH, "U32(7)".to_string())
        );
    }

    #[test]
    fn lengths_beyond_the_file_are_refused_before_allocating() {
        for (n_tensors, n_kv) in [(u64::MAX, 0), (0, u64::MAX), (1 << 40, 1 << 40)] {
            let m = message(parse(&header(n_tensors, n_kv, &[0; 64])));
            assert!(
                m.contains(&format!("declares {n_tensors} tensors and {n_kv}")),
                "{m}"
            );
        }
        // A key of length u64::MAX, then one of 2^40 bytes.
        let mut rest = u64::MAX.to_le_bytes().to_vec();
        rest.extend([0; 16]);
        let m = message(parse(&header(0, 1, &rest)));
        assert!(
            m.contains(&format!("{} bytes long, more than 65535", u64::MAX)),
            "{m}"
        );
        let mut rest = 60_000u64.to_le_bytes().to_vec();
        rest.extend([0; 16]);
        let m = message(parse(&header(0, 1, &rest)));
        assert!(
            m.contains("truncated: the key of metadata entry 0 needs 60000 bytes"),
            "{m}"
        );
        // An array of 2^30 u64 and of u64::MAX strings in a small file.
        for (elem, n) in [(10u32, 1u64 << 30), (TYPE_STRING, u64::MAX)] {
            let mut rest = string(b"a");
            rest.extend(TYPE_ARRAY.to_le_bytes());
            rest.extend(elem.to_le_bytes());
            rest.extend(n.to_le_bytes());
            rest.extend([0; 32]);
            let m = message(parse(&header(0, 1, &rest)));
            assert!(
                m.contains(&format!("metadata `a` is an array of {n}")),
                "{m}"
            );
        }
    }

    #[test]
    fn every_prefix_and_every_byte_flip_of_a_small_file_is_an_error_or_parses() {
        // Two keys and one F32 tensor of 8 values.
        let mut rest = string(b"general.alignment");
        rest.extend(4u32.to_le_bytes());
        rest.extend(32u32.to_le_bytes());
        rest.extend(string(b"tokens"));
        rest.extend(TYPE_ARRAY.to_le_bytes());
        rest.extend(TYPE_STRING.to_le_bytes());
        rest.extend(2u64.to_le_bytes());
        rest.extend(string(b"ab"));
        rest.extend(string(b"\xff\x00"));
        rest.extend(string(b"t"));
        rest.extend(1u32.to_le_bytes());
        rest.extend(8u64.to_le_bytes());
        rest.extend(0u32.to_le_bytes());
        rest.extend(0u64.to_le_bytes());
        let mut file = header(1, 2, &rest);
        file.resize(file.len().next_multiple_of(32) + 32, 0);
        let c = parse(&file).unwrap();
        assert_eq!(
            format!("{:?}", c.metadata["tokens"]),
            r#"Array([String("ab"), String("�")])"#
        );
        for cut in 0..file.len() {
            message(parse(&file[..cut]));
        }
        for i in 0..file.len() {
            for bit in 0..8 {
                let mut f = file.clone();
                f[i] ^= 1 << bit;
                let _ = parse(&f);
            }
        }
    }
}
