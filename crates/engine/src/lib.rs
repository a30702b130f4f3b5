//! The InferScale engine: a backend trait of tensor operations, the CPU
//! backend, the paged KV cache, one Llama-family forward pass, sampling and
//! batched generation.
//!
//! Layering: [`kv_cache`] deals only in block ids; [`backend`] implementations
//! own device memory and know nothing of models; `llama` is the model,
//! written once over the trait; `engine` ties a model to a backend and a
//! block pool; [`generate`] runs sampling loops on top.

pub mod backend;
pub mod bert;
mod blend;
pub mod cpu;
mod engine;
mod error;
pub mod fp8;
pub mod fp8_cache;
mod generate;
mod inject;
pub mod kv_cache;
mod llama;
pub mod retrieval;
pub mod rope;
pub mod sampling;
mod shape;

pub use backend::Backend;
pub use backend::attention_mass;
pub use blend::{SELECT_LAYER as BLEND_SELECT_LAYER, blend_rows, keep_count as blend_keep_count};
pub use cpu::CpuBackend;
pub use engine::{Engine, EngineConfig, NextToken, Sequence};
pub use error::{EngineError, Result};
pub use generate::{FinishReason, GenerateRequest, Generation, generate, generate_batch, generate_sequences};
pub use inject::{EncodeItem, KvChunk};
pub use sampling::SamplingParams;
