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
}

#[cfg(feature = "cuda")]
pub fn run(a: Args) -> Result<()> {
    use anyhow::Context;
    use inferscale_cuda::parity;
    let be = crate::runtime::cuda_backend(a.device)?;
    let report = parity::run(&be).context("running the parity checks")?;
    println!(
        "{:<72} {:>10} {:>10}  result",
        "check (relative L2 error, CUDA vs CPU unless noted)", "error", "tolerance"
    );
    for c in &report {
        let verdict = match (c.passed(), c.control) {
            (true, false) => "ok",
            (true, true) => "ok (control: must exceed)",
            (false, _) => "FAILED",
        };
        println!("{:<72} {:>10.2e} {:>10.0e}  {verdict}", c.name, c.error, c.tolerance);
    }
    if let Some(path) = &a.json {
        let rows: Vec<serde_json::Value> = report
            .iter()
            .map(|c| {
                serde_json::json!({"name": c.name, "error": c.error, "tolerance": c.tolerance,
                    "control": c.control, "passed": c.passed()})
            })
            .collect();
        let doc = serde_json::json!({"device": be.device_name(), "checks": rows});
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let failed = report.iter().filter(|c| !c.passed()).count();
    if failed > 0 {
        bail!("{failed} of {} checks failed", report.len());
    }
    eprintln!("inferscale check: all {} checks passed on {}", report.len(), be.device_name());
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn run(_a: Args) -> Result<()> {
    bail!("this binary was built without the cuda feature; there is no device backend to check")
}
