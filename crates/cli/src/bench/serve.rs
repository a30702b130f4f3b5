//! `inferscale bench serve`: closed-loop serving throughput of one worker,
//! kv and prompt mode side by side.
//!
//! The worker runs in this process behind its real gRPC service on
//! loopback (the same code `inferscale worker` runs); N client tasks each
//! send a chat request, wait for its last token, and send the next. Every
//! request retrieves `k` facts of its user's memory and generates
//! `--max-tokens` tokens (end of sequence ignored, so every request does the
//! same work). Requests that finish inside the measurement window (after a
//! warm-up) count: requests/s, output tokens/s, time to first token
//! (p50/p99, as the client sees it) and end-to-end latency.
//!
//! Memory: `--memory-users` users each ingest `--facts-per-user` synthetic
//! facts first (with `--shape … --random-weights` and the byte-level
//! tokenizer a fact is exactly `--fact-tokens` tokens); client i asks as
//! memory user i mod `--memory-users`. The router is not in the loop: this
//! measures the worker (retrieval, scheduler, engine).
//!
//! With `--ingest-turns N`, each point is measured twice: idle, then while
//! an ingest of N new turns for another user runs on the same worker — what
//! a large ingest does to chats' time to first token and time between
//! tokens (ITL), side by side.
//!
//! With `--audit-shares 0,0.01`, each point is measured at each share of
//! requests audited (the worker's `--audit-share`, changed between points on
//! the same warm worker), and with `--rounds R` the whole grid R times over:
//! what the answer audit costs, against a spread measured in the same run.
//! A point counts its requests audited, waiting after it for their audits.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use inferscale_loadtest::synthetic::synthetic_facts;
use inferscale_memory::Mode;
use inferscale_model::progress::Progress;
use inferscale_proto as pb;
use inferscale_proto::worker_client::WorkerClient;
use inferscale_worker::{PrefixCache, WorkerService};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::Mutex;

use crate::serve::{WorkerArgs, runtime, serve_grpc, start_worker};

const QUESTION: &str = "Where did Caroline go camping last summer?";

#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// Closed-loop client counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,10,50,100")]
    users: Vec<usize>,
    /// Memory modes to measure (kv, blend, prompt, none).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "kv,prompt")]
    modes: Vec<Mode>,
    /// Blend mode's share of injected tokens recomputed.
    #[arg(long, default_value_t = inferscale_types::DEFAULT_BLEND_RATIO, value_parser = crate::runtime::blend_ratio)]
    blend_ratio: f32,
    /// Facts retrieved per request.
    #[arg(long, default_value_t = 50)]
    k: u32,
    /// Distinct users with memory; clients share them round-robin.
    #[arg(long, default_value_t = 10)]
    memory_users: usize,
    /// Facts each memory user stores (at least k).
    #[arg(long, default_value_t = 50)]
    facts_per_user: usize,
    /// Tokens per fact with the byte-level tokenizer of random-weight shapes.
    #[arg(long, default_value_t = 25)]
    fact_tokens: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// Seconds measured per (mode, users) point, after the warm-up.
    #[arg(long, default_value_t = 20.0)]
    duration_s: f64,
    /// Seconds of unmeasured load before each point.
    #[arg(long, default_value_t = 3.0)]
    warmup_s: f64,
    /// Also measure each point while an ingest of this many new turns (for
    /// another user) runs on the worker (0: idle only).
    #[arg(long, default_value_t = 0)]
    ingest_turns: usize,
    /// Audit shares (0..=1) to measure each point at, in turn on the same
    /// worker (empty: the worker's `--audit-share` for every point).
    #[arg(long, value_delimiter = ',')]
    audit_shares: Vec<f64>,
    /// Times the whole grid of points is measured, one round after another:
    /// the spread between rounds is what a difference between points must
    /// beat.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Write results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    worker: WorkerArgs,
}

