//! The GGUF container: reading (memory-mapped, v2 and v3) and writing.
//!
//! Layout (all little-endian): magic `GGUF`, version u32, tensor count u64, metadata
//! count u64, metadata key/values, tensor infos, padding to `general.alignment`
//! (default 32), then the data section. Tensor offsets are relative to the data section.

mod error;
mod reader;
mod value;
mod writer;

pub use error::GgufError;
pub use reader::{GgufFile, TensorInfo, MAX_DIMS, MAX_NESTING};
pub use value::{Value, ValueType};
pub use writer::GgufWriter;

/// `GGUF` as the first four bytes of the file.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
