//! `inferscale loadtest`: closed-loop load test of a running router over
//! its HTTP API (see `docs/loadtest.md`); the harness is the
//! `inferscale-loadtest` crate, this is its command line.
//!
//! Prints a Markdown table on stdout; progress goes to stderr. Writes the
//! JSON report with `--json` and two PNG charts with `--plots`, named after
//! the JSON file (`{stem}-ttft-vs-k.png`, `{stem}-throughput-vs-users.png`;
//! stem `loadtest` without `--json`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use inferscale_loadtest::{Config, Mode, Plan, Population, Report, Source, charts};

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The router, `http://host:port` (a trailing `/v1` is fine).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Bearer key, when the router has `--api-keys`.
    #[arg(long, env = "INFERSCALE_API_KEY")]
    api_key: Option<String>,
    /// Model to ask for (default: the one `GET /v1/models` lists).
    #[arg(long)]
    model: Option<String>,
    /// Concurrent closed-loop user counts, one point each (with
    /// `--population`: concurrent clients, each asking as any user).
    #[arg(long, value_delimiter = ',', default_value = "1,5,20")]
    users: Vec<usize>,
    /// Store this many distinct users, and let every request of every
    /// client pick its user among them (Zipf law by rank, `--zipf`): many
    /// users, few active at once. Default: each client is one user.
    #[arg(long)]
    population: Option<usize>,
    /// Zipf exponent of user popularity with `--population` (0: uniform).
    #[arg(long, default_value_t = 1.0, requires = "population")]
    zipf: f64,
    /// Facts retrieved per request, one point each.
    #[arg(long, value_delimiter = ',', default_value = "5,20,50")]
    k: Vec<u32>,
    /// Memory modes to measure, one point each (kv, blend, prompt, none).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "kv,prompt")]
    modes: Vec<Mode>,
    /// Measured requests per point, over all its users (the point also
    /// stops at `--duration-s`, whichever comes first).
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Seconds per point, at most (requests in flight then still finish).
    #[arg(long, default_value_t = 30.0)]
    duration_s: f64,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// Unmeasured requests each user sends before each point (kv mode, one
    /// output token: they warm the connection and the retrieval path).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Generate exactly `--max-tokens` tokens (past end of sequence).
    #[arg(long)]
    ignore_eos: bool,
    /// Users are the speakers of this LoCoMo file's samples (cycled past
    /// the last one); default: synthetic users.
    #[arg(long)]
    locomo: Option<PathBuf>,
    /// Ingest only each LoCoMo speaker's first N turns (bounds ingest time).
    #[arg(long, requires = "locomo")]
    max_turns: Option<usize>,
    /// Synthetic users with this many generated facts each.
    #[arg(long, default_value_t = 50, conflicts_with = "locomo")]
    synthetic_facts: usize,
    /// Synthetic users share this many memories round robin (each stored
    /// once), bounding the store when the model's KV per fact is large.
    #[arg(long, conflicts_with = "locomo")]
    memories: Option<usize>,
    /// Encoding window sent with ingests (default: the server's).
    #[arg(long)]
    window: Option<u32>,
    /// User ids start with this; the same prefix against the same server
    /// reuses already-ingested memory.
    #[arg(long, default_value = "lt")]
    user_prefix: String,
    /// Seconds one request may take before it counts as a `timeout` error.
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
    /// Free text about the machine, stored in the report.
    #[arg(long)]
    machine: Option<String>,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the PNG charts into this directory.
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Send nothing: read the `--json` report of an earlier run, print its
    /// table and redraw its charts.
    #[arg(long, requires = "json")]
    replot: bool,
}

fn seconds(s: f64, flag: &str) -> Result<Duration> {
    Duration::try_from_secs_f64(s).with_context(|| format!("{flag} must be a non-negative number of seconds"))
}

pub fn run(a: Args) -> Result<()> {
    if a.replot {
        let path = a.json.as_ref().context("--replot needs --json")?;
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let report: Report = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        println!("{}", report.table());
        return write_plots(a.plots.as_deref(), a.json.as_deref(), &report);
    }
    let source = match &a.locomo {
        Some(path) => Source::Locomo { path: path.clone(), max_turns: a.max_turns },
        None => Source::Synthetic { facts: a.synthetic_facts, memories: a.memories },
    };
    let modes = a.modes.clone();
    let cfg = Config {
        url: a.url,
        api_key: a.api_key,
        model: a.model,
        source,
        user_prefix: a.user_prefix,
        request_timeout: seconds(a.timeout_s, "--timeout-s")?,
        machine: a.machine,
        plan: Plan {
            users: a.users,
            modes,
            ks: a.k,
            requests: a.requests,
            duration: seconds(a.duration_s, "--duration-s")?,
            max_tokens: a.max_tokens,
            warmup: a.warmup,
            ignore_eos: a.ignore_eos,
            window: a.window,
            population: a.population.map(|users| Population { users, zipf: a.zipf }),
        },
    };
    // One thread: the client's work is small next to the server's, and on
    // a shared machine it should take as little CPU from it as it can.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let report = rt.block_on(inferscale_loadtest::run(&cfg, &|line| eprintln!("inferscale loadtest: {line}")))?;
    println!("{}", report.table());
    if let Some(path) = &a.json {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("inferscale loadtest: wrote {}", path.display());
    }
    write_plots(a.plots.as_deref(), a.json.as_deref(), &report)
}

/// The charts into `plots`, named after the JSON file's stem.
fn write_plots(plots: Option<&Path>, json: Option<&Path>, report: &Report) -> Result<()> {
    if let Some(dir) = plots {
        let stem = json.and_then(|p| p.file_stem()).and_then(|s| s.to_str()).unwrap_or("loadtest");
        for p in charts::write(report, dir, stem)? {
            eprintln!("inferscale loadtest: wrote {}", p.display());
        }
    }
    Ok(())
}