#[derive(Serialize, Debug)]
struct Point {
    mode: Mode,
    users: usize,
    /// The round the point was measured in, from 0.
    round: usize,
    /// The worker's audited share during the point, and how many of the
    /// point's requests (warm-up included) were audited and skipped.
    audit_share: f64,
    audited: u64,
    audits_skipped: u64,
    requests: usize,
    errors: usize,
    requests_per_s: f64,
    output_tokens_per_s: f64,
    ttft_ms_p50: f64,
    ttft_ms_p99: f64,
    latency_ms_p50: f64,
    latency_ms_p99: f64,
    /// Time between two tokens of a request, over every measured request.
    itl_ms_p50: f64,
    itl_ms_p99: f64,
    /// Whether an ingest ran during the point, and the turns it stored per
    /// second meanwhile.
    during_ingest: bool,
    ingest_turns_per_s: f64,
    /// Worker-side means over the measured requests.
    worker_retrieve_ms_mean: f64,
    worker_queue_ms_mean: f64,
    worker_inject_ms_mean: f64,
    worker_prefill_ms_mean: f64,
    prompt_tokens_mean: f64,
}

#[derive(Serialize)]
struct Report {
    backend: String,
    model: String,
    k: u32,
    max_tokens: u32,
    memory_users: usize,
    facts_per_user: usize,
    duration_s: f64,
    results: Vec<Point>,
}

/// Quantile `q` of sorted values (nearest rank).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Fact texts for the bench: exact lengths under the byte-level tokenizer.
fn fact_texts(a: &ServeBenchArgs, byte_level: bool) -> Vec<String> {
    let base = synthetic_facts(a.facts_per_user);
    if !byte_level {
        return base;
    }
    // `speaker: text\n` is the fact line; the speaker is "U".
    let len = a.fact_tokens.saturating_sub(4).max(1);
    base.iter().map(|f| f.chars().cycle().take(len).collect()).collect()
}

#[derive(Default)]
struct Sample {
    ttft: Vec<f64>,
    latency: Vec<f64>,
    itl: Vec<f64>,
    retrieve: Vec<f64>,
    queue: Vec<f64>,
    inject: Vec<f64>,
    prefill: Vec<f64>,
    prompt_tokens: Vec<f64>,
    tokens: usize,
    errors: usize,
}

/// What one request measured: TTFT and latency (ms), its tokens, the gaps
/// between them (ms), and the worker's report.
struct Measured {
    ttft: f64,
    latency: f64,
    tokens: u32,
    gaps: Vec<f64>,
    finished: pb::Finished,
}

async fn one_request(
    client: &mut WorkerClient<tonic::transport::Channel>,
    req: pb::GenerateRequest,
) -> std::result::Result<Measured, tonic::Status> {
    let t0 = Instant::now();
    let mut stream = client.generate(req).await?.into_inner();
    let mut ttft = None;
    let (mut tokens, mut gaps, mut last) = (0, Vec::new(), None::<Instant>);
    while let Some(ev) = stream.message().await? {
        match ev.event {
            Some(pb::generate_event::Event::Token(_)) => {
                let now = Instant::now();
                ttft.get_or_insert_with(|| (now - t0).as_secs_f64() * 1e3);
                if let Some(l) = last {
                    gaps.push((now - l).as_secs_f64() * 1e3);
                }
                last = Some(now);
                tokens += 1;
            }
            Some(pb::generate_event::Event::Finished(finished)) => {
                let latency = t0.elapsed().as_secs_f64() * 1e3;
                return Ok(Measured { ttft: ttft.unwrap_or(0.0), latency, tokens, gaps, finished });
            }
            None => {}
        }
    }
    Err(tonic::Status::internal("stream ended without finishing"))
}

/// Ingests `turns` new synthetic turns for `user` in requests of 32, until
/// done or `until`; returns the turns stored and the seconds it took.
async fn ingest_during(addr: String, user: String, turns: usize, until: Instant) -> Result<(usize, f64)> {
    let mut client = WorkerClient::connect(format!("http://{addr}")).await?;
    let texts = synthetic_facts(turns);
    let t0 = Instant::now();
    let mut stored = 0;
    for (b, chunk) in texts.chunks(32).enumerate() {
        if Instant::now() >= until {
            break;
        }
        let units = chunk
            .iter()
            .enumerate()
            .map(|(i, t)| pb::MemoryUnit {
                id: format!("T{}", b * 32 + i),
                speaker: "Ingest".into(),
                text: t.clone(),
                ..Default::default()
            })
            .collect();
        let req = pb::IngestRequest { user: user.clone(), window: None, units, defer_kv: false };
        client.ingest(req).await.with_context(|| format!("ingesting for {user}"))?;
        stored += chunk.len();
    }
    Ok((stored, t0.elapsed().as_secs_f64()))
}

/// One point of the grid: what `measure` runs.
struct PointSpec {
    mode: Mode,
    users: usize,
    round: usize,
    audit_share: f64,
    /// The user an ingest runs for during the point, if one does.
    ingest: Option<String>,
}

