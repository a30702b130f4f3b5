//! `inferscale bench migrate`: how fast a user's shard (facts + pre-RoPE KV)
//! moves between two workers. By default two workers run in this process,
//! each with its own memory, and the shard goes over the gRPC stream on
//! loopback; `--peers A,B` drives two running workers instead (e.g. one per
//! GPU), and `--nccl` puts the KV on an NCCL link between them. One user's
//! shard goes back and forth. Side by side: the export stream alone (read
//! from the engine, sent, discarded by the client) and the full move
//! (export, then the receiver's checks, staging with fsync, and commit).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use inferscale_loadtest::synthetic::synthetic_facts;
use inferscale_proto as pb;
use inferscale_proto::worker_client::WorkerClient;
use serde::Serialize;
use tokio::net::TcpListener;
use tonic::transport::Channel;

use super::median;
use crate::serve::{WorkerArgs, runtime, serve_grpc, start_worker};

#[derive(Args, Debug)]
pub struct MigrateBenchArgs {
    /// Facts of the moved user (each carries its KV: layers × 2 × kv_dim × tokens f32).
    #[arg(long, default_value_t = 200)]
    facts: usize,
    /// Moves measured (alternating direction); the median is reported.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Write results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Two running workers' gRPC addresses to move between, instead of two
    /// in this process (a user `bench-migrate-<pid>` is made there and forgotten
    /// at the end).
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// Move the KV over an NCCL link (CUDA workers whose GPUs share a host).
    #[arg(long)]
    nccl: bool,
    #[command(flatten)]
    worker: WorkerArgs,
}

#[derive(Serialize, Debug)]
struct Row {
    what: &'static str,
    megabytes: f64,
    seconds_median: f64,
    mb_per_s: f64,
}

#[derive(Serialize, Debug)]
struct Report {
    model: String,
    backend: String,
    facts: usize,
    transport: &'static str,
    results: Vec<Row>,
}

async fn client(addr: &str) -> Result<WorkerClient<Channel>> {
    let max = inferscale_worker::transfer::MAX_MESSAGE_BYTES;
    Ok(WorkerClient::connect(format!("http://{addr}"))
        .await?
        .max_decoding_message_size(max)
        .max_encoding_message_size(max))
}

pub fn run(a: MigrateBenchArgs) -> Result<()> {
    if a.facts == 0 || a.repeat == 0 {
        bail!("--facts and --repeat must be at least 1");
    }
    if !a.peers.is_empty() && a.peers.len() != 2 {
        bail!("--peers takes two worker addresses (A,B), got {}", a.peers.len());
    }
    let base = match &a.worker.mem.memory {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("inferscale-bench-migrate-{}", std::process::id())),
    };
    let mut started = Vec::new();
    for side in ["a", "b"].into_iter().filter(|_| a.peers.is_empty()) {
        let mut args = a.worker.clone();
        let dir = base.join(side);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        args.mem.memory = Some(dir);
        let (service, engine, _) = start_worker(&args)?;
        started.push((service, engine));
    }
    let rt = runtime()?;
    // Unique per run: a moved-away user is refused at its old worker for a
    // while, so a second run on the same running workers needs a new name.
    let user = format!("bench-migrate-{}", std::process::id());
    let report = rt.block_on(async {
        let mut addrs = a.peers.clone();
        for (service, _) in &started {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            addrs.push(listener.local_addr()?.to_string());
            tokio::spawn(serve_grpc(listener, service.clone()));
        }
        let mut clients = [client(&addrs[0]).await?, client(&addrs[1]).await?];
        let units: Vec<pb::MemoryUnit> = synthetic_facts(a.facts)
            .into_iter()
            .enumerate()
            .map(|(i, text)| pb::MemoryUnit { id: format!("F{i}"), speaker: "U".into(), text, ..Default::default() })
            .collect();
        let t0 = Instant::now();
        clients[0].ingest(pb::IngestRequest { user: user.clone(), units, ..Default::default() }).await?;
        eprintln!("inferscale bench migrate: {} facts ingested in {:.1} s", a.facts, t0.elapsed().as_secs_f64());
        let (mut export_s, mut send_s, mut bytes) = (Vec::new(), Vec::new(), 0u64);
        let mut at = 0;
        for r in 0..a.repeat {
            // The export stream alone, read and discarded here.
            let t = Instant::now();
            let req = pb::ExportShardRequest { user: user.clone(), with_kv: true, ..Default::default() };
            let mut stream = clients[at].export_shard(req).await?.into_inner();
            let mut streamed = 0u64;
            while let Some(c) = stream.message().await? {
                streamed += c.records.iter().map(|r| (r.fact.len() + r.kv.len()) as u64).sum::<u64>();
            }
            export_s.push(t.elapsed().as_secs_f64());
            // The full move to the other worker, then the source drops it.
            let to = 1 - at;
            let req = pb::SendShardRequest {
                user: user.clone(),
                to: addrs[to].clone(),
                with_kv: true,
                nccl: a.nccl,
                ..Default::default()
            };
            let sent = clients[at].send_shard(req).await?.into_inner();
            let imported = sent.imported.unwrap_or_default();
            if imported.bytes != streamed || imported.with_kv as usize != a.facts {
                bail!(
                    "move {r}: {} bytes and {} KV records arrived, {streamed} bytes were exported",
                    imported.bytes,
                    imported.with_kv
                );
            }
            clients[at].release_shard(pb::ReleaseShardRequest { user: user.clone(), drop: true }).await?;
            send_s.push(sent.seconds);
            bytes = imported.bytes;
            eprintln!(
                "inferscale bench migrate: move {r}: {:.1} MB, export alone {:.3} s, move {:.3} s",
                bytes as f64 / 1e6,
                export_s[r],
                sent.seconds
            );
            at = to;
        }
        // Leave running workers as they were.
        clients[at].forget(pb::ForgetRequest { user: user.clone(), unit_id: String::new() }).await?;
        let mb = bytes as f64 / 1e6;
        let row = |what, s: Vec<f64>| {
            let m = median(s);
            Row { what, megabytes: mb, seconds_median: m, mb_per_s: mb / m }
        };
        let moved = if a.nccl {
            "move over NCCL (export, check, stage, commit)"
        } else {
            "move (export, check, stage, commit)"
        };
        anyhow::Ok(vec![row("export stream (discarded)", export_s), row(moved, send_s)])
    })?;
    drop(rt);
    // The engine threads end once every handle to their services is gone.
    let (services, engines): (Vec<_>, Vec<_>) = started.into_iter().unzip();
    drop(services);
    for engine in engines {
        let _ = engine.join();
    }
    let _ = std::fs::remove_dir_all(base.join("a"));
    let _ = std::fs::remove_dir_all(base.join("b"));
    println!("{:<48} {:>9} {:>10} {:>9}", "", "MB", "s (med)", "MB/s");
    for r in &report {
        println!("{:<48} {:>9.1} {:>10.3} {:>9.0}", r.what, r.megabytes, r.seconds_median, r.mb_per_s);
    }
    if let Some(path) = &a.json {
        let out = Report {
            model: a.worker.mem.model.shape.clone().unwrap_or_else(|| a.worker.mem.model.model().to_string()),
            backend: a.worker.mem.model.backend.clone(),
            facts: a.facts,
            transport: if a.nccl { "nccl" } else { "grpc" },
            results: report,
        };
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
