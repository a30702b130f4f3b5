//! Loading a model into an engine on the chosen backend, shared by the commands.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use inferscale_engine::backend::KvCacheDtype;
use inferscale_engine::{Backend, CpuBackend, Engine, EngineConfig};
use inferscale_model::{ModelFiles, fetch, shapes};

/// Backends this binary was built with.
#[cfg(feature = "cuda")]
pub const BACKENDS: &[&str] = &["cpu", "cuda"];
#[cfg(not(feature = "cuda"))]
pub const BACKENDS: &[&str] = &["cpu"];

/// Options every model-running command takes.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A GGUF file, an HF model directory, or a packaged model name
    /// (default: the one a memory directory was made with, else
    /// smollm2).
    #[arg(long, env = "INFERSCALE_MODEL")]
    pub model: Option<String>,
    /// Compute backend (`cuda` needs an NVIDIA GPU and its driver at run time).
    #[arg(long, env = "INFERSCALE_BACKEND", default_value = "cpu", value_parser = clap::builder::PossibleValuesParser::new(BACKENDS))]
    pub backend: String,
    /// GPU ordinal for `--backend cuda`.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Instead of --model: random weights of a named shape (llama3.1-8b,
    /// mistral-7b, qwen2.5-7b, qwen2.5-1.5b, smollm2-135m), for speed work. Needs --random-weights.
    #[arg(long, requires = "random_weights")]
    pub shape: Option<String>,
    /// Acknowledges that --shape runs random weights (outputs are meaningless).
    #[arg(long, requires = "shape")]
    pub random_weights: bool,
    /// Memory for the paged KV cache, in MiB.
    #[arg(long, env = "INFERSCALE_KV_CACHE_MB", default_value_t = 1024)]
    pub kv_cache_mb: usize,
    /// What the paged KV cache holds: `auto`, the backend's precision (f32
    /// on the CPU, bf16 on CUDA); `fp8`, e4m3 with a scale per token and
    /// head, keys relative to per-layer offsets calibrated at load
    /// (docs/design.md §2.2): about a quarter of the CPU's bytes and half
    /// of CUDA's, so about four (two) times the tokens in --kv-cache-mb,
    /// at a small cost in fidelity (and on CUDA, so far, in decode speed:
    /// docs/serving.md, "An fp8 paged cache").
    #[arg(long, env = "INFERSCALE_KV_CACHE_DTYPE", default_value = "auto", value_parser = ["auto", "fp8"])]
    pub kv_cache_dtype: String,
    /// Most tokens per forward pass (prefill chunk size).
    #[arg(long, default_value_t = 1024)]
    pub max_batch_tokens: usize,
    /// Decode steps as captured CUDA graphs: a step replayed in one launch
    /// (a graph per batch size, captured at its first step) instead of every
    /// op launched from the host. `auto`: where the backend has them (CUDA);
    /// `on`: refuse a backend without; `off`: never.
    #[arg(long, env = "INFERSCALE_CUDA_GRAPHS", default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub cuda_graphs: String,
}

impl ModelArgs {
    /// The model to load: `--model`, else the default.
    pub fn model(&self) -> &str {
        self.model.as_deref().unwrap_or(fetch::DEFAULT_MODEL)
    }

    /// How a memory directory records this model (`Manifest::model`):
    /// the shape, a packaged name, or a file's absolute path.
    pub fn recorded(&self) -> String {
        match &self.shape {
            Some(shape) => format!("shape:{shape}"),
            None => {
                let m = self.model();
                let path = std::path::Path::new(m);
                match path.exists() {
                    true => std::path::absolute(path).map_or(m.to_string(), |p| p.display().to_string()),
                    false => m.to_string(),
                }
            }
        }
    }
}

pub struct Loaded<B: Backend = CpuBackend> {
    pub files: ModelFiles,
    pub engine: Engine<B>,
}

impl<B: Backend> Loaded<B> {
    /// End-of-sequence ids: the config's, plus the tokenizer's EOS.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.files.eos_ids()
    }
}