/// How long a point waits after its last request for the audits it queued.
const AUDIT_DRAIN: Duration = Duration::from_secs(120);

async fn measure(a: &ServeBenchArgs, addr: &str, worker: &WorkerService, spec: PointSpec) -> Result<Point> {
    let PointSpec { mode, users, round, audit_share, ingest } = spec;
    let audits_before = worker.metrics().audits();
    let pmode = pb::MemoryMode::from(mode);
    let start = Instant::now();
    let from = start + Duration::from_secs_f64(a.warmup_s);
    let until = from + Duration::from_secs_f64(a.duration_s);
    let ingesting = ingest.map(|user| tokio::spawn(ingest_during(addr.to_string(), user, a.ingest_turns, until)));
    let sample = Arc::new(Mutex::new(Sample::default()));
    let mut tasks = Vec::new();
    for i in 0..users {
        let mut client = WorkerClient::connect(format!("http://{addr}")).await?;
        let sample = sample.clone();
        let req = pb::GenerateRequest {
            request_id: String::new(),
            user: format!("bench-{}", i % a.memory_users),
            messages: vec![pb::ChatMessage { role: "user".into(), content: QUESTION.into() }],
            mode: pmode as i32,
            k: a.k,
            window: None,
            sampling: Some(pb::Sampling { max_tokens: a.max_tokens, ignore_eos: true, ..Default::default() }),
            deadline_ms: 600_000,
            blend_ratio: (mode == Mode::Blend).then_some(a.blend_ratio),
            ..Default::default()
        };
        tasks.push(tokio::spawn(async move {
            while Instant::now() < until {
                let r = one_request(&mut client, req.clone()).await;
                let done = Instant::now();
                if done < from || done > until {
                    continue;
                }
                let mut s = sample.lock().await;
                match r {
                    Ok(m) => {
                        s.ttft.push(m.ttft);
                        s.latency.push(m.latency);
                        s.itl.extend(m.gaps);
                        s.tokens += m.tokens as usize;
                        let t = m.finished.timings.unwrap_or_default();
                        s.retrieve.push(t.retrieve_ms);
                        s.queue.push(t.queue_ms);
                        s.inject.push(t.inject_ms);
                        s.prefill.push(t.prefill_ms);
                        s.prompt_tokens.push(m.finished.usage.unwrap_or_default().prompt_tokens.into());
                    }
                    Err(e) => {
                        if s.errors == 0 {
                            eprintln!("inferscale bench serve: request failed: {e}");
                        }
                        s.errors += 1;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let (during_ingest, ingest_turns_per_s) = match ingesting {
        None => (false, 0.0),
        Some(t) => {
            let (stored, secs) = t.await??;
            (true, stored as f64 / secs.max(1e-9))
        }
    };
    // The engine runs queued audits once the clients stop: wait for them,
    // so that this point's audits are counted here and run in no other.
    let t = Instant::now();
    while worker.metrics().audits().waiting > 0 {
        if t.elapsed() > AUDIT_DRAIN {
            bail!("the audits of a point still wait {} s after its last request", AUDIT_DRAIN.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let audits = worker.metrics().audits();
    let mut s = std::mem::take(&mut *sample.lock().await);
    s.ttft.sort_by(f64::total_cmp);
    s.latency.sort_by(f64::total_cmp);
    s.itl.sort_by(f64::total_cmp);
    let n = s.ttft.len();
    let mean = |v: &[f64]| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
    Ok(Point {
        mode,
        users,
        round,
        audit_share,
        audited: audits.audited - audits_before.audited,
        audits_skipped: audits.skipped - audits_before.skipped,
        requests: n,
        errors: s.errors,
        requests_per_s: n as f64 / a.duration_s,
        output_tokens_per_s: s.tokens as f64 / a.duration_s,
        ttft_ms_p50: quantile(&s.ttft, 0.5),
        ttft_ms_p99: quantile(&s.ttft, 0.99),
        latency_ms_p50: quantile(&s.latency, 0.5),
        latency_ms_p99: quantile(&s.latency, 0.99),
        itl_ms_p50: quantile(&s.itl, 0.5),
        itl_ms_p99: quantile(&s.itl, 0.99),
        during_ingest,
        ingest_turns_per_s,
        worker_retrieve_ms_mean: mean(&s.retrieve),
        worker_queue_ms_mean: mean(&s.queue),
        worker_inject_ms_mean: mean(&s.inject),
        worker_prefill_ms_mean: mean(&s.prefill),
        prompt_tokens_mean: mean(&s.prompt_tokens),
    })
}

pub fn run(mut a: ServeBenchArgs) -> Result<()> {
    if a.memory_users == 0 || a.facts_per_user < a.k as usize || a.users.contains(&0) {
        bail!("need --memory-users ≥ 1, --facts-per-user ≥ --k and client counts ≥ 1");
    }
    if !(a.duration_s > 0.0 && a.warmup_s >= 0.0) {
        bail!("--duration-s must be positive and --warmup-s not negative");
    }
    if a.rounds == 0 || a.audit_shares.iter().any(|s| !(0.0..=1.0).contains(s)) {
        bail!("need --rounds ≥ 1 and every --audit-shares value between 0 and 1");
    }
    let mut tmp = None;
    if a.worker.mem.memory.is_none() {
        let dir = tempfile_dir()?;
        a.worker.mem.memory = Some(dir.clone());
        tmp = Some(dir);
    }
    let byte_level = a.worker.mem.model.shape.is_some();
    // Every client asks one question, so a prompt-mode request would find
    // its whole prompt in the prefix cache and measure nothing of the
    // prefill this bench compares kv mode with: off unless asked for.
    a.worker.prefix_cache.get_or_insert(PrefixCache::Off);
    let (service, engine, _) = start_worker(&a.worker)?;
    let rt = runtime()?;
    let report = rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?.to_string();
        tokio::spawn(serve_grpc(listener, service.clone()));
        let mut client = WorkerClient::connect(format!("http://{addr}")).await?;
        let facts = fact_texts(&a, byte_level);
        let t0 = Instant::now();
        let mut ingest = Progress::new("inferscale bench serve: ingest", a.memory_users as u64, "users");
        for u in 0..a.memory_users {
            let units = facts
                .iter()
                .enumerate()
                .map(|(i, f)| pb::MemoryUnit {
                    id: format!("F{i}"),
                    speaker: "U".into(),
                    text: f.clone(),
                    ..Default::default()
                })
                .collect();
            client
                .ingest(pb::IngestRequest { user: format!("bench-{u}"), window: None, units, defer_kv: false })
                .await
                .with_context(|| format!("ingesting the facts of bench-{u}"))?;
            ingest.inc("");
        }
        ingest.finish("");
        eprintln!(
            "inferscale bench serve: {} users × {} facts ingested in {:.1} s",
            a.memory_users,
            a.facts_per_user,
            t0.elapsed().as_secs_f64()
        );
        let mut results = Vec::new();
        let passes: Vec<bool> = if a.ingest_turns > 0 { vec![false, true] } else { vec![false] };
        // None: the share the worker started with, left alone.
        let shares: Vec<Option<f64>> =
            if a.audit_shares.is_empty() { vec![None] } else { a.audit_shares.iter().copied().map(Some).collect() };
        let points = (a.rounds * a.modes.len() * a.users.len() * passes.len() * shares.len()) as u64;
        let mut progress = Progress::new("inferscale bench serve", points, "points");
        for round in 0..a.rounds {
            for &mode in &a.modes {
                for &users in &a.users {
                    for &during in &passes {
                        for &share in &shares {
                            if let Some(s) = share {
                                service.set_audit_share(s)?;
                            }
                            let audit_share = share.unwrap_or(a.worker.audit_share);
                            let what = format!(
                                "{}{}{}",
                                if during { ", during an ingest" } else { "" },
                                if share.is_some() { format!(", audit share {audit_share}") } else { String::new() },
                                if a.rounds > 1 { format!(", round {}", round + 1) } else { String::new() },
                            );
                            progress.set(results.len() as u64, &format!("{mode}, {users} users{what}"));
                            let ingest = during.then(|| format!("bench-ingest-{}", results.len()));
                            let spec = PointSpec { mode, users, round, audit_share, ingest };
                            let p = measure(&a, &addr, &service, spec).await?;
                            eprintln!(
                                "inferscale bench serve: {mode:>6} users {users:>4}{what}: {:.2} req/s, TTFT p50 {:.1} ms p99 {:.1} ms, ITL p50 {:.1} ms p99 {:.1} ms, {} audited",
                                p.requests_per_s, p.ttft_ms_p50, p.ttft_ms_p99, p.itl_ms_p50, p.itl_ms_p99, p.audited
                            );
                            results.push(p);
                        }
                    }
                }
            }
        }
        progress.set(points, "");
        progress.finish("");
        anyhow::Ok(results)
    })?;
    // Dropping the runtime and this handle drops the last of the service;
    // the engine thread then ends and drops its backend (which prints
    // INFERSCALE_CUDA_PROFILE's table).
    drop(rt);
    drop(service);
    let _ = engine.join();
    let model = a.worker.mem.model.shape.clone().unwrap_or_else(|| a.worker.mem.model.model().to_string());
    println!(
        "{:>6} {:>6} {:>8} {:>6} {:>8} {:>9} {:>10} {:>10} {:>10} {:>9} {:>9} {:>11} {:>8} {:>7}",
        "mode",
        "users",
        "ingest",
        "audit",
        "audited",
        "req/s",
        "tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "latency p99",
        "prompt",
        "errors"
    );
    for p in &report {
        let ingest = if p.during_ingest { format!("{:.1}/s", p.ingest_turns_per_s) } else { "-".into() };
        println!(
            "{:>6} {:>6} {:>8} {:>6} {:>8} {:>9.2} {:>10.1} {:>10.1} {:>10.1} {:>9.1} {:>9.1} {:>11.1} {:>8.0} {:>7}",
            p.mode.as_str(),
            p.users,
            ingest,
            p.audit_share,
            p.audited,
            p.requests_per_s,
            p.output_tokens_per_s,
            p.ttft_ms_p50,
            p.ttft_ms_p99,
            p.itl_ms_p50,
            p.itl_ms_p99,
            p.latency_ms_p99,
            p.prompt_tokens_mean,
            p.errors
        );
    }
    if a.rounds > 1 || a.audit_shares.len() > 1 {
        print_by_share(&report);
    }
    if let Some(path) = &a.json {
        let r = Report {
            backend: a.worker.mem.model.backend.clone(),
            model,
            k: a.k,
            max_tokens: a.max_tokens,
            memory_users: a.memory_users,
            facts_per_user: a.facts_per_user,
            duration_s: a.duration_s,
            results: report,
        };
        std::fs::write(path, serde_json::to_string_pretty(&r)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = tmp {
        // The facts and KV written for the run (gigabytes for large shapes).
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    Ok(())
}

/// Per (mode, users, ingest, audit share), over the rounds: the mean
/// requests/s, their range, and the mean over the first share's at the same
/// point — the audit's cost beside the spread between rounds.
fn print_by_share(report: &[Point]) {
    let key = |p: &Point| (p.mode, p.users, p.during_ingest, p.audit_share.to_bits());
    let mut groups: Vec<(&Point, Vec<&Point>)> = Vec::new();
    for p in report {
        match groups.iter_mut().find(|(first, _)| key(first) == key(p)) {
            Some((_, ps)) => ps.push(p),
            None => groups.push((p, vec![p])),
        }
    }
    let mean = |ps: &[&Point]| ps.iter().map(|p| p.requests_per_s).sum::<f64>() / ps.len() as f64;
    println!(
        "\n{:>6} {:>6} {:>8} {:>6} {:>6} {:>9} {:>19} {:>8} {:>8}",
        "mode", "users", "ingest", "audit", "rounds", "req/s", "range", "÷ first", "audited"
    );
    for (p, ps) in &groups {
        // The first share measured at this (mode, users, ingest).
        let base = groups
            .iter()
            .find(|(q, _)| (q.mode, q.users, q.during_ingest) == (p.mode, p.users, p.during_ingest))
            .map_or(f64::NAN, |(_, qs)| mean(qs));
        let (lo, hi) = ps.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), q| {
            (lo.min(q.requests_per_s), hi.max(q.requests_per_s))
        });
        println!(
            "{:>6} {:>6} {:>8} {:>6} {:>6} {:>9.2} {:>19} {:>8.3} {:>8}",
            p.mode.as_str(),
            p.users,
            if p.during_ingest { "yes" } else { "-" },
            p.audit_share,
            ps.len(),
            mean(ps),
            format!("{lo:.2}–{hi:.2}"),
            mean(ps) / base,
            ps.iter().map(|q| q.audited).sum::<u64>(),
        );
    }
}

/// A fresh memory directory under the system's temporary directory.
fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("inferscale-bench-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
