//! `inferscale bench store`: the tiered KV store. Per segment format, a
//! memory of `--users` users × `--facts` facts is ingested, closed and
//! reopened (open time, against the KV bytes on disk), then each user
//! makes a request of `--k` facts: the first reads them from disk (a miss),
//! the same again finds them cached (a hit). Side by side per format:
//! bytes on disk, open time, a request's disk read, a hit.
//!
//! Then the memory is reopened as a server opens it (`lazy_users`: users
//! listed, each read when first used): its open time, the first request's
//! facts (that user read, its k facts read from disk) and the idle-time
//! reading of every other user — what a restart of a node of many users
//! costs before its first answer, beside the eager open.
//!
//! The disk reads go through the page cache, which holds the segments just
//! written: the miss column is then a read of records from memory plus
//! their checks, decode and caching, a lower bound on a cold NVMe read.
//! `--drop-caches` (root) empties the page cache before the memory is
//! reopened, so that the misses read the disk.
//!
//! Last, each of the `--users` users forgets one fact (its middle one) in
//! the memory reopened: the forget's time, most of it the KV record's
//! erasure and the fact log's rewrite, both synced (`--window` 0 erases
//! one record; a window also erases the KV of the facts whose window held
//! the forgotten one).
//!
//! KV read from disk goes to the host tier on a backend that has one (the
//! device otherwise; `cache.rs`), shown in the `cached in` column. In a
//! lossless format (the backend's own values or wider) the KV read back
//! must equal, bit for bit, the KV its encoding left cached: the bench
//! checks that for each user's first requested fact.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use inferscale_engine::bert::Bert;
use inferscale_engine::{Backend, Engine};
use inferscale_loadtest::synthetic::synthetic_facts;
use inferscale_memory::{Composer, Encoders, KvFormat, Memory, MemoryUnit, Prompts, ShardSpec, StoreOptions};
use inferscale_model::HostTensor;
use serde::Serialize;

use super::median;
use crate::runtime::{ModelArgs, load_on, on_backend};

