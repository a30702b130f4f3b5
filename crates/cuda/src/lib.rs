//! The CUDA backend of InferScale: bf16 weights and activations with f32
//! accumulation, cuBLAS GEMMs, and our kernels (`kernels/*.cu`) compiled by
//! NVRTC at start for the device's architecture — among them the fused
//! re-rotate-and-scatter injection of pre-RoPE KV into the paged cache and a
//! tensor-core paged attention for prefill and decode.
//!
//! Libraries are loaded at run time (cudarc's dynamic loading), so building
//! needs no CUDA toolkit; [`CudaBackend::new`] fails with a clear error on a
//! machine without a driver. [`parity`] checks this backend against the CPU
//! reference.

mod backend;
mod bench;
mod error;
pub mod external;
mod fused;
mod gemm;
mod graphs;
pub mod kernels;
mod launch;
pub mod nccl;
mod paged;
mod paged_fp8;
pub mod parity;
mod profile;
mod retrieval;
mod tier;

pub use backend::{CudaBackend, CudaKvStore, CudaTensor};
pub use error::{CudaError, Result};
pub use external::{ExternalCache, ExternalChunk};
pub use retrieval::CudaEmbeddings;
