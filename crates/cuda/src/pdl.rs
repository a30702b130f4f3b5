//! Programmatic dependent launch: the kernels of a decode step, launched so
//! that each may start while the one before it finishes.
//!
//! A batch-1 decode step of a 1.5B model is ~250 kernels of a few
//! microseconds each; between two of them the device drains one grid,
//! launches the next and waits for its first loads — a gap that a CUDA graph
//! does not remove. Launched with `PROGRAMMATIC_STREAM_SERIALIZATION`
//! (Hopper and newer), a kernel's blocks may start once every block of the
//! kernel before it has passed its own `pdl_begin` (kernels/common.cuh);
//! each then waits, in its `pdl_begin`, for that kernel to finish before
//! touching its output — and the GEMV (gemv.cu) has its weight's first
//! words in flight by then. Measured (docs/performance.md): a step run op
//! by op gains ~12 %; a graphed one little — likely because a capture puts
//! an allocation node between each two kernels, and a programmatic edge
//! joins only adjacent kernels. Only kernels that call `pdl_begin` before any dependent read or any
//! write may be launched this way: [`CudaBackend::launch_pdl`]'s callers.
//! `INFERSCALE_CUDA_PDL=0` launches them as any other kernel.

use std::ffi::c_void;

use cudarc::driver::sys::{
    CUlaunchAttribute, CUlaunchAttributeID, CUlaunchAttributeValue, CUlaunchConfig, cuLaunchKernelEx,
};
use cudarc::driver::{CudaFunction, LaunchConfig};
use inferscale_engine::Result;

use crate::backend::{Arg, Cu, CudaBackend};

/// Whether kernels may be launched early on this device: compute
/// capability 9.0 or newer, unless `INFERSCALE_CUDA_PDL=0`.
pub(crate) fn enabled(major: i32) -> bool {
    major >= 9 && std::env::var("INFERSCALE_CUDA_PDL").map_or(true, |v| v != "0")
}

impl CudaBackend {
    /// Launches `f` on the backend's stream, early where enabled (see the
    /// module doc: `f` must call `pdl_begin` first).
    pub(crate) fn launch_pdl(&self, f: &CudaFunction, cfg: LaunchConfig, args: &[&dyn Arg]) -> Result<()> {
        if !self.pdl {
            return self.launch(f, cfg, args);
        }
        if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 || cfg.grid_dim.2 == 0 {
            return Ok(());
        }
        let mut params: Vec<*mut c_void> = args.iter().map(|a| a.param()).collect();
        // SAFETY: a zeroed value is a valid union; the field set is the one
        // the attribute's id names.
        let mut value: CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        self.ctx.bind_to_thread().cu()?;
        // SAFETY: as for `launch_on`: each call site passes the argument list
        // its kernel declares (`params` point at the values in `args`, alive
        // for the call), with device pointers to live buffers.
        unsafe { cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }.result().cu()
    }
}
