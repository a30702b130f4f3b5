//! NCCL on this machine: [`Link`], one end of a two-rank communicator that
//! shard moves between GPUs of one host go over, and [`self_test`], a
//! point-to-point transfer on one GPU checked for integrity and timed next
//! to a device-to-device copy.
//!
//! libnccl is opened at run time like the other CUDA libraries (NVIDIA's
//! `nvidia-nccl-cu13` wheel provides it); a missing library is an error
//! here, not a crash.
//!
//! A [`Link`]'s communicator is non-blocking (`config.blocking = 0`) so that
//! nothing waits on the peer without a deadline: NCCL's own calls would
//! block forever on a peer that never joins or never posts its half of a
//! transfer, and a serving process must not lose a thread (and a device
//! buffer) to a peer that died. Every wait polls `ncclCommGetAsyncError`
//! (and the stream) until the deadline, then aborts the communicator.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::safe::{Comm, Id};
use cudarc::nccl::sys::{self, ncclResult_t};

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

/// The library's version, `major.minor.patch`.
fn version() -> String {
    let v = cudarc::nccl::result::get_nccl_version().unwrap_or(0);
    format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
}

/// Test bytes that differ from byte to byte and from run to run of them.
fn pattern(bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8).collect()
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
    library()?;
    let ctx = CudaContext::new(ordinal)?;
    let stream = ctx.default_stream();
    let id = Id::new().map_err(nccl)?;
    let comm = Comm::from_rank(stream.clone(), 0, 1, id).map_err(nccl)?;

    let pattern = pattern(bytes);
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
    Ok(SelfTest { device: ctx.name()?, nccl_version: version(), bytes, nccl_gb_s: nccl_rates, copy_gb_s: copy_rates })
}

/// What [`pair_test`] measured between two GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct PairTest {
    pub devices: [String; 2],
    pub nccl_version: String,
    pub bytes: usize,
    /// NCCL send/recv from the first GPU to the second, GB/s per transfer.
    pub nccl_gb_s: Vec<f64>,
    /// A peer copy (`cuMemcpyPeerAsync`) of the same bytes, GB/s.
    pub copy_gb_s: Vec<f64>,
}

/// Sends `bytes` from GPU `a` to GPU `b` `repeat` times through a two-rank
/// NCCL communicator (after one checked warm-up) and as a peer copy; checks
/// the received bytes and times both with the host clock around a
/// synchronisation of both GPUs (transfers of hundreds of MiB take
/// milliseconds; pass at least that).
pub fn pair_test(a: usize, b: usize, bytes: usize, repeat: usize) -> Result<PairTest> {
    if a == b || bytes == 0 || repeat == 0 {
        return Err(CudaError::Unsupported("the pair test needs two different GPUs, bytes > 0, repeat > 0".into()));
    }
    library()?;
    let (ca, cb) = (CudaContext::new(a)?, CudaContext::new(b)?);
    let (sa, sb) = (ca.new_stream()?, cb.new_stream()?);
    let comms = Comm::from_devices(vec![sa.clone(), sb.clone()]).map_err(nccl)?;
    let pattern = pattern(bytes);
    let src: CudaSlice<u8> = sa.clone_htod(&pattern)?;
    let mut dst: CudaSlice<u8> = sb.alloc_zeros(bytes)?;
    let mut copy: CudaSlice<u8> = sb.alloc_zeros(bytes)?;
    let both = || -> Result<()> {
        sa.synchronize()?;
        sb.synchronize()?;
        Ok(())
    };
    let send = |dst: &mut CudaSlice<u8>| -> Result<f64> {
        both()?;
        let t = Instant::now();
        cudarc::nccl::result::group_start().map_err(nccl)?;
        let sent = comms[0].send(&src, 1).map_err(nccl);
        let received = comms[1].recv(dst, 0).map(|_| ()).map_err(nccl);
        cudarc::nccl::result::group_end().map_err(nccl)?;
        sent?;
        received?;
        both()?;
        Ok(t.elapsed().as_secs_f64())
    };
    send(&mut dst)?; // warm-up: NCCL connects the pair on first use
    if sb.clone_dtoh(&dst)? != pattern {
        return Err(CudaError::Nccl("NCCL delivered different bytes than were sent".into()));
    }
    let gb_s = |s: f64| bytes as f64 / s / 1e9;
    let (mut nccl_rates, mut copy_rates) = (Vec::with_capacity(repeat), Vec::with_capacity(repeat));
    for _ in 0..repeat {
        sb.memset_zeros(&mut dst)?;
        nccl_rates.push(gb_s(send(&mut dst)?));
        both()?;
        let t = Instant::now();
        sb.memcpy_dtod(&src, &mut copy)?;
        both()?;
        copy_rates.push(gb_s(t.elapsed().as_secs_f64()));
    }
    if sb.clone_dtoh(&dst)? != pattern || sb.clone_dtoh(&copy)? != pattern {
        return Err(CudaError::Nccl("a timed transfer delivered different bytes than were sent".into()));
    }
    Ok(PairTest {
        devices: [ca.name()?, cb.name()?],
        nccl_version: version(),
        bytes,
        nccl_gb_s: nccl_rates,
        copy_gb_s: copy_rates,
    })
}

