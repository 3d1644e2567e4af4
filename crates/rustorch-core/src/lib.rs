//! rustorch-core: the GGUF container, ggml tensor formats, the backend interface and the
//! CPU backend (kernels, thread pool), and the KV cache.

pub mod backend;
pub mod gguf;
pub mod kernels;
pub mod kv_cache;
pub mod quant;
pub mod types;

pub use types::GgmlType;
