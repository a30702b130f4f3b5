//! Named model shapes with random weights, for speed work on architectures
//! whose checkpoints are not at hand: compute and memory traffic depend on
//! the shapes, not on the values.
//!
//! Values are deterministic per (seed, tensor name): norm weights are 1,
//! every other tensor uniform with standard deviation 0.02 (the usual
//! initialisation), which keeps activations finite through every layer.

use std::path::PathBuf;

use rayon::prelude::*;

use crate::config::{Family, ModelConfig, RopeConfig, RopeScaling};
use crate::{ModelFiles, WeightSource};

/// The shapes [`preset`] knows, with the checkpoint each copies.
pub const PRESETS: &[(&str, &str)] = &[
    ("llama3.1-8b", "meta-llama/Llama-3.1-8B-Instruct"),
    ("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3"),
    ("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct"),
    ("qwen2.5-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"),
];

/// The architecture of a named shape (see [`PRESETS`]).
pub fn preset(name: &str) -> Option<ModelConfig> {
    let base = |family, vocab, hidden, inter, layers, heads, kv_heads, theta: f32| ModelConfig {
        family,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hidden / heads,
        rms_norm_eps: 1e-5,
        rope: RopeConfig { theta, dim: hidden / heads, scaling: RopeScaling::None },
        max_position_embeddings: 32_768,
        tie_word_embeddings: false,
        qkv_bias: false,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
    };
    match name {
        "llama3.1-8b" => {
            let mut c = base(Family::Llama, 128_256, 4096, 14_336, 32, 32, 8, 500_000.0);
            c.rope.scaling = RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            };
            c.max_position_embeddings = 131_072;
            Some(c)
        }
        "mistral-7b" => Some(base(Family::Mistral, 32_768, 4096, 14_336, 32, 32, 8, 1_000_000.0)),
        "qwen2.5-7b" => {
            let mut c = base(Family::Qwen2, 152_064, 3584, 18_944, 28, 28, 4, 1_000_000.0);
            c.rms_norm_eps = 1e-6;
            c.qkv_bias = true;
            Some(c)
        }
        "qwen2.5-1.5b" => {
            let mut c = base(Family::Qwen2, 151_936, 1536, 8960, 28, 12, 2, 1_000_000.0);
            c.rms_norm_eps = 1e-6;
            c.qkv_bias = true;
            c.tie_word_embeddings = true;
            Some(c)
        }
        "smollm2-135m" => {
            let mut c = base(Family::Llama, 49_152, 576, 1536, 30, 9, 3, 100_000.0);
            c.max_position_embeddings = 8192;
            c.tie_word_embeddings = true;
            Some(c)
        }
        _ => None,
    }
}

impl ModelFiles {
    /// A model of shape `config` with random weights drawn from `seed`; no
    /// tokenizer or chat template.
    pub fn random(name: &str, config: ModelConfig, seed: u64) -> ModelFiles {
        let tied = config.tie_word_embeddings;
        ModelFiles {
            path: PathBuf::from(format!("random:{name}")),
            config,
            weights: WeightSource::Random { seed, tied },
            tokenizer: None,
            chat_template: None,
        }
    }
}

impl ModelFiles {
    /// Gives a random-weight model the byte-level tokenizer and a ChatML
    /// template (`<|im_start|>` = 256, `<|im_end|>` = 257, the end of a
    /// turn), so that the serving path — prompts from text, streamed text
    /// back — runs on it. Token ids stay far below every preset's vocabulary.
    pub fn with_byte_tokenizer(mut self) -> crate::Result<ModelFiles> {
        let tok = crate::Tokenizer::byte_level(&["<|im_start|>", "<|im_end|>"], Some("<|im_end|>"))?;
        self.chat_template = Some(crate::ChatTemplate::new(crate::chat::builtin::CHATML_QWEN2, "", "<|im_end|>")?);
        self.tokenizer = Some(tok);
        Ok(self)
    }
}

/// Random values for tensor `name` of `len` elements (see the module doc).
pub(crate) fn random_values(seed: u64, name: &str, len: usize) -> Vec<f32> {
    if name.ends_with("norm.weight") {
        return vec![1.0; len];
    }
    let stream = name.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    // Uniform on [-a, a] has standard deviation a/√3.
    let a = 0.02 * 3f32.sqrt();
    const CHUNK: usize = 1 << 16;
    let mut out = vec![0f32; len];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, chunk)| {
        let mut state = stream.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        for x in chunk {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            *x = (2.0 * u - 1.0) * a;
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_random_weights_are_deterministic() {
        for (name, _) in PRESETS {
            let c = preset(name).unwrap_or_else(|| panic!("{name}"));
            c.validate(std::path::Path::new(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let a = random_values(7, "model.layers.0.mlp.up_proj.weight", 200_000);
        assert_eq!(a, random_values(7, "model.layers.0.mlp.up_proj.weight", 200_000));
        assert_ne!(a, random_values(7, "model.layers.1.mlp.up_proj.weight", 200_000));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        let std = (a.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / a.len() as f32).sqrt();
        assert!(mean.abs() < 1e-3 && (std - 0.02).abs() < 1e-3, "mean {mean}, std {std}");
        assert!(random_values(7, "model.norm.weight", 8).iter().all(|&x| x == 1.0));
    }
}
