//! InferScale inside vLLM: a KV connector (vLLM's V1 connector API, no
//! engine changes) whose Rust core owns the user memory shard in vLLM's
//! worker process and writes stored pre-RoPE KV, rotated to its prompt
//! positions, straight into vLLM's paged cache.
//!
//! - [`layout`]: vLLM's cache layouts, detected from the tensors' shapes.
//! - [`plan`]: a request's memory plan as carried in `kv_transfer_params`,
//!   and the scheduler side's matched-token decision.
//! - [`inject`]: the write of stored KV into one layer of a host cache
//!   (device caches: `inferscale_cuda::external`, with feature `cuda`).
//! - [`memory_core`]: the memory shard, composition and loads, on either backend.
//! - [`front`]: the worker gRPC API served from the core's process, its
//!   Generate relayed to the co-located vLLM server (`relay`).
//! - `python` (feature `python`): the PyO3 module `inferscale_vllm._core`
//!   behind the Python shim `inferscale_vllm.connector`.

/// Runs `$e` with `$c` bound to the [`memory_core::Core`] inside an
/// [`memory_core::AnyCore`], whichever backend it runs on.
macro_rules! each {
    ($any:expr, $c:ident => $e:expr) => {
        match $any {
            $crate::memory_core::AnyCore::Cpu($c) => $e,
            #[cfg(feature = "cuda")]
            $crate::memory_core::AnyCore::Cuda($c) => $e,
        }
    };
}

pub mod error;
pub mod front;
pub mod inject;
pub mod layout;
pub mod memory_core;
pub mod plan;
#[cfg(feature = "python")]
mod python;
mod relay;

pub use error::{ConnectorError, Result};
