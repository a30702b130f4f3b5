//! `inferscale check`: verifies a device backend against the CPU reference
//! on this machine — every backend op on random data, then small models of
//! each supported shape (logits against the CPU backend, and E1–E4 on the
//! device, the fp8 paged cache's kernels among them) — and, with `--model`,
//! a real model: E1–E4, greedy decoding against the CPU, every stored KV
//! format's answers against the KV as computed (the format gate,
//! `inferscale_memory::fidelity`) and the fp8 paged cache's against the
//! bf16 cache's. Run it on a
//! GPU node before serving from it; it exits non-zero when any comparison
//! misses its tolerance. `--backend cpu` runs the format gate and the fp8
//! paged cache's (`--kv-cache-dtype fp8` against the f32 cache, the same
//! prompts and tolerance) on the CPU alone (there is no device to compare).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args as ClapArgs;
use inferscale_memory::fidelity;
use inferscale_memory::{KvFormat, KvHeader};

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The backend to check: `cuda` (against the CPU), or `cpu` for the
    /// stored-format gate alone (needs `--model`).
    #[arg(long, default_value = "cuda")]
    backend: String,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Write the comparisons as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also check a real model (a GGUF file, an HF directory or a packaged
    /// model name): its logits against the CPU's and E1–E4 on the device,
    /// then greedy decoding on both backends for the prompts of `--golden`.
    #[arg(long, requires = "golden")]
    model: Option<String>,
    /// Golden file with the prompts' token ids (tests/golden/smollm2.json).
    #[arg(long, requires = "model")]
    golden: Option<PathBuf>,
}

/// `(name, input ids, steps)` of every case in a golden file made by
/// tests/golden/make_golden.py.
fn golden_cases(path: &std::path::Path) -> Result<Vec<(String, Vec<u32>, usize)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let cases = doc["cases"].as_array().with_context(|| format!("{}: no `cases` array", path.display()))?;
    cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let field = |f: &str| format!("{}: cases[{i}].{f}", path.display());
            let name = c["name"].as_str().with_context(|| field("name"))?.to_string();
            let ids = c["input_ids"]
                .as_array()
                .with_context(|| field("input_ids"))?
                .iter()
                .map(|v| v.as_u64().map(|x| x as u32).with_context(|| field("input_ids")))
                .collect::<Result<Vec<u32>>>()?;
            let steps = c["steps"].as_array().with_context(|| field("steps"))?.len();
            Ok((name, ids, steps))
        })
        .collect()
}

pub fn run(a: Args) -> Result<()> {
    match a.backend.as_str() {
        "cpu" => cpu_formats(&a),
        "cuda" => device(&a),
        other => bail!("--backend {other}: choose cuda or cpu"),
    }
}

