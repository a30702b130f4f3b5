//! Load testing an InferScale router over its OpenAI-compatible HTTP API.
//!
//! N closed-loop users (LoCoMo speakers or synthetic users) each ingest
//! their memory once (`POST /v1/memories`), then ask questions with
//! streamed chat completions (`POST /v1/chat/completions`, `stream: true`)
//! in kv or prompt mode with k retrieved facts. Each (mode, k, users) point
//! reports time to first token, end-to-end latency, output tokens/s,
//! requests/s and errors by status ([`report`]); the run is written as JSON
//! and drawn as PNG charts ([`charts`]). `inferscale loadtest` is the
//! command; this crate is the harness so that tests and other tools can
//! drive it too.
//!
//! Measurements are taken at the client, through the router, over HTTP:
//! what a user of the API sees, queueing included — unlike `inferscale
//! bench serve`, which measures one worker in-process behind gRPC.

pub mod charts;
pub mod client;
mod error;
mod report;
mod runner;
pub mod synthetic;
mod users;

use std::time::Duration;

pub use client::Client;
pub use client::FactSources;
pub use error::{Error, Result};
pub use report::{ClassLatency, Point, Report, Target, Tiers};
pub use runner::{Mode, Plan, Population};
pub use users::{Source, User};

/// Everything one run needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The router, `http://host:port` (with or without `/v1`).
    pub url: String,
    pub api_key: Option<String>,
    /// The model to ask for; `None` takes the first of `GET /v1/models`.
    pub model: Option<String>,
    pub source: Source,
    /// User ids are `{prefix}-…`, so runs against one server can keep
    /// their users apart (or share them, and skip re-encoding).
    pub user_prefix: String,
    /// Bound on each whole request.
    pub request_timeout: Duration,
    /// Stored as the report's `target.machine`.
    pub machine: Option<String>,
    pub plan: Plan,
}

/// Runs the whole test: ingest, then every point; `progress` hears one
/// line per phase (for stderr).
pub async fn run(cfg: &Config, progress: &dyn Fn(&str)) -> Result<Report> {
    cfg.plan.validate()?;
    let client = Client::new(&cfg.url, cfg.api_key.as_deref(), cfg.request_timeout)?;
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => client.model().await?,
    };
    let users = users::users(&cfg.source, cfg.plan.max_users(), &cfg.user_prefix)?;
    let turns: usize = users.iter().map(|u| u.turns.len()).sum();
    progress(&format!("ingesting {turns} turns for {} users ({})", users.len(), cfg.source.describe()));
    let ingest = runner::ingest(&client, &users, cfg.plan.window).await?;
    progress(&format!(
        "ingested in {:.1} s: {} units added, {} already stored",
        ingest.seconds, ingest.added, ingest.skipped
    ));
    let plan = &cfg.plan;
    let questions = runner::Questions::default();
    let mut points = Vec::new();
    for &n in &plan.users {
        for &mode in &plan.modes {
            for &k in &plan.ks {
                let p = runner::point(&client, &model, &users, (n, mode, k), plan, &questions).await;
                progress(&format!(
                    "{:>6} k={k:<3} users={n:<3} {} requests, {} errors in {:.1} s; TTFT p50 {:.1} ms, e2e p50 {:.0} ms",
                    p.mode, p.requests, p.errors, p.duration_s, p.ttft_ms.p50, p.e2e_ms.p50
                ));
                points.push(p);
            }
        }
    }
    Ok(Report {
        target: Target {
            url: cfg.url.clone(),
            model,
            source: cfg.source.describe(),
            machine: cfg.machine.clone(),
            requests_per_point: plan.requests,
            duration_s_per_point: plan.duration.as_secs_f64(),
            max_tokens: plan.max_tokens,
            warmup_requests: plan.warmup,
            ignore_eos: plan.ignore_eos,
            population: plan.population,
        },
        date: report::today_utc(),
        ingest,
        points,
    })
}
