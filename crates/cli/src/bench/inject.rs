//! `inferscale bench inject`: the KV injection kernel alone, timed with
//! device events, next to the copies that bound it — a device-to-device
//! copy of the same bytes for injection from device memory, a pinned
//! host-to-device copy for injection from the host tier.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct InjectBenchArgs {
    /// Model shape whose KV is injected (layers, KV heads, head size, RoPE).
    #[arg(long, default_value = "llama3.1-8b")]
    shape: String,
    /// Numbers of facts injected at once.
    #[arg(long, value_delimiter = ',', default_value = "5,50,200")]
    facts: Vec<usize>,
    /// Tokens per fact.
    #[arg(long, default_value_t = 25)]
    fact_tokens: usize,
    /// Back-to-back calls per measurement (the mean is reported).
    #[arg(long, default_value_t = 50)]
    reps: usize,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[cfg(feature = "cuda")]
pub fn run(a: InjectBenchArgs) -> Result<()> {
    use anyhow::Context;
    use inferscale_engine::backend::KvSpec;
    use inferscale_engine::kv_cache::BLOCK_SIZE;
    use inferscale_engine::rope::Rope;

    let c =
        inferscale_model::shapes::preset(&a.shape).with_context(|| format!("--shape `{}` is not known", a.shape))?;
    if a.facts.is_empty() || a.fact_tokens == 0 || a.reps == 0 {
        anyhow::bail!("--facts, --fact-tokens and --reps must be positive");
    }
    let be = crate::runtime::cuda_backend(a.device)?;
    let spec = KvSpec {
        num_layers: c.num_layers,
        num_blocks: 1,
        block_size: BLOCK_SIZE,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        dtype: Default::default(),
    };
    let rope = Rope::new(&c.rope);
    println!(
        "{} · shape {} · {} tokens per fact · mean of {} calls, device time",
        be.device_name(),
        a.shape,
        a.fact_tokens,
        a.reps
    );
    println!(
        "| facts | tokens | K+V MB | inject µs | inject GB/s | DtoD copy GB/s | inject / copy | host-tier inject µs | host-tier GB/s | HtoD copy GB/s | host tier / HtoD |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for &facts in &a.facts {
        let t = be.time_injection(spec, &rope, facts, a.fact_tokens, a.reps)?;
        // Device side: every byte read once and written once, as a copy counts.
        let moved = 2.0 * t.payload_bytes as f64;
        let gbs = |bytes: f64, us: f64| bytes / (us * 1e-6) / 1e9;
        let (inj, dtod) = (gbs(moved, t.inject_us), gbs(moved, t.copy_dtod_us));
        // Over the bus each byte crosses once.
        let payload = t.payload_bytes as f64;
        let (host, htod) = (gbs(payload, t.inject_host_tier_us), gbs(payload, t.copy_htod_us));
        println!(
            "| {facts} | {} | {:.1} | {:.1} | {inj:.0} | {dtod:.0} | {:.0}% | {:.1} | {host:.1} | {htod:.1} | {:.0}% |",
            t.tokens,
            payload / 1e6,
            t.inject_us,
            100.0 * inj / dtod,
            t.inject_host_tier_us,
            100.0 * host / htod
        );
        rows.push(serde_json::json!({
            "facts": facts, "tokens": t.tokens, "payload_bytes": t.payload_bytes,
            "inject_us": t.inject_us, "copy_dtod_us": t.copy_dtod_us,
            "inject_host_tier_us": t.inject_host_tier_us, "copy_htod_us": t.copy_htod_us,
            "inject_gb_s": inj, "copy_dtod_gb_s": dtod, "host_tier_gb_s": host, "copy_htod_gb_s": htod,
        }));
    }
    if let Some(path) = &a.json {
        let out = serde_json::json!({
            "device": be.device_name(), "shape": a.shape, "fact_tokens": a.fact_tokens, "reps": a.reps, "results": rows,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn run(_: InjectBenchArgs) -> Result<()> {
    anyhow::bail!("bench inject needs the CUDA backend; this binary was built without it")
}
