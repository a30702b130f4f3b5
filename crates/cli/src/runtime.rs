//! Loading a model into an engine, shared by the commands.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use inferscale_engine::{CpuBackend, Engine, EngineConfig};
use inferscale_model::{ModelFiles, fetch};

/// Options every model-running command takes.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A GGUF file, an HF model directory, or a packaged model name.
    #[arg(long, default_value = fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Compute backend.
    #[arg(long, default_value = "cpu", value_parser = ["cpu"])]
    pub backend: String,
    /// Memory for the paged KV cache, in MiB.
    #[arg(long, default_value_t = 1024)]
    pub kv_cache_mb: usize,
    /// Most tokens per forward pass (prefill chunk size).
    #[arg(long, default_value_t = 1024)]
    pub max_batch_tokens: usize,
}

pub struct Loaded {
    pub files: ModelFiles,
    pub engine: Engine<CpuBackend>,
}

impl Loaded {
    /// End-of-sequence ids: the config's, plus the tokenizer's EOS.
    pub fn eos_ids(&self) -> Vec<u32> {
        let mut ids = self.files.config.eos_token_ids.clone();
        if let Some((id, _)) = self.files.tokenizer.as_ref().and_then(|t| t.eos.as_ref())
            && !ids.contains(id)
        {
            ids.push(*id);
        }
        ids
    }
}

pub fn load(args: &ModelArgs) -> Result<Loaded> {
    let t0 = Instant::now();
    let files = inferscale_model::open(&args.model).with_context(|| format!("loading model `{}`", args.model))?;
    let cfg = EngineConfig::with_kv_bytes(&files, args.kv_cache_mb << 20, args.max_batch_tokens);
    let engine = Engine::new(CpuBackend, &files, cfg).context("building the engine")?;
    let c = &files.config;
    eprintln!(
        "inferscale: loaded {} ({:?}, {} layers, {}/{} heads, vocab {}) on {} in {:.2}s; KV cache {} blocks",
        files.path.display(),
        c.family,
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.vocab_size,
        args.backend,
        t0.elapsed().as_secs_f64(),
        cfg.kv_blocks
    );
    Ok(Loaded { files, engine })
}
