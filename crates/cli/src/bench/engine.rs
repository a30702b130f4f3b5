//! `inferscale bench engine`: prefill and decode throughput next to the rate
//! of a plain large GEMM on the same backend.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use inferscale_engine::sampling::Rng;
use inferscale_engine::{Backend, SamplingParams, Sequence, generate_sequences};
use inferscale_model::{HostTensor, ModelConfig};
use serde::Serialize;

use super::{median, random_prompt};
use crate::runtime::{ModelArgs, load_on, on_backend};

#[derive(Args, Debug)]
pub struct EngineArgs {
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 1000)]
    prompt_tokens: usize,
    /// Decode batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    decode_batch: Vec<usize>,
    /// Tokens generated per sequence in the decode measurement (timed from
    /// the step after the prompts are prefilled: decode steps alone).
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Prompt length of each sequence in the decode measurement.
    #[arg(long, default_value_t = 128)]
    decode_prompt_tokens: usize,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Size n of the reference n×n×n GEMM (run on the benchmarked backend).
    #[arg(long, default_value_t = 2048)]
    gemm_n: usize,
    /// Write results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(Serialize)]
struct EngineReport {
    backend: String,
    model: String,
    /// `auto` (the backend's precision) or `fp8`.
    kv_cache_dtype: String,
    threads: usize,
    gemm: GemmResult,
    prefill: PrefillResult,
    decode: Vec<DecodeResult>,
}

#[derive(Serialize)]
struct GemmResult {
    n: usize,
    gflops_median: f64,
    gflops_best: f64,
}

#[derive(Serialize)]
struct PrefillResult {
    tokens: usize,
    ms_median: f64,
    tokens_per_s: f64,
    gflops: f64,
    fraction_of_gemm: f64,
}

#[derive(Serialize)]
struct DecodeResult {
    batch: usize,
    prompt_tokens: usize,
    new_tokens: usize,
    tokens_per_s: f64,
    ms_per_step: f64,
    /// Each timed repetition's, in order (the spread behind the median).
    ms_per_step_reps: Vec<f64>,
}

/// Useful floating-point work of prefilling `n` tokens (logits for the last
/// one only): linear layers plus causal attention (q·k and p·v).
fn prefill_flops(c: &ModelConfig, n: usize) -> f64 {
    let h = c.hidden_size as f64;
    let per_layer_params =
        h * (c.q_dim() + 2 * c.kv_dim()) as f64 + c.q_dim() as f64 * h + 3.0 * h * c.intermediate_size as f64;
    let n = n as f64;
    let linear = 2.0 * n * per_layer_params * c.num_layers as f64;
    let attention = 2.0 * 2.0 * (c.num_heads * c.head_dim) as f64 * (n * (n + 1.0) / 2.0) * c.num_layers as f64;
    let lm_head = 2.0 * h * c.vocab_size as f64;
    linear + attention + lm_head
}

/// The backend's own n×n×n GEMM (`linear` of n rows by an n×n weight, as
/// prefill's linear layers run), so that prefill's share of it compares
/// like with like on every backend.
fn gemm_rate<B: Backend>(backend: &B, n: usize, reps: usize) -> Result<GemmResult> {
    let x = HostTensor { shape: vec![n, n], data: (0..n * n).map(|i| ((i % 97) as f32 - 48.0) * 0.01).collect() };
    let w = HostTensor { shape: vec![n, n], data: (0..n * n).map(|i| ((i % 89) as f32 - 44.0) * 0.01).collect() };
    let (x, w) = (backend.upload_rows(&x)?, backend.upload(&w)?);
    backend.linear(&x, &w, None)?; // warm-up (and the device's GEMM tuning)
    backend.synchronize()?;
    let mut rates = Vec::new();
    for _ in 0..reps.max(3) {
        let t = Instant::now();
        let _y = backend.linear(&x, &w, None)?;
        backend.synchronize()?;
        rates.push(2.0 * (n as f64).powi(3) / t.elapsed().as_secs_f64() / 1e9);
    }
    let best = rates.iter().copied().fold(0.0, f64::max);
    Ok(GemmResult { n, gflops_median: median(rates), gflops_best: best })
}

pub fn run(a: EngineArgs) -> Result<()> {
    let m = a.model.clone();
    on_backend!(m, run_on(a))
}

