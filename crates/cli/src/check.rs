//! `inferscale check`: verifies a device backend against the CPU reference
//! on this machine — every backend op on random data, then small models of
//! each supported shape (logits against the CPU backend, and E1–E4 on the
//! device). Run it on a GPU node before serving from it; it exits non-zero
//! when any comparison misses its tolerance.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args as ClapArgs;

#[derive(ClapArgs, Debug)]
pub struct Args {
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

#[cfg(feature = "cuda")]
/// `(name, input ids, steps)` of every case in a golden file made by
/// tests/golden/make_golden.py.
fn golden_cases(path: &std::path::Path) -> Result<Vec<(String, Vec<u32>, usize)>> {
    use anyhow::Context;
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

#[cfg(feature = "cuda")]
pub fn run(a: Args) -> Result<()> {
    use anyhow::Context;
    use inferscale_cuda::parity;
    let be = crate::runtime::cuda_backend(a.device)?;
    let mut report = parity::run(&be).context("running the parity checks")?;
    report.extend(inferscale_cuda::external::check(&be).context("checking injection into vLLM's cache layouts")?);
    println!(
        "{:<72} {:>10} {:>10}  result",
        "check (relative L2 error, CUDA vs CPU unless noted)", "error", "tolerance"
    );
    report.iter().for_each(print_check);
    let mut greedy_rows = Vec::new();
    if let (Some(model), Some(golden)) = (&a.model, &a.golden) {
        let files = inferscale_model::open(model).with_context(|| format!("loading model `{model}`"))?;
        let cases = golden_cases(golden)?;
        let checks = parity::real_model(&be, model, &files).context("E1–E4 on the model")?;
        checks.iter().for_each(print_check);
        report.extend(checks);
        greedy_rows = parity::greedy(&be, &files, &cases).context("greedy decoding on both backends")?;
        println!("\ngreedy decoding of {model}, CUDA vs CPU (teacher-forced on the CPU's tokens)");
        println!(
            "{:<24} {:>6} {:>8} {:>22} {:>14}  result (logits tolerance {:.2})",
            "prompt",
            "steps",
            "agreed",
            "CPU top-2 margin there",
            "worst logits",
            parity::REAL_MODEL_TOL
        );
        for r in &greedy_rows {
            let margin = r.margin_at_divergence.map_or("-".into(), |m| format!("{m:.4}"));
            let verdict = if r.passed() { "ok" } else { "FAILED" };
            println!(
                "{:<24} {:>6} {:>8} {:>22} {:>14.2e}  {verdict}",
                r.name, r.steps, r.agreed, margin, r.worst_logits
            );
        }
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
                    "margin_at_divergence": r.margin_at_divergence, "worst_logits_rel": r.worst_logits})
            })
            .collect();
        let doc = serde_json::json!({"device": be.device_name(), "checks": rows, "greedy": greedy});
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let failed = report.iter().filter(|c| !c.passed()).count() + greedy_rows.iter().filter(|r| !r.passed()).count();
    if failed > 0 {
        bail!("{failed} of {} checks failed", report.len() + greedy_rows.len());
    }
    eprintln!("inferscale check: all {} checks passed on {}", report.len() + greedy_rows.len(), be.device_name());
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
pub fn run(_a: Args) -> Result<()> {
    bail!("this binary was built without the cuda feature; there is no device backend to check")
}