/// The stored-format gate on the CPU: `--model` and `--golden` needed.
fn cpu_formats(a: &Args) -> Result<()> {
    let (Some(model), Some(golden)) = (&a.model, &a.golden) else {
        bail!("--backend cpu checks the stored KV formats of a model: give --model and --golden");
    };
    let files = inferscale_model::open(model).with_context(|| format!("loading model `{model}`"))?;
    let cases = golden_cases(golden)?;
    // One engine with the f32 cache is the reference of both gates.
    let mut reference = gate_engine(inferscale_engine::CpuBackend, &files)?;
    let rows = format_gate(&mut reference, &files, &cases)?;
    print_formats(model, "cpu", &rows);
    let cache = cache_gate(&mut reference, &files, &cases)?;
    let cache_passed = fidelity::store_passed(&cache, CACHE_FP8, fidelity::kl_tolerance(KvFormat::Fp8));
    print_cache(model, "cpu", &cache, cache_passed);
    if let Some(path) = &a.json {
        let doc = serde_json::json!({"device": "cpu", "formats": formats_json(&rows),
            "paged_cache_fp8": cache_json(&cache, cache_passed)});
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let failed = KvFormat::ALL.iter().filter(|&&f| !fidelity::passed(&rows, f)).count();
    if failed > 0 {
        bail!("{failed} of {} stored formats failed the gate", KvFormat::ALL.len());
    }
    if !cache_passed {
        bail!("the fp8 paged cache failed the gate");
    }
    eprintln!("inferscale check: every stored format and the fp8 paged cache passed on the CPU");
    Ok(())
}

/// The name of the fp8 paged cache's rows.
const CACHE_FP8: &str = "cache fp8";

/// The fp8 paged cache (`--kv-cache-dtype fp8`, docs/design.md §2.2) through
/// the format gate's prompts: the same memory injected into an engine with
/// an fp8 cache and one with the backend's own cache (`reference`),
/// question and answer computed in each.
fn cache_gate<B: inferscale_engine::Backend + Clone>(
    reference: &mut inferscale_engine::Engine<B>,
    files: &inferscale_model::ModelFiles,
    cases: &[(String, Vec<u32>, usize)],
) -> Result<Vec<fidelity::Fidelity>> {
    use inferscale_engine::{Engine, backend::KvCacheDtype};
    let backend = reference.backend().clone();
    let mut fp8 = Engine::with_cache(backend, files, GATE_ENGINE, KvCacheDtype::Fp8)?;
    Ok(fidelity::check_cache(reference, &mut fp8, &fidelity_cases(cases), CACHE_FP8)?)
}

fn print_cache(model: &str, device: &str, rows: &[fidelity::Fidelity], passed: bool) {
    let native = if device == "cpu" { "f32" } else { "bf16" };
    println!("\nthe fp8 paged cache of {model} on {device}, against the {native} cache (first-token KL, greedy)");
    print_rows(rows);
    println!(
        "{:<24} {:<10} {:>10.2e}  mean KL (tolerance {:.0e}; no divergence at a margin ≥ {})  {}",
        "all prompts",
        CACHE_FP8,
        fidelity::mean_kl(rows, CACHE_FP8),
        fidelity::kl_tolerance(KvFormat::Fp8),
        fidelity::CONFIDENT_MARGIN,
        if passed { "ok" } else { "FAILED" }
    );
}

fn cache_json(rows: &[fidelity::Fidelity], passed: bool) -> serde_json::Value {
    serde_json::json!({"rows": rows_json(rows), "mean_kl": fidelity::mean_kl(rows, CACHE_FP8),
        "tolerance": fidelity::kl_tolerance(KvFormat::Fp8), "passed": passed})
}

fn fidelity_cases(cases: &[(String, Vec<u32>, usize)]) -> Vec<fidelity::Case> {
    cases
        .iter()
        .map(|(name, tokens, steps)| fidelity::Case { name: name.clone(), tokens: tokens.clone(), steps: *steps })
        .collect()
}

/// The sizing of the gates' engines.
const GATE_ENGINE: inferscale_engine::EngineConfig =
    inferscale_engine::EngineConfig { kv_blocks: 512, max_batch_tokens: 512 };

/// An engine for the gates on `backend`, with the backend's own cache.
fn gate_engine<B: inferscale_engine::Backend>(
    backend: B,
    files: &inferscale_model::ModelFiles,
) -> Result<inferscale_engine::Engine<B>> {
    Ok(inferscale_engine::Engine::new(backend, files, GATE_ENGINE)?)
}

/// Every stored KV format's answers on the golden prompts against the KV
/// as computed, on `engine`.
fn format_gate<B: inferscale_engine::Backend>(
    engine: &mut inferscale_engine::Engine<B>,
    files: &inferscale_model::ModelFiles,
    cases: &[(String, Vec<u32>, usize)],
) -> Result<Vec<fidelity::Fidelity>> {
    let c = &files.config;
    let header = KvHeader {
        fingerprint: "check".into(),
        window: 0,
        dtype: KvFormat::F32,
        layers: c.num_layers,
        kv_dim: c.kv_dim(),
        head_dim: c.head_dim,
        layout: 0,
    };
    Ok(fidelity::check_formats(engine, &header, &fidelity_cases(cases))?)
}

/// A gate's rows: prompt, store, first-token KL, greedy tokens agreed, and
/// the reference's top-2 margin where they diverged.
fn print_rows(rows: &[fidelity::Fidelity]) {
    for r in rows {
        let margin = r.margin_at_divergence.map_or("-".into(), |m| format!("{m:.4}"));
        println!("{:<24} {:<10} {:>10.2e} {:>5}/{:<2} {:>22}", r.case, r.store, r.kl, r.agreed, r.steps, margin);
    }
}

fn print_formats(model: &str, device: &str, rows: &[fidelity::Fidelity]) {
    println!(
        "
stored KV formats of {model} on {device}, against the KV as computed (first-token KL, greedy)"
    );
    println!("{:<24} {:<10} {:>10} {:>8} {:>22}", "prompt", "format", "KL", "agreed", "top-2 margin there");
    print_rows(rows);
    for f in KvFormat::ALL {
        let verdict = if fidelity::passed(rows, f) { "ok" } else { "FAILED" };
        println!(
            "{:<24} {:<10} {:>10.2e}  mean KL (tolerance {:.0e}; no divergence at a margin ≥ {})  {verdict}",
            "all prompts",
            f.name(),
            fidelity::mean_kl(rows, f.name()),
            fidelity::kl_tolerance(f),
            fidelity::CONFIDENT_MARGIN
        );
    }
}

/// A gate's rows as JSON.
fn rows_json(rows: &[fidelity::Fidelity]) -> Vec<serde_json::Value> {
    rows.iter()
        .map(|r| {
            serde_json::json!({"name": r.case, "format": r.store, "kl": r.kl, "steps": r.steps,
                "agreed": r.agreed, "margin_at_divergence": r.margin_at_divergence})
        })
        .collect()
}

fn formats_json(rows: &[fidelity::Fidelity]) -> serde_json::Value {
    let per = rows_json(rows);
    let summary: Vec<serde_json::Value> = KvFormat::ALL
        .iter()
        .map(|&f| {
            serde_json::json!({"format": f.name(), "mean_kl": fidelity::mean_kl(rows, f.name()),
                "tolerance": fidelity::kl_tolerance(f), "passed": fidelity::passed(rows, f)})
        })
        .collect();
    serde_json::json!({"rows": per, "summary": summary})
}

#[cfg(feature = "cuda")]
fn device(a: &Args) -> Result<()> {
    use inferscale_cuda::parity;
    let be = crate::runtime::cuda_backend(a.device)?;
    let mut report = parity::run(&be).context("running the parity checks")?;
    report.extend(parity::gemv(&be).context("checking the few-row GEMM kernel")?);
    report.extend(parity::fp8_encode(&be).context("checking the fp8 cache's encoder")?);
    report.extend(inferscale_cuda::external::check(&be).context("checking injection into vLLM's cache layouts")?);
    println!(
        "{:<72} {:>10} {:>10}  result",
        "check (relative L2 error, CUDA vs CPU unless noted)", "error", "tolerance"
    );
    report.iter().for_each(print_check);
    let (mut greedy_rows, mut format_rows, mut cache_rows) = (Vec::new(), Vec::new(), Vec::new());
    // `None` without a model to gate.
    let mut cache_passed = None;
    if let (Some(model), Some(golden)) = (&a.model, &a.golden) {
        let files = inferscale_model::open(model).with_context(|| format!("loading model `{model}`"))?;
        let cases = golden_cases(golden)?;
        let mut checks = parity::real_model(&be, model, &files).context("E1–E4 on the model")?;
        checks.extend(parity::decode_graphs(&be, model, &files).context("decode graphs on the model")?);
        checks.iter().for_each(print_check);
        report.extend(checks);
        greedy_rows = parity::greedy(&be, &files, &cases).context("greedy decoding on both backends")?;
        println!("\ngreedy decoding of {model}, CUDA vs CPU (teacher-forced on the CPU's tokens)");
        println!(
            "{:<24} {:>6} {:>8} {:>22} {:>14} {:>14} {:>12}  result (tolerance {:.2}, relative L2)",
            "prompt",
            "steps",
            "agreed",
            "CPU top-2 margin there",
            "worst logits",
            "worst top-5 lp",
            "(max |Δ|)",
            parity::REAL_MODEL_TOL
        );
        for r in &greedy_rows {
            let margin = r.margin_at_divergence.map_or("-".into(), |m| format!("{m:.4}"));
            let verdict = if r.passed() { "ok" } else { "FAILED" };
            println!(
                "{:<24} {:>6} {:>8} {:>22} {:>14.2e} {:>14.2e} {:>12.4}  {verdict}",
                r.name, r.steps, r.agreed, margin, r.worst_logits, r.worst_logprobs, r.worst_logprob_abs
            );
        }
        let mut engine = gate_engine(be.clone(), &files)?;
        format_rows = format_gate(&mut engine, &files, &cases).context("the stored-format gate")?;
        print_formats(model, be.device_name(), &format_rows);
        cache_rows = cache_gate(&mut engine, &files, &cases).context("the fp8 paged cache's gate")?;
        cache_passed = Some(fidelity::store_passed(&cache_rows, CACHE_FP8, fidelity::kl_tolerance(KvFormat::Fp8)));
        print_cache(model, be.device_name(), &cache_rows, cache_passed == Some(true));
    }
    if let Some(path) = &a.json {
        let rows: Vec<serde_json::Value> = report
            .iter()
            .map(|c| {
                serde_json::json!({"name": c.name, "error": c.error, "tolerance": c.tolerance,
                    "control": c.control, "passed": c.passed()})
            })
            .collect();
        let greedy: Vec<serde_json::Value> = greedy_rows
            .iter()
            .map(|r| {
                serde_json::json!({"name": r.name, "steps": r.steps, "agreed": r.agreed,
                    "margin_at_divergence": r.margin_at_divergence, "worst_logits_rel": r.worst_logits,
                    "worst_top5_logprobs_rel": r.worst_logprobs, "worst_logprob_abs": r.worst_logprob_abs})
            })
            .collect();
        let formats = formats_json(&format_rows);
        let cache = cache_passed.map(|passed| cache_json(&cache_rows, passed));
        let doc = serde_json::json!({"device": be.device_name(), "checks": rows, "greedy": greedy, "formats": formats,
            "paged_cache_fp8": cache});
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let formats = if format_rows.is_empty() { Vec::new() } else { KvFormat::ALL.to_vec() };
    let failed = report.iter().filter(|c| !c.passed()).count()
        + greedy_rows.iter().filter(|r| !r.passed()).count()
        + formats.iter().filter(|&&f| !fidelity::passed(&format_rows, f)).count()
        + usize::from(cache_passed == Some(false));
    let total = report.len() + greedy_rows.len() + formats.len() + usize::from(cache_passed.is_some());
    if failed > 0 {
        bail!("{failed} of {total} checks failed");
    }
    eprintln!("inferscale check: all {total} checks passed on {}", be.device_name());
    Ok(())
}

#[cfg(feature = "cuda")]
fn print_check(c: &inferscale_cuda::parity::Check) {
    let verdict = match (c.passed(), c.control) {
        (true, false) => "ok",
        (true, true) => "ok (control: must exceed)",
        (false, _) => "FAILED",
    };
    println!("{:<72} {:>10.2e} {:>10.0e}  {verdict}", c.name, c.error, c.tolerance);
}

#[cfg(not(feature = "cuda"))]
fn device(_a: &Args) -> Result<()> {
    bail!(
        "this binary was built without the cuda feature; there is no device backend to check (--backend cpu checks the stored formats)"
    )
}