/// The model files `args` name: a file, directory or packaged model, or a random-weight shape.
pub fn open_files(args: &ModelArgs) -> Result<ModelFiles> {
    if let Some(name) = &args.shape {
        let config = shapes::preset(name).with_context(|| {
            let known: Vec<&str> = shapes::PRESETS.iter().map(|(n, _)| *n).collect();
            format!("--shape `{name}` is not a known shape; known: {}", known.join(", "))
        })?;
        return Ok(ModelFiles::random(name, config, 0).with_byte_tokenizer()?);
    }
    inferscale_model::open(args.model()).with_context(|| format!("loading model `{}`", args.model()))
}

/// Loads on the CPU backend (commands that run on CPU only).
pub fn load(args: &ModelArgs) -> Result<Loaded> {
    if args.backend != "cpu" {
        bail!("--backend {}: this command runs on the cpu backend only so far", args.backend);
    }
    load_on(args, CpuBackend)
}

/// Loads the model onto `backend`.
pub fn load_on<B: Backend>(args: &ModelArgs, backend: B) -> Result<Loaded<B>> {
    let t0 = Instant::now();
    let files = open_files(args)?;
    let dtype = match args.kv_cache_dtype.as_str() {
        "fp8" => KvCacheDtype::Fp8,
        _ => KvCacheDtype::Native,
    };
    let cfg = EngineConfig::for_cache(
        &files,
        args.kv_cache_mb << 20,
        args.max_batch_tokens,
        dtype,
        backend.kv_bytes_per_value(),
    );
    let mut engine = Engine::with_cache(backend, &files, cfg, dtype).context("building the engine")?;
    let graphs = args.cuda_graphs != "off" && engine.enable_decode_graphs().context("setting up decode graphs")?;
    if args.cuda_graphs == "on" && !graphs {
        bail!("--cuda-graphs on: the {} backend has no decode graphs", args.backend);
    }
    let c = &files.config;
    eprintln!(
        "inferscale: loaded {} ({:?}, {} layers, {}/{} heads, vocab {}) on {} in {:.2}s; KV cache {} blocks{}{}",
        files.path.display(),
        c.family,
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.vocab_size,
        args.backend,
        t0.elapsed().as_secs_f64(),
        cfg.kv_blocks,
        if dtype == KvCacheDtype::Fp8 { " (fp8)" } else { "" },
        if engine.decode_graphs() { ", decode graphs on" } else { "" }
    );
    Ok(Loaded { files, engine })
}

/// Opens GPU `device` for the CUDA backend.
#[cfg(feature = "cuda")]
pub fn cuda_backend(device: usize) -> Result<inferscale_cuda::CudaBackend> {
    let be = inferscale_cuda::CudaBackend::new(device).with_context(|| format!("opening CUDA device {device}"))?;
    eprintln!("inferscale: CUDA device {device}: {}", be.device_name());
    Ok(be)
}

/// Calls `$f(args…, backend)` with the backend `$m` (a [`ModelArgs`]) names.
macro_rules! on_backend {
    ($m:expr, $f:ident ( $($x:expr),* )) => {
        match $m.backend.as_str() {
            "cpu" => $f($($x,)* inferscale_engine::CpuBackend),
            #[cfg(feature = "cuda")]
            "cuda" => $f($($x,)* $crate::runtime::cuda_backend($m.device)?),
            other => anyhow::bail!("backend `{other}` is not built into this binary"),
        }
    };
}
pub(crate) use on_backend;

/// Parses a `--blend-ratio`: a number in `0..=1`.
pub(crate) fn blend_ratio(s: &str) -> std::result::Result<f32, String> {
    let r: f32 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    inferscale_types::check_blend_ratio(r).map_err(|e| e.message)
}

/// Raises this process's open-file limit to its hard limit: a server holds
/// a socket per client connection beside the logs each memory operation
/// opens, and the usual soft limit of 1,024 is near what a loaded node
/// uses. A descriptor that cannot be had fails the operation with "Too many
/// open files" (a user's first read is retried on its next use, never taken
/// for damage).
pub(crate) fn raise_open_files_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given, which lives here.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur >= lim.rlim_max {
        return;
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: setrlimit reads the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        eprintln!("inferscale: warning: could not raise the open-file limit to {}", lim.rlim_max);
    }
}
