//! `inferscale bench nccl`: NCCL point-to-point next to a plain copy. On one
//! GPU (the default) a one-rank communicator sends to itself, next to
//! `cuMemcpyDtoD` — the check that libnccl loads and moves bytes intact.
//! With `--peer B`, GPU `--device` sends to GPU B through a two-rank
//! communicator, next to a peer copy between the two: the link a shard move
//! between them uses (see `inferscale_cuda::nccl`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct NcclBenchArgs {
    /// GPU ordinal (the sender with `--peer`).
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// A second GPU to send to, instead of one GPU sending to itself.
    #[arg(long)]
    peer: Option<usize>,
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
    if let Some(peer) = a.peer {
        return pair(&a, peer);
    }
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

#[cfg(feature = "cuda")]
fn pair(a: &NcclBenchArgs, peer: usize) -> Result<()> {
    let t = inferscale_cuda::nccl::pair_test(a.device, peer, a.mib << 20, a.repeat)?;
    let (nccl, copy) = (super::median(t.nccl_gb_s), super::median(t.copy_gb_s));
    println!(
        "GPU {} ({}) -> GPU {peer} ({}) · NCCL {} · {} MiB, median of {}",
        a.device, t.devices[0], t.devices[1], t.nccl_version, a.mib, a.repeat
    );
    println!("| transfer | GB/s |\n|---|---|");
    println!("| NCCL send/recv between the two GPUs | {nccl:.1} |");
    println!("| cuMemcpyPeerAsync | {copy:.1} |");
    println!("every received byte matched the sent ones");
    if let Some(path) = &a.json {
        let out = serde_json::json!({
            "devices": [a.device, peer], "names": t.devices, "nccl": t.nccl_version, "bytes": t.bytes,
            "repeat": a.repeat, "nccl_gb_s": nccl, "copy_peer_gb_s": copy,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn run(_: NcclBenchArgs) -> Result<()> {
    anyhow::bail!("this binary was built without the CUDA backend (feature `cuda`)")
}