#[derive(Args, Debug)]
pub struct StoreBenchArgs {
    /// Users in the memory.
    #[arg(long, default_value_t = 8)]
    users: usize,
    /// Facts per user.
    #[arg(long, default_value_t = 200)]
    facts: usize,
    /// Facts per request.
    #[arg(long, default_value_t = 20)]
    k: usize,
    /// Copies of each ingested user added before reopening (`--users` ×
    /// `--copies` users in all): a user's files name none of its ids, so a
    /// copied directory is another user with the same facts — a store of
    /// thousands of users for the restart columns without encoding each.
    #[arg(long, default_value_t = 1)]
    copies: usize,
    /// Keep only each synthetic fact's first N words (0: whole, ≈ 126
    /// tokens): small facts make a store of many users quick to build when
    /// what is measured is its open and restart.
    #[arg(long, default_value_t = 0)]
    fact_words: usize,
    /// Segment formats compared.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16,fp8")]
    formats: Vec<KvFormat>,
    /// Context window the facts are encoded with.
    #[arg(long, default_value_t = 0)]
    window: usize,
    /// Empty the page cache (writes /proc/sys/vm/drop_caches; needs root)
    /// before reopening, so that misses read the disk.
    #[arg(long)]
    drop_caches: bool,
    /// Directory for the memories (default: a temporary one, removed).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(Serialize, Debug)]
struct Row {
    format: String,
    facts: usize,
    kv_disk_mb: f64,
    ingest_s: f64,
    open_ms: f64,
    miss_ms_median: f64,
    miss_mb_per_s: f64,
    hit_ms_median: f64,
    /// Where the facts read from disk were cached.
    cached_in: String,
    /// Whether read-back KV was checked bit for bit against the encoding's.
    checked_exact: bool,
    /// Reopened lazily: the open, the first request's k facts (its user
    /// read, the facts read from disk), and reading every other user in
    /// idle-time slices afterwards.
    lazy_open_ms: f64,
    lazy_first_request_ms: f64,
    lazy_read_all_s: f64,
    /// One fact forgotten per user, in the memory reopened.
    forget_ms_median: f64,
}

pub fn run(a: StoreBenchArgs) -> Result<()> {
    on_backend!(a.model, run_on(&a))
}

/// The k facts user `u` asks for, spread over its facts, starting at fact
/// `u` (another set per user).
fn request(a: &StoreBenchArgs, u: usize) -> Vec<usize> {
    let step = a.facts / a.k;
    (0..a.k).map(|j| (j * step + u) % a.facts).collect()
}

fn run_on<B: Backend>(a: &StoreBenchArgs, backend: B) -> Result<()> {
    if a.users == 0 || a.copies == 0 || a.facts == 0 || a.k == 0 || a.k > a.facts || a.formats.is_empty() {
        bail!("--users, --copies, --facts, --k (at most --facts) and --formats must be positive");
    }
    let all_users = a.users * a.copies;
    let tmp = tempfile::tempdir()?;
    let root = a.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let loaded = load_on(&a.model, backend)?;
    let mut e = loaded.engine;
    let embedder = Bert::load(e.backend(), inferscale_model::encoder::open("random")?)?;
    let prompts = Prompts::default();
    let composer = Composer::new(&loaded.files, &prompts)?;
    let spec = ShardSpec::new(&loaded.files, a.window, &prompts)?;
    let units: Vec<MemoryUnit> = synthetic_facts(a.facts)
        .into_iter()
        .enumerate()
        .map(|(i, text)| {
            let text = match a.fact_words {
                0 => text,
                n => text.split_whitespace().take(n).collect::<Vec<_>>().join(" "),
            };
            MemoryUnit { id: format!("f{i}"), text, ..Default::default() }
        })
        .collect();
    let mut rows = Vec::new();
    println!(
        "{} on {} · {} users × {} facts · k = {} · window {}{}",
        a.model.shape.as_deref().unwrap_or(a.model.model()),
        e.backend().name(),
        all_users,
        a.facts,
        a.k,
        a.window,
        if a.drop_caches { " · page cache dropped before reopening" } else { "" }
    );
    println!(
        "| format | KV on disk MB | ingest s | open ms | miss: k facts from disk, ms | MB/s | hit ms | cached in | read back \
         | lazy open ms | its first request ms | every user read s | forget ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &format in &a.formats {
        let dir = root.join(format.name());
        let options = StoreOptions { format: Some(format), ..StoreOptions::default() };
        let (mut memory, _) = Memory::open_with(&dir, spec.clone(), &e, options)?;
        let t0 = Instant::now();
        for u in 0..a.users {
            let mut enc = Encoders { engine: &mut e, embedder: &embedder, composer: &composer };
            for batch in units.chunks(64) {
                memory.ingest(&format!("user{u}"), batch, &mut enc)?;
            }
        }
        e.backend().synchronize()?;
        let ingest_s = t0.elapsed().as_secs_f64();
        let disk = memory.footprint().disk_bytes;
        // Each user's first requested fact as its encoding left it cached.
        let lossless = format.bytes_per_value() >= e.backend().kv_bytes_per_value();
        let encoded = match lossless {
            true => (0..a.users).map(|u| first_fact(&memory, &e, u, request(a, u)[0])).collect::<Result<Vec<_>>>()?,
            false => Vec::new(),
        };
        drop(memory);
        copy_users(&dir, a)?;
        let disk = disk * a.copies as u64;
        if a.drop_caches {
            drop_page_cache()?;
        }

        let t0 = Instant::now();
        let (mut memory, warnings) = Memory::open_with(&dir, spec.clone(), &e, options)?;
        let open_ms = t0.elapsed().as_secs_f64() * 1e3;
        if !warnings.is_empty() {
            bail!("reopening {}: {warnings:?}", dir.display());
        }
        let (mut misses, mut hits, mut loaded_bytes, mut miss_s) = (Vec::new(), Vec::new(), 0u64, 0.0);
        for u in 0..all_users {
            let user = format!("user{u}");
            let idxs = request(a, u);
            let t0 = Instant::now();
            let got = memory.fetch(e.backend(), &user, &idxs)?;
            e.backend().synchronize()?;
            let t = t0.elapsed().as_secs_f64();
            if !got.missing.is_empty() || got.report.loaded != a.k {
                bail!("{user}: {} of {} facts read from disk", got.report.loaded, a.k);
            }
            misses.push(t * 1e3);
            miss_s += t;
            loaded_bytes += got.report.loaded_bytes;
            drop(got);
            let t0 = Instant::now();
            let got = memory.fetch(e.backend(), &user, &idxs)?;
            hits.push(t0.elapsed().as_secs_f64() * 1e3);
            if got.report.device_hits + got.report.host_hits != a.k {
                bail!("{user}: {} of {} facts found cached", got.report.device_hits + got.report.host_hits, a.k);
            }
        }
        for (u, want) in encoded.iter().enumerate() {
            if &first_fact(&memory, &e, u, request(a, u)[0])? != want {
                bail!("{format}: user{u}'s fact read back differs from its encoding");
            }
        }
        let tier = memory.tier("user0", request(a, 0)[0])?;
        drop(memory);
        let (lazy_open_ms, lazy_first_request_ms, lazy_read_all_s) = restart(a, &dir, &spec, options, &e)?;
        let forget_ms_median = forgets(a, &dir, &spec, options, &e)?;
        let row = Row {
            format: format.name().to_string(),
            facts: all_users * a.facts,
            kv_disk_mb: disk as f64 / 1e6,
            ingest_s,
            open_ms,
            miss_ms_median: median(misses),
            miss_mb_per_s: loaded_bytes as f64 / 1e6 / miss_s,
            hit_ms_median: median(hits),
            cached_in: tier.map_or("–".to_string(), |t| format!("{t:?}").to_lowercase()),
            checked_exact: lossless,
            lazy_open_ms,
            lazy_first_request_ms,
            lazy_read_all_s,
            forget_ms_median,
        };
        println!(
            "| {} | {:.0} | {:.1} | {:.1} | {:.2} | {:.0} | {:.3} | {} | {} | {:.1} | {:.2} | {:.2} | {:.2} |",
            row.format,
            row.kv_disk_mb,
            row.ingest_s,
            row.open_ms,
            row.miss_ms_median,
            row.miss_mb_per_s,
            row.hit_ms_median,
            row.cached_in,
            if lossless { "= encoded, bit for bit" } else { "(lossy format)" },
            row.lazy_open_ms,
            row.lazy_first_request_ms,
            row.lazy_read_all_s,
            row.forget_ms_median,
        );
        rows.push(row);
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&rows)?)?;
    }
    Ok(())
}

