//! The NCCL links a CUDA worker moves shards' KV over, and the GPU identity
//! it registers so routers know which workers share a host.

use std::sync::Arc;

use inferscale_cluster::view::GpuId;
use inferscale_worker::link::Links;

use crate::serve::WorkerArgs;

/// The links and GPU identity of a worker started with `a`: none for a CPU
/// worker, or where libnccl is missing (its moves then go over gRPC).
#[cfg(feature = "cuda")]
pub(crate) fn nccl(a: &WorkerArgs) -> Option<(Arc<dyn Links>, GpuId)> {
    (a.mem.model.backend == "cuda").then(|| cuda::links(a.mem.model.device)).flatten()
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn nccl(_: &WorkerArgs) -> Option<(Arc<dyn Links>, GpuId)> {
    None
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;
    use std::time::Duration;

    use inferscale_cluster::view::GpuId;
    use inferscale_cuda::nccl::{self, Link};
    use inferscale_worker::WorkerError;
    use inferscale_worker::link::{FrameLink, Links};

    /// This machine's name for comparing hosts: `INFERSCALE_HOST_ID`, else the
    /// Kubernetes node (`NODE_NAME`, set by the Helm chart from `spec.nodeName`:
    /// two pods of one node differ in hostname and often in machine id), else
    /// `/etc/machine-id`, else the hostname.
    fn host_id() -> Option<String> {
        let env = |k| std::env::var(k).ok().map(|v: String| v.trim().to_string()).filter(|v| !v.is_empty());
        let file = |p| std::fs::read_to_string(p).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        env("INFERSCALE_HOST_ID")
            .or_else(|| env("NODE_NAME"))
            .or_else(|| file("/etc/machine-id"))
            .or_else(|| file("/proc/sys/kernel/hostname"))
    }

    /// How long either end waits for the other: to join, and per frame.
    const LINK_TIMEOUT: Duration = Duration::from_secs(60);

    struct NcclLinks {
        device: usize,
    }

    struct NcclLink(Link);

    fn link_error(e: inferscale_cuda::CudaError) -> WorkerError {
        WorkerError::Link(e.to_string())
    }

    impl Links for NcclLinks {
        fn new_id(&self) -> inferscale_worker::Result<Vec<u8>> {
            Ok(nccl::new_id().map_err(link_error)?.to_vec())
        }

        fn connect(
            &self,
            id: &[u8],
            sender: bool,
            frame_bytes: usize,
        ) -> inferscale_worker::Result<Box<dyn FrameLink>> {
            let rank = if sender { 0 } else { 1 };
            let link = Link::connect(self.device, id, rank, frame_bytes, LINK_TIMEOUT).map_err(link_error)?;
            Ok(Box::new(NcclLink(link)))
        }
    }

    impl FrameLink for NcclLink {
        fn send(&mut self, frame: &[u8]) -> inferscale_worker::Result<()> {
            self.0.send(frame).map_err(link_error)
        }

        fn recv(&mut self, len: usize) -> inferscale_worker::Result<Vec<u8>> {
            self.0.recv(len).map_err(link_error)
        }
    }

    pub(super) fn links(device: usize) -> Option<(Arc<dyn Links>, GpuId)> {
        if !nccl::available() {
            eprintln!("inferscale worker: libnccl not found; shard moves from and to this GPU go over gRPC");
            return None;
        }
        // INFERSCALE_GPU_ID stands in for the UUID: two workers sharing one
        // GPU in a dry run (each with its own NCCL_HOSTID) can be told apart.
        let uuid = std::env::var("INFERSCALE_GPU_ID").map_err(|_| ()).or_else(|()| nccl::device_uuid(device));
        let (Some(host), Ok(uuid)) = (host_id(), uuid) else {
            eprintln!("inferscale worker: no host id or GPU UUID; shard moves go over gRPC");
            return None;
        };
        eprintln!("inferscale worker: NCCL links ready on {uuid} (host {host})");
        Some((Arc::new(NcclLinks { device }), GpuId { host, device: uuid }))
    }
}
