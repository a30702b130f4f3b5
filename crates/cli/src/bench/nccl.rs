//! `inferscale bench nccl`: NCCL point-to-point on one GPU next to a
//! device-to-device copy — the check that this machine's libnccl loads,
//! builds a communicator and moves bytes intact, before shard moves between
//! two GPUs use the same calls (see `inferscale_cuda::nccl`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct NcclBenchArgs {
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Transfer size in MiB.
    #[arg(long, default_value_t = 1024)]
    mib: usize,
    /// Timed transfers (after one checked warm-up); the median is reported.
    #[arg(long, default_value_t = 10)]
    repeat: usize,
    /// Write the result as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[cfg(feature = "cuda")]
pub fn run(a: NcclBenchArgs) -> Result<()> {
    let t = inferscale_cuda::nccl::self_test(a.device, a.mib << 20, a.repeat)?;
    let (nccl, copy) = (super::median(t.nccl_gb_s), super::median(t.copy_gb_s));
    println!("device {} · NCCL {} · {} MiB, median of {}", t.device, t.nccl_version, a.mib, a.repeat);
    println!("| transfer | GB/s |\n|---|---|");
    println!("| NCCL send/recv, one rank to itself | {:.1} |", nccl);
    println!("| cuMemcpyDtoD | {:.1} |", copy);
    println!("every received byte matched the sent ones");
    if let Some(path) = &a.json {
        let out = serde_json::json!({
            "device": t.device, "nccl": t.nccl_version, "bytes": t.bytes, "repeat": a.repeat,
            "nccl_self_gb_s": nccl, "copy_dtod_gb_s": copy,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn run(_: NcclBenchArgs) -> Result<()> {
    anyhow::bail!("this binary was built without the CUDA backend (feature `cuda`)")
}
