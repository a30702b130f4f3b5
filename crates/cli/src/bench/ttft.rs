//! `inferscale bench ttft`: time to first token with k memory facts in the
//! docs/design.md §3 layout, in both modes side by side:
//!
//! - `prompt`: the facts are rendered as text and prefilled with the question
//!   after the cached header (the Mem0-style baseline);
//! - `kv`: the facts were encoded once beforehand (after the same header);
//!   their pre-RoPE KV is injected and only the question is prefilled;
//! - `kv-host`: `kv` with the stored KV in the backend's host tier (pinned
//!   host memory on CUDA, read over the bus while the question prefills);
//! - `blend`: `kv`, then a share of the injected tokens (`--blend-ratio`,
//!   one cell per ratio) recomputed in the question's prefill (kv+blend).
//!
//! Each timed run forks the cached header, builds the prompt, prefills and
//! picks the first token greedily as the worker does for a greedy request
//! (the argmax taken on the device, one id crossing to the host); the clock
//! stops once that id is on the host, so device work is included. Median
//! over `--reps` runs after a warm-up.
//! The injection alone is timed in separate runs (fork, inject, synchronise),
//! so that the TTFT runs keep the overlap a real request has.
//! The cells (k × mode) are measured in rounds, one run of each per round,
//! so that a slow stretch of a shared machine (another tenant's load on the
//! host, a frequency change) falls on every cell alike instead of on the
//! one being measured at the time: the kv/k₀ ratios compare like with like.
//! `--blocked` measures each cell's runs back to back instead.
//! With a real model the facts are synthetic sentences through the chat
//! template; with `--shape … --random-weights` they are random token ids of
//! the lengths given (`--header-tokens`, `--fact-tokens`, `--question-tokens`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use inferscale_engine::sampling::Rng;
use inferscale_engine::{Backend, EncodeItem, Engine, KvChunk, NextToken, Sequence};
use inferscale_loadtest::synthetic::synthetic_facts;
use inferscale_memory::{Composer, Prompts};
use inferscale_model::ModelFiles;
use serde::Serialize;

use super::{median, random_prompt};
use crate::runtime::{ModelArgs, load_on, on_backend};

const QUESTION: &str = "Where did Caroline go camping?";

#[derive(Args, Debug)]
pub struct TtftArgs {
    /// Numbers of facts to measure.
    #[arg(long, value_delimiter = ',', default_value = "5,10,20,50,100")]
    k: Vec<usize>,
    /// Modes to measure.
    #[arg(long, value_delimiter = ',', default_value = "prompt,kv", value_parser = ["prompt", "kv", "kv-host", "blend"])]
    modes: Vec<String>,
    /// Blend ratios measured when the modes include blend.
    #[arg(long, value_delimiter = ',', default_values_t = [inferscale_types::DEFAULT_BLEND_RATIO],
          value_parser = crate::runtime::blend_ratio)]
    blend_ratio: Vec<f32>,
    /// How blend picks the tokens it recomputes (`deviation`, `question`,
    /// `fact_starts`).
    #[arg(long, default_value_t = inferscale_types::BlendSelect::default())]
    blend_select: inferscale_types::BlendSelect,
    /// Timed runs per (k, mode); the median is reported.
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Header tokens, with random weights.
    #[arg(long, default_value_t = 50)]
    header_tokens: usize,
    /// Tokens per fact, with random weights.
    #[arg(long, default_value_t = 25)]
    fact_tokens: usize,
    /// Question tokens, with random weights.
    #[arg(long, default_value_t = 20)]
    question_tokens: usize,
    /// Write results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run each cell's timed runs back to back (with a CUDA profile phase
    /// per cell) instead of interleaving the cells run by run.
    #[arg(long)]
    blocked: bool,
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
    reps: usize,
    results: Vec<Row>,
}

#[derive(Serialize)]
struct Row {
    k: usize,
    mode: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    blend_ratio: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    blend_select: Option<&'static str>,
    ttft_ms_median: f64,
    ttft_ms_min: f64,
    prompt_tokens: usize,
    prefilled_tokens: usize,
    /// blend: injected tokens recomputed through every layer (all of them
    /// also ran through the first layers).
    #[serde(skip_serializing_if = "Option::is_none")]
    recomputed_tokens: Option<usize>,
    /// kv mode: the injection call alone (median ms) and the bytes it moves
    /// (K and V of every layer, read once and written once).
    inject_ms_median: Option<f64>,
    inject_bytes: Option<usize>,
}

