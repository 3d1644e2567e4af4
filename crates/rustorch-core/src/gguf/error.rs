use std::path::PathBuf;

use crate::types::GgmlType;

/// Everything that can be wrong with a GGUF file. Each variant names the key, tensor
/// or byte offset concerned.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open '{path}': {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("'{0}' is a directory, not a GGUF file")]
    IsDirectory(PathBuf),
    #[error("not a GGUF file: magic at offset 0 is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: Vec<u8> },
    #[error("unsupported GGUF version {version} at offset 4 (supported: 2, 3)")]
    UnsupportedVersion { version: u32 },
    #[error("file truncated while reading {what} at offset {offset}: need {needed} bytes, {available} left")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error(
        "{what} at offset {offset} has length {len}, beyond the {available} bytes left in the file"
    )]
    LengthBeyondFile {
        what: String,
        offset: u64,
        len: u64,
        available: u64,
    },
    #[error("metadata key '{key}' at offset {offset}: arrays nested deeper than {max}")]
    NestingTooDeep {
        key: String,
        offset: u64,
        max: usize,
    },
    #[error("metadata key '{key}' at offset {offset}: unknown value type {type_id}")]
    UnknownValueType {
        key: String,
        offset: u64,
        type_id: u32,
    },
    #[error("invalid UTF-8 in {what} at offset {offset}")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error("duplicate metadata key '{key}' at offset {offset}")]
    DuplicateKey { key: String, offset: u64 },
    #[error("general.alignment = {value} is not a power of two (or is zero)")]
    BadAlignment { value: u64 },
    #[error("tensor '{name}' at offset {offset}: unknown tensor type {type_id}")]
    UnknownTensorType {
        name: String,
        offset: u64,
        type_id: u32,
    },
    #[error("tensor '{name}' at offset {offset}: {n_dims} dimensions (at most {max})")]
    TooManyDims {
        name: String,
        offset: u64,
        n_dims: u32,
        max: usize,
    },
    #[error("tensor '{name}' at offset {offset}: dimension {dim} is {value}")]
    BadDimension {
        name: String,
        offset: u64,
        dim: usize,
        value: u64,
    },
    #[error("tensor '{name}': element count of shape {shape:?} overflows")]
    ElementCountOverflow { name: String, shape: Vec<u64> },
    #[error("tensor '{name}': row length {ne0} is not a multiple of the {ty} block size {block}")]
    NotBlockAligned {
        name: String,
        ty: GgmlType,
        ne0: u64,
        block: usize,
    },
    #[error("tensor '{name}': data at offset {offset} with {size} bytes lies beyond the end of the file ({file_len} bytes)")]
    TensorOutOfBounds {
        name: String,
        offset: u64,
        size: u64,
        file_len: u64,
    },
    #[error(
        "tensor '{name}': data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    TensorMisaligned {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error("duplicate tensor name '{name}' at offset {offset}")]
    DuplicateTensor { name: String, offset: u64 },
    #[error("metadata key '{key}' is missing")]
    MissingKey { key: String },
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("tensor '{name}' not found")]
    MissingTensor { name: String },
    #[error("write failed: {0}")]
    Write(#[source] std::io::Error),
    #[error("writer: {0}")]
    InvalidWrite(String),
}
