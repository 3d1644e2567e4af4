//! rustorch-core: the GGUF container, ggml tensor formats and CPU kernels.

pub mod gguf;
pub mod kernels;
pub mod quant;
pub mod types;

pub use types::GgmlType;
