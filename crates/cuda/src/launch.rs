//! How our kernels are launched: their grids, their argument lists, and
//! early launch on Hopper (programmatic dependent launch).

use std::ffi::c_void;

use cudarc::driver::sys::{
    CUlaunchAttribute, CUlaunchAttributeID, CUlaunchAttributeValue, CUlaunchConfig, cuLaunchKernelEx,
};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use inferscale_engine::Result;

use crate::backend::{Cu, CudaBackend};

/// A kernel argument (scalars by value, device pointers as `u64`).
pub(crate) trait Arg {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
    /// Where the value lies, for `cuLaunchKernelEx`'s parameter array.
    fn param(&self) -> *mut c_void;
}

macro_rules! scalar_arg {
    ($($t:ty),*) => {$(
        impl Arg for $t {
            fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
                b.arg(self);
            }
            fn param(&self) -> *mut c_void {
                self as *const $t as *mut c_void
            }
        }
    )*};
}
scalar_arg!(u64, u32, i32, f32, usize);

/// Whether kernels may be launched early ([`CudaBackend::launch_pdl`]) on a
/// device of compute capability `major`.x: 9.0 or newer, unless
/// `INFERSCALE_CUDA_PDL=0`.
///
/// A batch-1 decode step of a 1.5B model is ~250 kernels of a few
/// microseconds each; between two of them the device drains one grid,
/// launches the next and waits for its first loads — a gap that a CUDA graph
/// does not remove. Launched with `PROGRAMMATIC_STREAM_SERIALIZATION`, a
/// kernel's blocks may start once every block of the kernel before it has
/// passed its own `pdl_begin` (kernels/common.cuh); each then waits, in its
/// `pdl_begin`, for that kernel to finish before touching its output — and
/// the GEMV (gemv.cu) has its weight's first words in flight by then. Only
/// kernels that call `pdl_begin` before any dependent read or any write may
/// be launched this way: `launch_pdl`'s callers. Measured
/// (docs/performance.md): a step run op by op gains ~12 %; a graphed one
/// little — likely because a capture puts an allocation node between each
/// two kernels, and a programmatic edge joins only adjacent kernels.
pub(crate) fn pdl_enabled(major: i32) -> bool {
    major >= 9 && std::env::var("INFERSCALE_CUDA_PDL").map_or(true, |v| v != "0")
}

impl CudaBackend {
    /// A grid-stride elementwise launch over `n` elements.
    pub(crate) fn elementwise_cfg(&self, n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, self.sm_count * 16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Grid (column blocks, rows) covering `cols` threads per row.
    pub(crate) fn row_blocks_cfg(rows: usize, cols: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (cols.div_ceil(256).max(1) as u32, rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    pub(crate) fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
        LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
    }

    pub(crate) fn launch(&self, f: &CudaFunction, cfg: LaunchConfig, args: &[&dyn Arg]) -> Result<()> {
        self.launch_on(&self.stream, f, cfg, args)
    }

    pub(crate) fn launch_on(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &[&dyn Arg],
    ) -> Result<()> {
        if empty(&cfg) {
            return Ok(());
        }
        let mut b = stream.launch_builder(f);
        for a in args {
            a.push(&mut b);
        }
        // SAFETY: each call site passes the argument list its kernel declares,
        // with device pointers to live buffers of the sizes the kernel indexes.
        unsafe { b.launch(cfg) }.map(|_| ()).cu()
    }

    /// Launches `f` on the backend's stream, early where enabled
    /// ([`pdl_enabled`]): `f` must call `pdl_begin` first.
    pub(crate) fn launch_pdl(&self, f: &CudaFunction, cfg: LaunchConfig, args: &[&dyn Arg]) -> Result<()> {
        if !self.pdl {
            return self.launch(f, cfg, args);
        }
        if empty(&cfg) {
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

/// A grid of no blocks: nothing to launch (the driver would refuse it).
fn empty(cfg: &LaunchConfig) -> bool {
    cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 || cfg.grid_dim.2 == 0
}
