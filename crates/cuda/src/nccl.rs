//! NCCL on this machine: the library, a communicator, and a point-to-point
//! transfer checked for integrity and timed next to a device-to-device copy.
//!
//! Shard moves between GPUs of one host will go over `ncclSend`/`ncclRecv`
//! (one rank per worker, the unique id exchanged through the placement
//! store). Before two workers exist to test that, [`self_test`] exercises
//! the same calls on one GPU: a one-rank communicator sends a buffer to
//! itself inside a group (NCCL allows a rank to be its own peer), the
//! receiver's bytes are compared with the sender's, and both the transfer
//! and a plain `cuMemcpyDtoD` of the same size are timed with device events.
//! libnccl is opened at run time like the other CUDA libraries (NVIDIA's
//! `nvidia-nccl-cu13` wheel provides it); a missing library is an error
//! here, not a crash.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::safe::{Comm, Id};

use crate::error::{CudaError, Result};

/// What [`self_test`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SelfTest {
    pub device: String,
    pub nccl_version: String,
    pub bytes: usize,
    /// Each timed transfer's rate, in GB/s (10⁹ bytes per second).
    pub nccl_gb_s: Vec<f64>,
    pub copy_gb_s: Vec<f64>,
}

fn nccl(e: cudarc::nccl::result::NcclError) -> CudaError {
    CudaError::Nccl(format!("{e:?}"))
}

/// Times `f`'s work on `stream` with device events, in milliseconds.
fn timed(stream: &Arc<CudaStream>, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(flags)?;
    f()?;
    let end = stream.record_event(flags)?;
    end.synchronize()?;
    Ok(f64::from(start.elapsed_ms(&end)?))
}

/// Sends `bytes` from GPU `ordinal` to itself through a one-rank NCCL
/// communicator `repeat` times (after one warm-up), checks every received
/// byte, and times it next to a device-to-device copy.
pub fn self_test(ordinal: usize, bytes: usize, repeat: usize) -> Result<SelfTest> {
    if bytes == 0 || repeat == 0 {
        return Err(CudaError::Unsupported("the NCCL self-test needs bytes > 0 and repeat > 0".into()));
    }
    // SAFETY: only tries to open the library; nothing is called through it.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(CudaError::Nccl(
            "libnccl was not found on the library path (NVIDIA's nvidia-nccl-cu13 wheel has it under nvidia/nccl/lib)"
                .into(),
        ));
    }
    let ctx = CudaContext::new(ordinal)?;
    let stream = ctx.default_stream();
    let mut version = 0i32;
    // SAFETY: ncclGetVersion writes one int.
    unsafe { cudarc::nccl::sys::ncclGetVersion(&mut version) };
    let id = Id::new().map_err(nccl)?;
    let comm = Comm::from_rank(stream.clone(), 0, 1, id).map_err(nccl)?;

    // A pattern that differs from byte to byte and from run to run of it.
    let pattern: Vec<u8> = (0..bytes).map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8).collect();
    let src: CudaSlice<u8> = stream.clone_htod(&pattern)?;
    let mut dst: CudaSlice<u8> = stream.alloc_zeros(bytes)?;
    let mut copy: CudaSlice<u8> = stream.alloc_zeros(bytes)?;

    let send = |dst: &mut CudaSlice<u8>| -> Result<()> {
        let mut group = comm.group();
        group.send(src.slice(..), 0).map_err(nccl)?;
        group.recv(dst.slice_mut(..), 0).map_err(nccl)?;
        drop(group);
        Ok(())
    };
    send(&mut dst)?; // warm-up: NCCL sets up its self-connection on first use
    stream.synchronize()?;
    if stream.clone_dtoh(&dst)? != pattern {
        return Err(CudaError::Nccl("a self send/recv delivered different bytes than were sent".into()));
    }
    let gb_s = |ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;
    let mut nccl_rates = Vec::with_capacity(repeat);
    let mut copy_rates = Vec::with_capacity(repeat);
    for _ in 0..repeat {
        stream.memset_zeros(&mut dst)?;
        nccl_rates.push(gb_s(timed(&stream, || send(&mut dst))?));
        copy_rates.push(gb_s(timed(&stream, || Ok(stream.memcpy_dtod(&src, &mut copy)?))?));
    }
    if stream.clone_dtoh(&dst)? != pattern || stream.clone_dtoh(&copy)? != pattern {
        return Err(CudaError::Nccl("a timed transfer delivered different bytes than were sent".into()));
    }
    Ok(SelfTest {
        device: ctx.name()?,
        nccl_version: format!("{}.{}.{}", version / 10000, version / 100 % 100, version % 100),
        bytes,
        nccl_gb_s: nccl_rates,
        copy_gb_s: copy_rates,
    })
}