/// Bytes of an NCCL unique id: what the two ends of a [`Link`] share to find
/// each other.
pub const ID_BYTES: usize = 128;

fn library() -> Result<()> {
    // SAFETY: only tries to open the library; nothing is called through it.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Nccl(
            "libnccl was not found on the library path (NVIDIA's nvidia-nccl-cu13 wheel has it under nvidia/nccl/lib)"
                .into(),
        ))
    }
}

/// Whether libnccl can be opened here.
pub fn available() -> bool {
    library().is_ok()
}

/// GPU `ordinal`'s UUID as `nvidia-smi -L` prints it (`GPU-xxxxxxxx-…`):
/// the name two processes agree on whatever devices each is shown.
pub fn device_uuid(ordinal: usize) -> Result<String> {
    let ctx = CudaContext::new(ordinal)?;
    let b = ctx.uuid()?.bytes.map(|c| c as u8);
    let hex = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    Ok(format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16)))
}

/// NCCL's description of `r`, and of the communicator's last error.
fn describe(r: ncclResult_t, comm: sys::ncclComm_t) -> String {
    let text = |p: *const std::ffi::c_char| {
        // SAFETY: NCCL returns NUL-terminated static or per-comm strings.
        (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    // SAFETY: both take plain values; a null comm is allowed.
    let what = text(unsafe { sys::ncclGetErrorString(r) }).unwrap_or_else(|| format!("{r:?}"));
    match text(unsafe { sys::ncclGetLastError(comm) }) {
        Some(last) if !last.is_empty() => format!("{what}: {last}"),
        _ => what,
    }
}

/// A new unique id for a [`Link`]: the rank that makes it hands it to the
/// other (the shard move's control stream carries it).
pub fn new_id() -> Result<[u8; ID_BYTES]> {
    library()?;
    let id = cudarc::nccl::result::get_uniqueid().map_err(|e| CudaError::Nccl(describe(e.0, std::ptr::null_mut())))?;
    Ok(id.internal.map(|c| c as u8))
}

/// One end of a two-rank NCCL communicator between the GPUs of two
/// workers: host frames go up to a device buffer, across with
/// `ncclSend`/`ncclRecv`, and down at the other end. The two ends must call
/// [`Link::send`] and [`Link::recv`] in matching order and sizes (the shard
/// manifest tells the receiver the sizes).
pub struct Link {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: sys::ncclComm_t,
    peer: i32,
    buf: CudaSlice<u8>,
    timeout: Duration,
    /// Set once a wait failed or timed out: the communicator was aborted.
    broken: bool,
}

// SAFETY: the communicator is used by one thread at a time (`&mut self`),
// which NCCL allows; the raw pointer is what keeps the type from being Send.
unsafe impl Send for Link {}

impl Link {
    /// Joins the communicator named by `id` as `rank` (0 or 1) on device
    /// `ordinal`, with frames of at most `frame_bytes`. Waits up to
    /// `timeout` for the peer; every later transfer has the same deadline.
    pub fn connect(ordinal: usize, id: &[u8], rank: usize, frame_bytes: usize, timeout: Duration) -> Result<Link> {
        library()?;
        if rank > 1 || frame_bytes == 0 {
            return Err(CudaError::Unsupported(format!("a link has ranks 0 and 1 and frames > 0 (rank {rank})")));
        }
        let internal: [std::ffi::c_char; ID_BYTES] = id
            .try_into()
            .map(|b: [u8; ID_BYTES]| b.map(|c| c as std::ffi::c_char))
            .map_err(|_| CudaError::Nccl(format!("an NCCL unique id has {ID_BYTES} bytes, got {}", id.len())))?;
        let ctx = CudaContext::new(ordinal)?;
        ctx.bind_to_thread()?;
        let stream = ctx.new_stream()?;
        let buf = stream.alloc_zeros::<u8>(frame_bytes)?;
        let version = cudarc::nccl::result::get_nccl_version().unwrap_or(0);
        const UNDEF: i32 = i32::MIN; // NCCL_CONFIG_UNDEF_INT: NCCL's default
        let mut config = sys::ncclConfig_t {
            size: std::mem::size_of::<sys::ncclConfig_t>(),
            magic: 0xcafe_beef,
            // The struct is 2.30's; an older library reads its own prefix.
            version: version.clamp(0, 23000) as u32,
            blocking: 0,
            cgaClusterSize: UNDEF,
            minCTAs: UNDEF,
            maxCTAs: UNDEF,
            netName: std::ptr::null(),
            splitShare: UNDEF,
            trafficClass: UNDEF,
            commName: std::ptr::null(),
            collnetEnable: UNDEF,
            CTAPolicy: UNDEF,
            shrinkShare: UNDEF,
            nvlsCTAs: UNDEF,
            nChannelsPerNetPeer: UNDEF,
            nvlinkCentricSched: UNDEF,
            graphUsageMode: UNDEF,
            numRmaCtx: UNDEF,
            maxP2pPeers: UNDEF,
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` outlive the call; the id is 128 bytes.
        let r = unsafe {
            sys::ncclCommInitRankConfig(&mut comm, 2, sys::ncclUniqueId { internal }, rank as i32, &mut config)
        };
        if !matches!(r, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress) {
            let e = describe(r, comm);
            if !comm.is_null() {
                // SAFETY: a communicator NCCL handed back, not used again.
                unsafe { sys::ncclCommAbort(comm) };
            }
            return Err(CudaError::Nccl(format!("joining the link as rank {rank}: {e}")));
        }
        let mut link = Link { ctx, stream, comm, peer: 1 - rank as i32, buf, timeout, broken: false };
        link.settle(Instant::now() + timeout, "waiting for the peer to join")?;
        Ok(link)
    }

    /// Waits until the communicator has no operation in progress.
    fn settle(&mut self, deadline: Instant, what: &str) -> Result<()> {
        loop {
            let mut state = ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator; `state` is written.
            let r = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
            let r = if r == ncclResult_t::ncclSuccess { state } else { r };
            match r {
                ncclResult_t::ncclSuccess => return Ok(()),
                ncclResult_t::ncclInProgress if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(200))
                }
                ncclResult_t::ncclInProgress => return Err(self.abort(format!("{what}: timed out"))),
                e => {
                    let e = describe(e, self.comm);
                    return Err(self.abort(format!("{what}: {e}")));
                }
            }
        }
    }

    /// Waits until the stream's work is done, watching the communicator.
    fn drain(&mut self, deadline: Instant, what: &str) -> Result<()> {
        loop {
            // SAFETY: a live stream of this link.
            match unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) } {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(self.abort(format!("{what}: the device stream failed ({e:?})"))),
            }
            self.settle(deadline, what)?;
            if Instant::now() >= deadline {
                return Err(self.abort(format!("{what}: timed out")));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn abort(&mut self, reason: String) -> CudaError {
        if !self.broken {
            self.broken = true;
            // SAFETY: a live communicator; abort also stops its kernels.
            unsafe { sys::ncclCommAbort(self.comm) };
        }
        CudaError::Nccl(reason)
    }

    /// Ready for a transfer of `len` bytes on the calling thread (a link
    /// may move between threads of a pool; NCCL and the stream want the
    /// device's context current).
    fn check(&self, len: usize) -> Result<()> {
        if self.broken {
            return Err(CudaError::Nccl("the link failed earlier and was closed".into()));
        }
        self.ctx.bind_to_thread()?;
        if len == 0 || len > self.buf.len() {
            return Err(CudaError::Nccl(format!("a frame of {len} bytes on a link of {}-byte frames", self.buf.len())));
        }
        Ok(())
    }

    /// Sends `frame` to the peer; returns once it has left this device.
    pub fn send(&mut self, frame: &[u8]) -> Result<()> {
        self.check(frame.len())?;
        let deadline = Instant::now() + self.timeout;
        let mut view = self.buf.slice_mut(..frame.len());
        self.stream.memcpy_htod(frame, &mut view)?;
        let (ptr, _sync) = view.device_ptr(&self.stream);
        // SAFETY: `ptr` is `frame.len()` bytes on this link's device, kept
        // alive by `self.buf`; the stream is the link's.
        let r = unsafe {
            sys::ncclSend(
                ptr as *const std::ffi::c_void,
                frame.len(),
                sys::ncclDataType_t::ncclUint8,
                self.peer,
                self.comm,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        };
        drop(_sync);
        self.enqueued(r, deadline, "sending a frame")
    }

    /// Receives the peer's next frame, of `len` bytes.
    pub fn recv(&mut self, len: usize) -> Result<Vec<u8>> {
        self.check(len)?;
        let deadline = Instant::now() + self.timeout;
        let mut view = self.buf.slice_mut(..len);
        let (ptr, _sync) = view.device_ptr_mut(&self.stream);
        // SAFETY: as in `send`, for `len` writable bytes.
        let r = unsafe {
            sys::ncclRecv(
                ptr as *mut std::ffi::c_void,
                len,
                sys::ncclDataType_t::ncclUint8,
                self.peer,
                self.comm,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        };
        drop(_sync);
        self.enqueued(r, deadline, "receiving a frame")?;
        let mut out = vec![0u8; len];
        self.stream.memcpy_dtoh(&self.buf.slice(..len), &mut out)?;
        self.drain(deadline, "copying a received frame")?;
        Ok(out)
    }

    /// After an NCCL call: waits for it to be enqueued, then for the stream.
    fn enqueued(&mut self, r: ncclResult_t, deadline: Instant, what: &str) -> Result<()> {
        if !matches!(r, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress) {
            let e = describe(r, self.comm);
            return Err(self.abort(format!("{what}: {e}")));
        }
        self.settle(deadline, what)?;
        self.drain(deadline, what)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if self.broken {
            return; // aborted: NCCL freed it
        }
        let _ = self.ctx.bind_to_thread();
        // Nothing is in flight (every transfer waits for its stream), so
        // finalizing is quick; a peer gone mid-way makes it abort instead.
        // SAFETY: a live communicator.
        let r = unsafe { sys::ncclCommFinalize(self.comm) };
        let settled = matches!(r, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress)
            && self.settle(Instant::now() + Duration::from_secs(5), "closing the link").is_ok();
        if settled {
            // SAFETY: finalized; destroy frees it.
            unsafe { sys::ncclCommDestroy(self.comm) };
        } else if !self.broken {
            let _ = self.abort(String::new());
        }
    }
}
