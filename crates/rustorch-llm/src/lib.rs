//! rustorch-llm: tokenizers, architectures, KV cache, batches, sampling, chat templates
//! and the generation engine. Nothing here prints: results are returned and progress is
//! reported through `tracing` events.

pub mod batch;
pub mod chat;
pub mod engine;
pub mod grammar;
pub use rustorch_core::kv_cache;
pub mod model;
pub mod sampler;
pub mod scheduler;
pub mod tokenizer;
pub mod tools;

pub use batch::{Batch, SeqId};
pub use kv_cache::{KvCache, KvCacheError};
pub use model::{Arch, ForwardOutput, HParams, Logits, Model, ModelError, Placement, Runtime};
