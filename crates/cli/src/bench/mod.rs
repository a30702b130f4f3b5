//! `inferscale bench …`: measurements that print a table and can write JSON.
//! Speed targets live here, not in timed tests.

mod engine;
mod inject;
mod migrate;
mod nccl;
mod serve;
mod store;
mod ttft;

use anyhow::Result;
use clap::Subcommand;
use inferscale_engine::sampling::Rng;

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Prefill and decode throughput of one model next to a plain large GEMM.
    Engine(engine::EngineArgs),
    /// Time to first token with k memory facts, kv injection vs prompt mode.
    Ttft(ttft::TtftArgs),
    /// The KV injection kernel alone next to device and host copies (CUDA).
    Inject(inject::InjectBenchArgs),
    /// Closed-loop serving throughput of one worker, kv vs prompt mode.
    Serve(serve::ServeBenchArgs),
    /// Shard move throughput between two workers over the gRPC stream.
    Migrate(migrate::MigrateBenchArgs),
    /// NCCL send/recv on one GPU (to itself), checked, next to a device copy.
    Nccl(nccl::NcclBenchArgs),
    /// The tiered KV store per segment format: bytes on disk, open time,
    /// a request's facts read from disk, and cached.
    Store(store::StoreBenchArgs),
}

pub fn run(c: Command) -> Result<()> {
    match c {
        Command::Engine(a) => engine::run(a),
        Command::Ttft(a) => ttft::run(a),
        Command::Inject(a) => inject::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Migrate(a) => migrate::run(a),
        Command::Nccl(a) => nccl::run(a),
        Command::Store(a) => store::run(a),
    }
}

/// `len` random token ids of a `vocab`-token vocabulary.
pub(crate) fn random_prompt(rng: &mut Rng, len: usize, vocab: usize) -> Vec<u32> {
    // Skip the first ids: control tokens in every supported vocabulary.
    (0..len).map(|_| 100 + (rng.next_u64() % (vocab as u64 - 100)) as u32).collect()
}

/// The median (upper middle for even counts); 0 for no values.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