/// One (k, mode) cell of the table, with the stored KV it injects (none in
/// prompt mode).
struct Cell<'a, B: Backend> {
    k: usize,
    mode: &'static str,
    chunks: Option<&'a [KvChunk<B>]>,
    blend_ratio: Option<f32>,
    blend_select: inferscale_types::BlendSelect,
}

/// The prompt pieces, as token ids.
struct Layout {
    header: Vec<u32>,
    facts: Vec<Vec<u32>>,
    question: Vec<u32>,
}

fn layout(files: &ModelFiles, a: &TtftArgs, k_max: usize) -> Result<Layout> {
    // Random-weight shapes carry a stand-in byte tokenizer, whose text
    // would be several times the token counts: ids instead.
    if a.model.shape.is_none() {
        let composer = Composer::new(files, &Prompts::default())?;
        let facts = synthetic_facts(k_max).iter().map(|f| composer.fact(f)).collect::<Result<_, _>>()?;
        return Ok(Layout { header: composer.header().to_vec(), facts, question: composer.question(QUESTION)? });
    }
    let vocab = files.config.vocab_size;
    let mut rng = Rng::new(7);
    let mut ids = |n: usize| random_prompt(&mut rng, n, vocab);
    let header = ids(a.header_tokens);
    let facts = (0..k_max).map(|_| ids(a.fact_tokens)).collect();
    Ok(Layout { header, facts, question: ids(a.question_tokens) })
}

/// One timed run: fork the header, add the memory, prefill, pick a token.
/// Returns the TTFT in ms and the tokens a blend recomputed.
fn first_token<B: Backend>(
    e: &mut Engine<B>,
    header: &Sequence,
    facts: &[Vec<u32>],
    c: &Cell<'_, B>,
    question: &[u32],
) -> Result<(f64, usize)> {
    e.backend().synchronize()?;
    let t = Instant::now();
    let mut seq = e.fork(header)?;
    match c.chunks {
        Some(chunks) => e.inject(&mut seq, &chunks.iter().collect::<Vec<_>>())?,
        None => facts.iter().for_each(|f| seq.extend(f)),
    }
    seq.extend(question);
    if let Some(r) = c.blend_ratio {
        let injected = c.chunks.map_or(0, |cs| cs.iter().map(KvChunk::len).sum());
        let blend = inferscale_types::Blend { ratio: r, select: c.blend_select, ..Default::default() };
        e.blend(&mut seq, injected, blend)?;
    }
    std::hint::black_box(prefill_greedy(e, &mut seq)?);
    Ok((t.elapsed().as_secs_f64() * 1e3, seq.recomputed()))
}

/// Prefills `seq`'s pending tokens (in chunks of the engine's batch limit)
/// and returns its first token by greedy argmax, through the worker's path
/// (`Engine::step_scheduled`): on a device backend only the id crosses to the host.
fn prefill_greedy<B: Backend>(e: &mut Engine<B>, seq: &mut Sequence) -> Result<u32> {
    loop {
        let take = seq.pending().min(e.max_batch_tokens());
        let next = e.step_scheduled(&mut [&mut *seq], &[take], &[true])?;
        if seq.pending() == 0 {
            return match next.into_iter().next().flatten() {
                Some(NextToken::Greedy(id)) => Ok(id),
                _ => bail!("the prefill's last step returned no greedy token"),
            };
        }
    }
}