/// On any backend: prefill and decode steps as the engine runs them (on a
/// device, each decode step includes its logits' copy to the host and the
/// sampling there, as serving does); the reference GEMM runs on the same
/// backend.
fn run_on<B: Backend>(a: EngineArgs, backend: B) -> Result<()> {
    let threads = rayon::current_num_threads();
    eprintln!("inferscale bench engine: reference GEMM {0}×{0}×{0} on {1} …", a.gemm_n, backend.name());
    let gemm = gemm_rate(&backend, a.gemm_n, a.reps)?;
    let mut m = load_on(&a.model, backend)?;
    let cfg = m.files.config.clone();
    let mut rng = Rng::new(42);

    eprintln!("inferscale bench engine: prefill of {} tokens …", a.prompt_tokens);
    let warm = m.engine.new_sequence(random_prompt(&mut rng, 64, cfg.vocab_size))?;
    let mut warm = warm;
    m.engine.prefill(&mut warm)?;
    drop(warm);
    let mut times = Vec::new();
    for _ in 0..a.reps.max(1) {
        let mut seq = m.engine.new_sequence(random_prompt(&mut rng, a.prompt_tokens, cfg.vocab_size))?;
        let t = Instant::now();
        m.engine.prefill(&mut seq)?;
        times.push(t.elapsed().as_secs_f64());
    }
    let secs = median(times);
    let gflops = prefill_flops(&cfg, a.prompt_tokens) / secs / 1e9;
    let prefill = PrefillResult {
        tokens: a.prompt_tokens,
        ms_median: secs * 1e3,
        tokens_per_s: a.prompt_tokens as f64 / secs,
        gflops,
        fraction_of_gemm: gflops / gemm.gflops_median,
    };

    let mut decode = Vec::new();
    for &batch in &a.decode_batch {
        eprintln!("inferscale bench engine: decode at batch {batch} …");
        // An untimed pass first: a batch size's first steps tune its GEMMs
        // and capture its decode graph, once per process — in the first
        // timed repetition they would weigh on its median when reps ≤ 2.
        let (prompt, vocab) = (a.decode_prompt_tokens, cfg.vocab_size);
        decode_rate(&mut m.engine, &mut rng, batch, prompt, vocab, DECODE_WARMUP_TOKENS.min(a.decode_tokens))?;
        let mut rates = Vec::new();
        for _ in 0..a.reps.max(1) {
            rates.push(decode_rate(&mut m.engine, &mut rng, batch, prompt, vocab, a.decode_tokens)?);
        }
        let ms_per_step_reps = rates.iter().map(|r| batch as f64 / r * 1e3).collect();
        let rate = median(rates);
        decode.push(DecodeResult {
            batch,
            prompt_tokens: a.decode_prompt_tokens,
            new_tokens: a.decode_tokens,
            tokens_per_s: rate,
            ms_per_step: batch as f64 / rate * 1e3,
            ms_per_step_reps,
        });
    }

    let report = EngineReport {
        backend: a.model.backend.clone(),
        model: m.files.path.display().to_string(),
        kv_cache_dtype: a.model.kv_cache_dtype.clone(),
        threads,
        gemm,
        prefill,
        decode,
    };
    print_engine(&report);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("inferscale bench engine: wrote {}", path.display());
    }
    Ok(())
}

/// Tokens of the untimed decode pass before a batch size's timed ones.
const DECODE_WARMUP_TOKENS: usize = 4;

/// Decode throughput (tokens a second, all sequences together) of `batch`
/// fresh sequences of `prompt` random tokens (of a `vocab`-token
/// vocabulary) generating `tokens` each.
fn decode_rate<B: Backend>(
    engine: &mut inferscale_engine::Engine<B>,
    rng: &mut Rng,
    batch: usize,
    prompt: usize,
    vocab: usize,
    tokens: usize,
) -> Result<f64> {
    // Every prompt but its last token first, so that the timed part is
    // decode steps alone, all sequences in lockstep (prefill of many long
    // prompts takes several steps: timed from the first token, early
    // sequences would count their neighbours' prefill).
    let mut seqs = (0..batch)
        .map(|_| engine.new_sequence(random_prompt(rng, prompt, vocab)))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    while seqs.iter().any(|s| s.pending() > 1) {
        let mut budget = engine.max_batch_tokens();
        let take: Vec<usize> = seqs
            .iter()
            .map(|s| {
                let t = (s.pending() - 1).min(budget);
                budget -= t;
                t
            })
            .collect();
        let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
        engine.step_scheduled(&mut refs, &take, &vec![true; take.len()])?;
    }
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(tokens) };
    let t = Instant::now();
    let outs = generate_sequences(engine, None, &[], seqs.into_iter().map(|s| (s, params.clone())).collect(), t)?;
    let span = t.elapsed().as_secs_f64();
    let generated: usize = outs.iter().map(|o| o.tokens.len()).sum();
    Ok(generated as f64 / span)
}

fn print_engine(r: &EngineReport) {
    println!("backend {} · {} threads · {}", r.backend, r.threads, r.model);
    println!(
        "reference GEMM {n}×{n}×{n}: {:.1} GFLOP/s median, {:.1} best",
        r.gemm.gflops_median,
        r.gemm.gflops_best,
        n = r.gemm.n
    );
    println!(
        "prefill {:>5} tokens: {:>8.1} ms  {:>8.1} tokens/s  {:>6.1} GFLOP/s  ({:.0}% of GEMM)",
        r.prefill.tokens,
        r.prefill.ms_median,
        r.prefill.tokens_per_s,
        r.prefill.gflops,
        r.prefill.fraction_of_gemm * 100.0
    );
    for d in &r.decode {
        println!(
            "decode batch {:>3}: {:>8.1} tokens/s  {:>6.1} ms/step  (prompt {}, {} new tokens)",
            d.batch, d.tokens_per_s, d.ms_per_step, d.prompt_tokens, d.new_tokens
        );
    }
}
