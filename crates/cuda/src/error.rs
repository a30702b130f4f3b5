//! The one error type of the CUDA crate.

use inferscale_engine::EngineError;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The driver library could not be opened or the device not used.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),

    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),

    /// NVRTC failed; `log` is the compiler's output.
    #[error("NVRTC could not compile the kernels ({reason}){log}")]
    Compile { reason: String, log: String },

    /// `cuda_bf16.h` was not found; the message says where we looked.
    #[error("CUDA headers not found: {0}")]
    Headers(String),

    /// NCCL is missing or a collective failed.
    #[error("NCCL: {0}")]
    Nccl(String),

    #[error("{0}")]
    Unsupported(String),
}

impl From<CudaError> for EngineError {
    fn from(e: CudaError) -> Self {
        EngineError::Backend { backend: "cuda", reason: e.to_string() }
    }
}

pub type Result<T> = std::result::Result<T, CudaError>;