/// Adds `--copies` − 1 copies of each of the `--users` users of the memory
/// at `dir` (closed): user `u`'s copy `c` is user `u + c × users`.
fn copy_users(dir: &std::path::Path, a: &StoreBenchArgs) -> Result<()> {
    let hex = |u: usize| inferscale_memory::user_dir_name(&format!("user{u}"));
    let users = dir.join("users");
    for c in 1..a.copies {
        for u in 0..a.users {
            let (from, to) = (users.join(hex(u)), users.join(hex(u + c * a.users)));
            std::fs::create_dir(&to)?;
            for f in std::fs::read_dir(&from)? {
                let f = f?;
                std::fs::copy(f.path(), to.join(f.file_name()))?;
            }
        }
    }
    Ok(())
}

/// The memory at `dir` reopened as a server opens it (page cache dropped
/// first with `--drop-caches`): the open's time, then from the open's end
/// the first request's k facts of the middle user (reading that user and
/// the facts), then every other user read in the engine's idle-time slices.
fn restart<B: Backend>(
    a: &StoreBenchArgs,
    dir: &std::path::Path,
    spec: &ShardSpec,
    options: StoreOptions,
    e: &Engine<B>,
) -> Result<(f64, f64, f64)> {
    if a.drop_caches {
        drop_page_cache()?;
    }
    let t0 = Instant::now();
    let lazy = StoreOptions { lazy_users: true, ..options };
    let (mut memory, warnings) = Memory::open_with(dir, spec.clone(), e, lazy)?;
    let open_ms = t0.elapsed().as_secs_f64() * 1e3;
    if !warnings.is_empty() {
        bail!("reopening {} lazily: {warnings:?}", dir.display());
    }
    let (all_users, u) = (a.users * a.copies, a.users * a.copies / 2);
    let t0 = Instant::now();
    let got = memory.fetch(e.backend(), &format!("user{u}"), &request(a, u))?;
    e.backend().synchronize()?;
    let first_ms = t0.elapsed().as_secs_f64() * 1e3;
    if got.report.loaded != a.k {
        bail!("user{u}: {} of {} facts read from disk after the lazy reopen", got.report.loaded, a.k);
    }
    drop(got);
    let t0 = Instant::now();
    while memory.open_some(8) > 0 {}
    let all_s = t0.elapsed().as_secs_f64();
    if memory.users().count() != all_users || memory.fact_count() != all_users * a.facts {
        bail!("after reading every user: {} users, {} facts", memory.users().count(), memory.fact_count());
    }
    Ok((open_ms, first_ms, all_s))
}

/// The median time of one forgotten fact (the middle one) per ingested
/// user, in the memory at `dir` reopened.
fn forgets<B: Backend>(
    a: &StoreBenchArgs,
    dir: &std::path::Path,
    spec: &ShardSpec,
    options: StoreOptions,
    e: &Engine<B>,
) -> Result<f64> {
    let (mut memory, _) = Memory::open_with(dir, spec.clone(), e, options)?;
    let id = format!("f{}", a.facts / 2);
    let mut times = Vec::with_capacity(a.users);
    for u in 0..a.users {
        let user = format!("user{u}");
        let t0 = Instant::now();
        memory.forget(&user, Some(&id))?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        if memory.fact_index(&user, &id)?.is_some() {
            bail!("{user} still has {id} after forgetting it");
        }
    }
    Ok(median(times))
}

type HostKv = (Vec<HostTensor>, Vec<HostTensor>);

/// User `u`'s fact `i` as cached now.
fn first_fact<B: Backend>(memory: &Memory<B>, e: &Engine<B>, u: usize, i: usize) -> Result<HostKv> {
    let user = format!("user{u}");
    match memory.kv(&user, i)? {
        Some(c) => Ok(c.to_host(e.backend())?),
        None => bail!("{user}'s fact {i} is not cached"),
    }
}

/// Writes back dirty pages and empties the page cache, so that the next
/// reads come from the disk.
fn drop_page_cache() -> Result<()> {
    std::process::Command::new("sync").status()?;
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .map_err(|e| anyhow::anyhow!("--drop-caches: writing /proc/sys/vm/drop_caches: {e} (it needs root)"))
}
