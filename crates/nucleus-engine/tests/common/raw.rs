//! A GGUF file as plain data that a test can corrupt in any way (duplicate keys, raw key bytes,
//! unknown type ids, any offsets), then write out byte by byte.
//!
//! [`RawGguf::from_file`] takes the layout of a real file (read with candle's parser, the
//! reference); [`RawGguf::to_bytes`] writes the GGUF v3 encoding of whatever the fields then hold.

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::GgmlDType;

/// A metadata value: a candle value, or raw bytes under any type id.
#[derive(Debug, Clone)]
pub enum Md {
    /// Encoded as the GGUF spec says.
    V(Value),
    /// Type id `ty`, then exactly `bytes`.
    Raw { ty: u32, bytes: Vec<u8> },
}

/// One tensor description, in ggml's order (`ne[0]` is the row length).
#[derive(Debug, Clone)]
pub struct RawTensor {
    pub name: Vec<u8>,
    pub ne: Vec<u64>,
    pub ggml_type: u32,
    pub offset: u64,
}

/// A whole GGUF file.
#[derive(Debug, Clone)]
pub struct RawGguf {
    pub version: u32,
    pub metadata: Vec<(Vec<u8>, Md)>,
    pub tensors: Vec<RawTensor>,
    /// The header is padded with zeros to a multiple of this before `data`.
    pub pad_to: u64,
    /// The data section.
    pub data: Vec<u8>,
    /// Header counts written instead of the real ones.
    pub n_tensors: Option<u64>,
    pub n_kv: Option<u64>,
}

/// ggml's id of a candle type.
pub fn ggml_type_id(dtype: GgmlDType) -> u32 {
    match dtype {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

/// The GGUF type id of a value (an empty array says u32, as candle writes it).
pub fn value_type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// A GGUF string: u64 length, bytes.
pub fn gguf_string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s);
}

/// A value's encoding after its type id.
pub fn encode_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.extend(x.to_le_bytes()),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => gguf_string(out, s.as_bytes()),
        Value::Array(a) => {
            out.extend(a.first().map_or(4, value_type_id).to_le_bytes());
            out.extend((a.len() as u64).to_le_bytes());
            for x in a {
                encode_value(out, x);
            }
        }
    }
}

/// Bytes of a tensor of `ne` elements of ggml type `ty` (a type candle knows).
pub fn tensor_bytes(ne: &[u64], ty: u32) -> u64 {
    let dtype = nucleus_engine::gguf::ggml_dtype(ty).expect("a known type");
    let elems: u64 = ne.iter().product();
    elems / dtype.block_size() as u64 * dtype.type_size() as u64
}

impl RawGguf {
    /// The file at `path` as candle reads it: metadata sorted by key, tensors in data order.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let bytes = std::fs::read(path)?;
        let content = gguf_file::Content::read(&mut std::io::Cursor::new(&bytes))?;
        let mut metadata: Vec<(Vec<u8>, Md)> = content
            .metadata
            .iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), Md::V(v.clone())))
            .collect();
        metadata.sort_by(|a, b| a.0.cmp(&b.0));
        let mut tensors: Vec<RawTensor> = content
            .tensor_infos
            .iter()
            .map(|(name, info)| RawTensor {
                name: name.as_bytes().to_vec(),
                ne: info.shape.dims().iter().rev().map(|&d| d as u64).collect(),
                ggml_type: ggml_type_id(info.ggml_dtype),
                offset: info.offset,
            })
            .collect();
        tensors.sort_by_key(|t| t.offset);
        let alignment = match content.metadata.get("general.alignment") {
            Some(Value::U32(a)) => u64::from(*a),
            _ => 32,
        };
        Ok(Self {
            version: 3,
            metadata,
            tensors,
            pad_to: alignment,
            data: bytes[content.tensor_data_offset as usize..].to_vec(),
            n_tensors: None,
            n_kv: None,
        })
    }

    /// Sets metadata `key` (replacing the first entry of that key, else appending).
    pub fn set(&mut self, key: &str, md: Md) -> &mut Self {
        match self.metadata.iter_mut().find(|(k, _)| k == key.as_bytes()) {
            Some(entry) => entry.1 = md,
            None => self.metadata.push((key.as_bytes().to_vec(), md)),
        }
        self
    }

    /// Sets metadata `key` to a candle value.
    pub fn set_value(&mut self, key: &str, v: Value) -> &mut Self {
        self.set(key, Md::V(v))
    }

    /// The metadata entry of `key`.
    pub fn entry_mut(&mut self, key: &str) -> &mut (Vec<u8>, Md) {
        self.metadata
            .iter_mut()
            .find(|(k, _)| k == key.as_bytes())
            .unwrap_or_else(|| panic!("no metadata key {key}"))
    }

    /// The tensor named `name`.
    pub fn tensor_mut(&mut self, name: &str) -> &mut RawTensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name.as_bytes())
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    /// Moves every tensor's data so that offsets are multiples of `align` (in the current
    /// order), and pads the header to `align` too.
    pub fn relayout(&mut self, align: u64) -> &mut Self {
        let mut data = Vec::new();
        for t in &mut self.tensors {
            let n = tensor_bytes(&t.ne, t.ggml_type) as usize;
            let old = t.offset as usize;
            let chunk = self.data[old..old + n].to_vec();
            data.resize((data.len() as u64).next_multiple_of(align) as usize, 0);
            t.offset = data.len() as u64;
            data.extend(chunk);
        }
        data.resize((data.len() as u64).next_multiple_of(align) as usize, 0);
        self.data = data;
        self.pad_to = align;
        self
    }

    /// The GGUF encoding.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend(
            self.n_tensors
                .unwrap_or(self.tensors.len() as u64)
                .to_le_bytes(),
        );
        out.extend(
            self.n_kv
                .unwrap_or(self.metadata.len() as u64)
                .to_le_bytes(),
        );
        for (key, md) in &self.metadata {
            gguf_string(&mut out, key);
            match md {
                Md::V(v) => {
                    out.extend(value_type_id(v).to_le_bytes());
                    encode_value(&mut out, v);
                }
                Md::Raw { ty, bytes } => {
                    out.extend(ty.to_le_bytes());
                    out.extend(bytes);
                }
            }
        }
        for t in &self.tensors {
            gguf_string(&mut out, &t.name);
            out.extend((t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ggml_type.to_le_bytes());
            out.extend(t.offset.to_le_bytes());
        }
        out.resize((out.len() as u64).next_multiple_of(self.pad_to) as usize, 0);
        out.extend(&self.data);
        out
    }

    /// Writes the encoding to `path`.
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        std::fs::write(path, self.to_bytes())?;
        Ok(())
    }
}