/// The injection call alone, host-timed until the device is done (ms).
fn inject_alone<B: Backend>(e: &mut Engine<B>, header: &Sequence, chunks: &[KvChunk<B>]) -> Result<f64> {
    e.backend().synchronize()?;
    let t = Instant::now();
    let mut seq = e.fork(header)?;
    e.inject(&mut seq, &chunks.iter().collect::<Vec<_>>())?;
    e.backend().synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

pub fn run(a: TtftArgs) -> Result<()> {
    if a.k.is_empty() || a.reps == 0 {
        bail!("--k needs at least one value and --reps must be positive");
    }
    let m = a.model.clone();
    on_backend!(m, run_on(a))
}

fn run_on<B: Backend>(a: TtftArgs, backend: B) -> Result<()> {
    let mut m = load_on(&a.model, backend)?;
    let files = &m.files;
    let k_max = *a.k.iter().max().context("--k")?;
    let l = layout(files, &a, k_max)?;
    let h = l.header.len();
    let c = &files.config;
    let kv_bytes_per_token = 2 * c.num_layers * c.kv_dim() * m.engine.backend().kv_bytes_per_value();
    let e = &mut m.engine;

    eprintln!("inferscale bench ttft: encoding {k_max} facts once (after the header) …");
    let t = Instant::now();
    let items: Vec<EncodeItem<'_>> =
        l.facts.iter().map(|f| EncodeItem { context: &l.header, fact: f, fact_position: h as u32 }).collect();
    let chunks: Vec<KvChunk<B>> = e.encode_batch(&items)?;
    e.backend().synchronize()?;
    eprintln!("inferscale bench ttft: encoded in {:.2} s", t.elapsed().as_secs_f64());
    let hosted: Vec<KvChunk<B>> = if a.modes.iter().any(|m| m == "kv-host") {
        let be = e.backend();
        chunks
            .iter()
            .map(|c| {
                let (k, v) = c.to_host(be)?;
                Ok(KvChunk::from_host_tier(be, c.tokens.clone(), &k, &v)?)
            })
            .collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    let mut header = e.new_sequence(l.header.clone())?;
    e.prefill(&mut header)?;

    // The cells to measure, each with its stored KV (None: prompt mode).
    let blend = a.modes.iter().any(|m| m == "blend");
    let mut cells: Vec<Cell<'_, B>> = Vec::new();
    for &k in &a.k {
        for (mode, stored) in [("prompt", None), ("kv", Some(&chunks[..k])), ("kv-host", hosted.get(..k))] {
            if a.modes.iter().any(|m| m == mode) {
                cells.push(Cell { k, mode, chunks: stored, blend_ratio: None, blend_select: a.blend_select });
            }
        }
        for &r in a.blend_ratio.iter().filter(|_| blend) {
            cells.push(Cell {
                k,
                mode: "blend",
                chunks: Some(&chunks[..k]),
                blend_ratio: Some(r),
                blend_select: a.blend_select,
            });
        }
    }
    let mut ttft: Vec<Vec<f64>> = vec![Vec::with_capacity(a.reps); cells.len()];
    let mut inject: Vec<Vec<f64>> = vec![Vec::with_capacity(a.reps); cells.len()];
    let mut recomputed = vec![0; cells.len()];
    let warm_up = |e: &mut Engine<B>, c: &Cell<'_, B>| -> Result<()> {
        for _ in 0..2 {
            first_token(e, &header, &l.facts[..c.k], c, &l.question)?;
        }
        Ok(())
    };
    let mut measure = |e: &mut Engine<B>, i: usize, c: &Cell<'_, B>| -> Result<()> {
        let (ms, n) = first_token(e, &header, &l.facts[..c.k], c, &l.question)?;
        ttft[i].push(ms);
        recomputed[i] = n;
        if let Some(chunks) = c.chunks.filter(|_| c.blend_ratio.is_none()) {
            inject[i].push(inject_alone(e, &header, chunks)?);
        }
        Ok(())
    };
    if a.blocked {
        for (i, c) in cells.iter().enumerate() {
            e.backend().profile_phase(&format!("k={} {}: warm-up", c.k, c.mode));
            warm_up(e, c)?;
            e.backend().profile_phase(&format!("k={} {}: {} timed requests and injections", c.k, c.mode, a.reps));
            for _ in 0..a.reps {
                measure(e, i, c)?;
            }
            eprintln!("inferscale bench ttft: k={} {} done", c.k, c.mode);
        }
    } else {
        e.backend().profile_phase("warm-up");
        for c in &cells {
            warm_up(e, c)?;
        }
        e.backend().profile_phase(&format!("{} rounds of timed requests and injections, cells interleaved", a.reps));
        for rep in 0..a.reps {
            for (i, c) in cells.iter().enumerate() {
                measure(e, i, c)?;
            }
            if (rep + 1) % 5 == 0 || rep + 1 == a.reps {
                eprintln!("inferscale bench ttft: round {}/{} done", rep + 1, a.reps);
            }
        }
    }
    e.backend().profile_phase("done");
    let results = cells
        .iter()
        .zip(ttft)
        .zip(inject)
        .zip(recomputed)
        .map(|(((c, ttft), inject), recomputed)| {
            let fact_tokens: usize = l.facts[..c.k].iter().map(Vec::len).sum();
            let injection = c.chunks.filter(|_| c.blend_ratio.is_none());
            Row {
                k: c.k,
                mode: c.mode,
                blend_ratio: c.blend_ratio,
                blend_select: c.blend_ratio.map(|_| c.blend_select.as_str()),
                ttft_ms_min: ttft.iter().copied().fold(f64::INFINITY, f64::min),
                ttft_ms_median: median(ttft),
                prompt_tokens: h + fact_tokens + l.question.len(),
                prefilled_tokens: l.question.len() + if c.chunks.is_some() { 0 } else { fact_tokens },
                recomputed_tokens: c.blend_ratio.map(|_| recomputed),
                inject_ms_median: injection.map(|_| median(inject)),
                inject_bytes: injection.map(|_| 2 * fact_tokens * kv_bytes_per_token),
            }
        })
        .collect();
    let report = Report {
        backend: a.model.backend.clone(),
        model: files.path.display().to_string(),
        header_tokens: h,
        question_tokens: l.question.len(),
        mean_fact_tokens: l.facts.iter().map(Vec::len).sum::<usize>() as f64 / k_max as f64,
        reps: a.reps,
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
        "backend {} · {} · header {} tokens, question {} tokens, facts {:.1} tokens on average · median of {}",
        r.backend, r.model, r.header_tokens, r.question_tokens, r.mean_fact_tokens, r.reps
    );
    let host_tier = r.results.iter().any(|x| x.mode == "kv-host");
    print!(
        "{:>5} {:>8} {:>15} {:>11} {:>15} {:>11} {:>9} {:>10} {:>8} {:>8}",
        "k",
        "prompt",
        "prompt TTFT ms",
        "prefilled",
        "kv TTFT ms",
        "prefilled",
        "speed-up",
        "inject ms",
        "GB/s",
        "kv/k₀"
    );
    if host_tier {
        print!(" {:>16} {:>14}", "kv-host TTFT ms", "host − kv ms");
    }
    let mut ratios: Vec<f32> = Vec::new();
    for r in r.results.iter().filter_map(|x| x.blend_ratio) {
        if !ratios.contains(&r) {
            ratios.push(r);
        }
    }
    for b in &ratios {
        print!(" {:>16} {:>11} {:>9}", format!("blend {b} ms"), "recomputed", "÷prompt");
    }
    println!();
    let cell = |row: Option<&Row>| match row {
        Some(x) => (format!("{:.2}", x.ttft_ms_median), x.prefilled_tokens.to_string()),
        None => ("-".into(), "-".into()),
    };
    let mut ks: Vec<usize> = r.results.iter().map(|x| x.k).collect();
    ks.dedup();
    let kv0 = r.results.iter().find(|x| x.mode == "kv").map(|x| x.ttft_ms_median);
    for k in ks {
        let find = |mode: &str| r.results.iter().find(|x| x.k == k && x.mode == mode);
        let (p, kv, kvh) = (find("prompt"), find("kv"), find("kv-host"));
        let tokens = p.or(kv).or(kvh).map_or(0, |x| x.prompt_tokens);
        let speedup = match (p, kv) {
            (Some(p), Some(kv)) => format!("{:.1}×", p.ttft_ms_median / kv.ttft_ms_median),
            _ => "-".into(),
        };
        let (inject, rate, ratio) = match (kv, kv0) {
            (Some(x), Some(k0)) => {
                let ms = x.inject_ms_median.unwrap_or(0.0);
                let gbs = x.inject_bytes.unwrap_or(0) as f64 / (ms * 1e-3) / 1e9;
                (format!("{ms:.3}"), format!("{gbs:.0}"), format!("{:.3}", x.ttft_ms_median / k0))
            }
            _ => ("-".into(), "-".into(), "-".into()),
        };
        let ((pt, pp), (kt, kp)) = (cell(p), cell(kv));
        print!("{k:>5} {tokens:>8} {pt:>15} {pp:>11} {kt:>15} {kp:>11} {speedup:>9} {inject:>10} {rate:>8} {ratio:>8}");
        if host_tier {
            let (ht, _) = cell(kvh);
            let extra = match (kvh, kv) {
                (Some(h), Some(d)) => format!("{:+.2}", h.ttft_ms_median - d.ttft_ms_median),
                _ => "-".into(),
            };
            print!(" {ht:>16} {extra:>14}");
        }
        for &b in &ratios {
            match r.results.iter().find(|x| x.k == k && x.blend_ratio == Some(b)) {
                Some(x) => {
                    let share = p.map_or("-".into(), |p| format!("{:.3}", x.ttft_ms_median / p.ttft_ms_median));
                    let n = x.recomputed_tokens.unwrap_or(0);
                    print!(" {:>16.2} {n:>11} {share:>9}", x.ttft_ms_median);
                }
                None => print!(" {:>16} {:>11} {:>9}", "-", "-", "-"),
            }
        }
        println!();
    }
}
