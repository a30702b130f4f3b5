//! `inferscale bench ttft`: time to first token with k memory facts in the
//! design.md §3 layout, in both modes side by side:
//!
//! - `prompt`: the facts are rendered as text and prefilled with the question
//!   after the cached header (the Mem0-style baseline);
//! - `kv`: the facts were encoded once beforehand (after the same header);
//!   their pre-RoPE KV is injected and only the question is prefilled.
//!
//! Each timed run forks the cached header, builds the prompt, prefills and
//! picks the first token; the median over `--reps` runs after one warm-up.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use inferscale_engine::sampling::argmax;
use inferscale_engine::{Backend, Engine, KvChunk};
use serde::Serialize;

use super::median;
use crate::runtime::{ModelArgs, load};
use crate::synthetic::synthetic_facts;
use inferscale_memory::{Composer, SYSTEM_PROMPT};

const QUESTION: &str = "Where did Caroline go camping?";

#[derive(Args, Debug)]
pub struct TtftArgs {
    /// Numbers of facts to measure.
    #[arg(long, value_delimiter = ',', default_value = "5,10,20,50,100")]
    k: Vec<usize>,
    /// Modes to measure.
    #[arg(long, value_delimiter = ',', default_value = "prompt,kv", value_parser = ["prompt", "kv"])]
    modes: Vec<String>,
    /// Timed runs per (k, mode); the median is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Write results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(Serialize)]
struct Report {
    backend: String,
    model: String,
    header_tokens: usize,
    question_tokens: usize,
    mean_fact_tokens: f64,
    results: Vec<Row>,
}

#[derive(Serialize)]
struct Row {
    k: usize,
    mode: &'static str,
    ttft_ms_median: f64,
    prompt_tokens: usize,
    prefilled_tokens: usize,
}

/// One timed run: fork the header, add the memory, prefill, pick a token.
fn first_token<B: Backend>(
    e: &mut Engine<B>,
    header: &inferscale_engine::Sequence,
    facts: &[Vec<u32>],
    chunks: Option<&[KvChunk<B>]>,
    question: &[u32],
) -> Result<f64> {
    let t = Instant::now();
    let mut seq = e.fork(header)?;
    match chunks {
        Some(chunks) => e.inject(&mut seq, &chunks.iter().collect::<Vec<_>>())?,
        None => facts.iter().for_each(|f| seq.extend(f)),
    }
    seq.extend(question);
    let logits = e.prefill(&mut seq)?;
    std::hint::black_box(argmax(&logits));
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

pub fn run(a: TtftArgs) -> Result<()> {
    if a.k.is_empty() || a.reps == 0 {
        bail!("--k needs at least one value and --reps must be positive");
    }
    let mut m = load(&a.model)?;
    let files = &m.files;
    let composer = Composer::new(files, SYSTEM_PROMPT)?;
    let k_max = *a.k.iter().max().context("--k")?;
    let facts: Vec<Vec<u32>> = synthetic_facts(k_max).iter().map(|f| composer.fact(f)).collect::<Result<_, _>>()?;
    let question = composer.question(QUESTION)?;
    let header_tokens = composer.header().to_vec();
    let h = header_tokens.len();
    let e = &mut m.engine;

    eprintln!("inferscale bench ttft: encoding {k_max} facts once (after the header) …");
    let t = Instant::now();
    let chunks: Vec<KvChunk<_>> =
        facts.iter().map(|f| e.encode(&header_tokens, f, h as u32)).collect::<Result<_, _>>()?;
    eprintln!("inferscale bench ttft: encoded in {:.1} s", t.elapsed().as_secs_f64());
    let mut header = e.new_sequence(header_tokens)?;
    e.prefill(&mut header)?;

    let mut results = Vec::new();
    for &k in &a.k {
        let fact_tokens: usize = facts[..k].iter().map(Vec::len).sum();
        for (mode, chunks) in [("prompt", None), ("kv", Some(&chunks[..k]))] {
            if !a.modes.iter().any(|m| m == mode) {
                continue;
            }
            first_token(e, &header, &facts[..k], chunks, &question)?; // warm-up
            let times = (0..a.reps)
                .map(|_| first_token(e, &header, &facts[..k], chunks, &question))
                .collect::<Result<Vec<_>>>()?;
            let prefilled = question.len() + if chunks.is_some() { 0 } else { fact_tokens };
            results.push(Row {
                k,
                mode,
                ttft_ms_median: median(times),
                prompt_tokens: h + fact_tokens + question.len(),
                prefilled_tokens: prefilled,
            });
            eprintln!("inferscale bench ttft: k={k} {mode} done");
        }
    }
    let report = Report {
        backend: a.model.backend.clone(),
        model: files.path.display().to_string(),
        header_tokens: h,
        question_tokens: question.len(),
        mean_fact_tokens: facts.iter().map(Vec::len).sum::<usize>() as f64 / k_max as f64,
        results,
    };
    print_table(&report);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("inferscale bench ttft: wrote {}", path.display());
    }
    Ok(())
}

fn print_table(r: &Report) {
    println!(
        "backend {} · {} · header {} tokens, question {} tokens, facts {:.1} tokens on average",
        r.backend, r.model, r.header_tokens, r.question_tokens, r.mean_fact_tokens
    );
    println!(
        "{:>5} {:>8} {:>15} {:>11} {:>15} {:>11} {:>9}",
        "k", "prompt", "prompt TTFT ms", "prefilled", "kv TTFT ms", "prefilled", "speed-up"
    );
    let cell = |row: Option<&Row>| match row {
        Some(x) => (format!("{:.1}", x.ttft_ms_median), x.prefilled_tokens.to_string()),
        None => ("-".into(), "-".into()),
    };
    let mut ks: Vec<usize> = r.results.iter().map(|x| x.k).collect();
    ks.dedup();
    for k in ks {
        let find = |mode: &str| r.results.iter().find(|x| x.k == k && x.mode == mode);
        let (p, kv) = (find("prompt"), find("kv"));
        let tokens = p.or(kv).map_or(0, |x| x.prompt_tokens);
        let speedup = match (p, kv) {
            (Some(p), Some(kv)) => format!("{:.1}×", p.ttft_ms_median / kv.ttft_ms_median),
            _ => "-".into(),
        };
        let ((pt, pp), (kt, kp)) = (cell(p), cell(kv));
        println!("{k:>5} {tokens:>8} {pt:>15} {pp:>11} {kt:>15} {kp:>11} {speedup:>9}");
    }
}
