//! A model as an HF directory (`config.json`, `model.safetensors`): what
//! engines that read only that format load — vLLM 0.26 has no GGUF loader,
//! so a vLLM worker serving the same weights as our GGUF-fed core loads
//! this. The tensors are the [`WeightSource`](crate::WeightSource)'s: HF
//! names, dequantized, Q/K rows back in HF order.

use std::path::Path;

use serde_json::json;

use crate::ModelFiles;
use crate::config::{Family, ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};

/// The HF architecture name of a family, as HF (and vLLM) configs give it.
pub fn architecture(f: Family) -> &'static str {
    match f {
        Family::Llama => "LlamaForCausalLM",
        Family::Mistral => "MistralForCausalLM",
        Family::Qwen2 => "Qwen2ForCausalLM",
    }
}

/// `config.json` describing `c`, with `torch_dtype` bfloat16.
pub fn hf_config(c: &ModelConfig) -> serde_json::Value {
    let mut v = json!({
        "architectures": [architecture(c.family)],
        "model_type": match c.family {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
        },
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope.theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": "bfloat16",
    });
    if let Some(bos) = c.bos_token_id {
        v["bos_token_id"] = json!(bos);
    }
    match c.eos_token_ids.as_slice() {
        [] => {}
        [one] => v["eos_token_id"] = json!(one),
        many => v["eos_token_id"] = json!(many),
    }
    match c.rope.scaling {
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            v["rope_scaling"] = json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings as u64,
            });
        }
        RopeScaling::Linear { factor } => v["rope_scaling"] = json!({"rope_type": "linear", "factor": factor}),
        // No scaling, or GGUF divisors (no HF counterpart: the shapes differ).
        RopeScaling::None | RopeScaling::Divisors(_) => {}
    }
    v
}

/// Every tensor the model has, by HF name, with its shape.
pub fn tensor_names(files: &ModelFiles) -> Vec<(String, Vec<usize>)> {
    let c = &files.config;
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![c.vocab_size, h])];
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.input_layernorm.weight"), vec![h]));
        for (n, rows) in [("q_proj", c.q_dim()), ("k_proj", c.kv_dim()), ("v_proj", c.kv_dim())] {
            out.push((format!("{p}.self_attn.{n}.weight"), vec![rows, h]));
            if c.qkv_bias {
                out.push((format!("{p}.self_attn.{n}.bias"), vec![rows]));
            }
        }
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, c.q_dim()]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
        out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
        out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    // Tied embeddings: no head of its own (unless the file carries one).
    if files.weights.contains("lm_head.weight") {
        out.push(("lm_head.weight".to_string(), vec![c.vocab_size, h]));
    }
    out
}

/// Writes `files` into `dir` (created if missing) as `config.json` and one
/// bfloat16 `model.safetensors`; returns the bytes of tensors written. An
/// existing `model.safetensors` is replaced only once the new one is whole.
pub fn write_hf_dir(files: &ModelFiles, dir: &Path) -> Result<u64> {
    let io = |path: &Path, source| ModelError::Io { path: path.to_path_buf(), source };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let names = tensor_names(files);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(names.len());
    let mut bytes = 0u64;
    for (name, shape) in names {
        let t = files.weights.load(&name, &shape)?;
        let data: Vec<u8> = t.data.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect();
        bytes += data.len() as u64;
        tensors.push((name, shape, data));
    }
    let views = tensors
        .iter()
        .map(|(name, shape, data)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| ModelError::Safetensors { path: dir.to_path_buf(), reason: e.to_string() })
        })
        .collect::<Result<Vec<_>>>()?;
    let partial = dir.join("model.safetensors.partial");
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize_to_file(views, Some(meta), &partial)
        .map_err(|e| ModelError::Safetensors { path: partial.clone(), reason: e.to_string() })?;
    let target = dir.join("model.safetensors");
    std::fs::rename(&partial, &target).map_err(|e| io(&target, e))?;
    let config = dir.join("config.json");
    std::fs::write(&config, hf_config(&files.config).to_string()).map_err(|e| io(&config, e))?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exported_model_reopens_with_the_same_config_and_weights() {
        let config = crate::shapes::preset("smollm2-135m").expect("preset");
        // A small variant of the shape: the test exercises names and values, not size.
        let config = ModelConfig { num_layers: 2, vocab_size: 512, ..config };
        let files = ModelFiles::random("tiny", config, 7);
        let dir = tempfile::tempdir().expect("tmp");
        let bytes = write_hf_dir(&files, dir.path()).expect("writes");
        let names = tensor_names(&files);
        let elems: usize = names.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(bytes, 2 * elems as u64);
        let back = ModelFiles::open(dir.path()).expect("reopens as an HF directory");
        let (a, b) = (&files.config, &back.config);
        assert_eq!(
            (a.family, a.num_layers, a.num_heads, a.num_kv_heads),
            (b.family, b.num_layers, b.num_heads, b.num_kv_heads)
        );
        assert_eq!(
            (a.head_dim, a.hidden_size, a.vocab_size, a.tie_word_embeddings),
            (b.head_dim, b.hidden_size, b.vocab_size, b.tie_word_embeddings)
        );
        assert_eq!(a.rope.theta, b.rope.theta);
        for (name, shape) in &names {
            let x = files.weights.load(name, shape).expect("source");
            let y = back.weights.load(name, shape).expect("exported");
            let worst =
                x.data.iter().zip(&y.data).map(|(p, q)| ((p - q) / p.abs().max(1e-6)).abs()).fold(0f32, f32::max);
            // bfloat16 keeps 8 significant bits: relative error ≤ 2^-8.
            assert!(worst <= 1.0 / 256.0, "{name}: {worst}");
        }
        assert_eq!(back.weights.contains("lm_head.weight"), files.weights.contains("lm_head.weight"));
    }
}
