//! Writing GGUF v3 files, laid out the way llama.cpp's `gguf` Python package lays
//! them out: header, metadata, tensor infos, zero padding to the alignment, then each
//! tensor's data padded to the alignment.

use std::io::Write;

use super::error::GgufError;
use super::reader::align_up;
use super::value::{Value, ValueType};
use super::{DEFAULT_ALIGNMENT, MAGIC};
use crate::types::GgmlType;

struct PendingTensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes them as one GGUF file.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a metadata key, keeping first-insertion order.
    pub fn add(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key, value)),
        }
    }

    /// Adds a tensor; `dims` in ggml order (row length first); `data` its encoded bytes.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
        data: Vec<u8>,
    ) -> Result<(), GgufError> {
        let name = name.into();
        if dims.len() > super::MAX_DIMS {
            return Err(GgufError::InvalidWrite(format!(
                "tensor '{name}' has {} dimensions",
                dims.len()
            )));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::InvalidWrite(format!(
                "duplicate tensor name '{name}'"
            )));
        }
        // Checked: an overflowing shape is an error here, not a panic.
        let expected = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| ty.bytes_for(n));
        if expected != Some(data.len() as u64) {
            return Err(GgufError::InvalidWrite(format!(
                "tensor '{name}': {} bytes given, {ty} with shape {dims:?} needs {expected:?}",
                data.len()
            )));
        }
        self.tensors.push(PendingTensor {
            name,
            ty,
            dims: dims.to_vec(),
            data,
        });
        Ok(())
    }

    fn alignment(&self) -> Result<u64, GgufError> {
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => Ok(a),
                _ => Err(GgufError::BadAlignment {
                    value: v.as_u64().unwrap_or(0),
                }),
            },
        }
    }

    /// Encodes the whole file.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        let alignment = self.alignment()?;
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            out.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            put_value(&mut out, value)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset += align_up(t.data.len() as u64, alignment);
        }
        pad(&mut out, alignment);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            pad(&mut out, alignment);
        }
        Ok(out)
    }

    pub fn write_to(&self, w: &mut impl Write) -> Result<(), GgufError> {
        let bytes = self.to_bytes()?;
        w.write_all(&bytes).map_err(GgufError::Write)
    }
}

fn pad(out: &mut Vec<u8>, alignment: u64) {
    let target = align_up(out.len() as u64, alignment) as usize;
    out.resize(target, 0);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) -> Result<(), GgufError> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(elem, items) => {
            out.extend_from_slice(&(*elem as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                let same = item.value_type() == *elem;
                if !same || (*elem == ValueType::Array && !matches!(item, Value::Array(..))) {
                    return Err(GgufError::InvalidWrite(format!(
                        "array of {} holds a {}",
                        elem.name(),
                        item.type_name()
                    )));
                }
                put_value(out, item)?;
            }
        }
    }
    Ok(())
}
