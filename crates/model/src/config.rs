//! The architecture description shared by every Llama-family model, read
//! either from an HF `config.json` or from GGUF metadata.

use std::path::Path;

use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// Model families served by the one Llama-family forward pass. They differ
/// only in flags of [`ModelConfig`] (QKV bias, tied embeddings, RoPE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
}

/// How rotary frequencies are adjusted for long context.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama-3.1 frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
    /// Per-frequency divisors stored in the model file (GGUF `rope_freqs.weight`).
    Divisors(Vec<f32>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    /// Rotated dimensions per head (= head_dim for every supported family).
    pub dim: usize,
    pub scaling: RopeScaling,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope: RopeConfig,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Q, K and V projections carry a bias (Qwen2).
    pub qkv_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Checks the relations the forward pass relies on.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, reason: String| ModelError::Config {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason,
        };
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(bad(field, "must be positive".into()));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(bad(
                "num_key_value_heads",
                format!("{} does not divide num_attention_heads {}", self.num_kv_heads, self.num_heads),
            ));
        }
        if !self.head_dim.is_multiple_of(2) || self.rope.dim > self.head_dim || !self.rope.dim.is_multiple_of(2) {
            return Err(bad(
                "head_dim",
                format!("head_dim {} / rotary dim {} must be even, rotary ≤ head_dim", self.head_dim, self.rope.dim),
            ));
        }
        if self.rope.theta.is_nan() || self.rope.theta <= 0.0 {
            return Err(bad("rope_theta", format!("{} must be positive", self.rope.theta)));
        }
        if let RopeScaling::Divisors(d) = &self.rope.scaling
            && d.len() != self.rope.dim / 2
        {
            return Err(bad("rope_freqs", format!("{} divisors for {} frequencies", d.len(), self.rope.dim / 2)));
        }
        Ok(())
    }

    /// Reads an HF `config.json` (Llama, Mistral, Qwen2).
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ModelError::Io { path: path.to_path_buf(), source })?;
        let v: Value = serde_json::from_str(&text).map_err(|e| ModelError::Config {
            path: path.to_path_buf(),
            field: "(json)".into(),
            reason: e.to_string(),
        })?;
        Self::from_hf_value(&v, path)
    }

    pub fn from_hf_value(v: &Value, path: &Path) -> Result<Self> {
        let field = |name: &str, reason: &str| ModelError::Config {
            path: path.to_path_buf(),
            field: name.to_string(),
            reason: reason.to_string(),
        };
        let usize_of = |name: &str| -> Result<usize> {
            v.get(name)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| field(name, "missing or not a non-negative integer"))
        };
        let f32_of = |name: &str, default: f32| -> Result<f32> {
            match v.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x.as_f64().map(|x| x as f32).ok_or_else(|| field(name, "not a number")),
            }
        };
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("llama");
        let family = match model_type {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            other => {
                return Err(field("model_type", &format!("`{other}` is not supported (llama, mistral, qwen2 are)")));
            }
        };
        let hidden_size = usize_of("hidden_size")?;
        let num_heads = usize_of("num_attention_heads")?;
        let num_kv_heads = match v.get("num_key_value_heads") {
            None | Some(Value::Null) => num_heads,
            Some(_) => usize_of("num_key_value_heads")?,
        };
        let head_dim = match v.get("head_dim") {
            None | Some(Value::Null) => hidden_size.checked_div(num_heads).unwrap_or(0),
            Some(_) => usize_of("head_dim")?,
        };
        // transformers ≥ 5 writes `rope_parameters` (theta inside); older
        // configs have top-level `rope_theta` and `rope_scaling`.
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        let scaling = parse_rope_scaling(rope_params.or(v.get("rope_scaling")), path)?;
        let theta = match rope_params.and_then(|p| p.get("rope_theta")) {
            Some(t) => {
                t.as_f64().map(|t| t as f32).ok_or_else(|| field("rope_parameters.rope_theta", "not a number"))?
            }
            None => f32_of("rope_theta", 10_000.0)?,
        };
        if family == Family::Mistral && v.get("sliding_window").is_some_and(|w| !w.is_null()) {
            // The forward pass attends to the whole context; a window smaller than the
            // context would silently change results, so it is refused at load.
            let window = usize_of("sliding_window")?;
            let max = usize_of("max_position_embeddings")?;
            if window < max {
                return Err(field(
                    "sliding_window",
                    &format!("sliding-window attention ({window} < {max}) is not supported"),
                ));
            }
        }
        let qkv_bias = match family {
            Family::Qwen2 => true,
            _ => v.get("attention_bias").and_then(Value::as_bool).unwrap_or(false),
        };
        let eos_token_ids = match v.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
            _ => Vec::new(),
        };
        let cfg = ModelConfig {
            family,
            vocab_size: usize_of("vocab_size")?,
            hidden_size,
            intermediate_size: usize_of("intermediate_size")?,
            num_layers: usize_of("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: f32_of("rms_norm_eps", 1e-6)?,
            rope: RopeConfig { theta, dim: head_dim, scaling },
            max_position_embeddings: usize_of("max_position_embeddings")?,
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            qkv_bias,
            bos_token_id: v.get("bos_token_id").and_then(Value::as_u64).map(|x| x as u32),
            eos_token_ids,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Reads the architecture from GGUF metadata (`<arch>.*` keys). RoPE
    /// divisors stored as the `rope_freqs.weight` tensor are picked up here.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let path = file.path();
        let field = |name: &str, reason: &str| ModelError::Config {
            path: path.to_path_buf(),
            field: name.to_string(),
            reason: reason.to_string(),
        };
        let arch = file
            .meta("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| field("general.architecture", "missing"))?
            .to_string();
        let family = match arch.as_str() {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            other => {
                return Err(field(
                    "general.architecture",
                    &format!("`{other}` is not supported (llama, mistral, qwen2 are)"),
                ));
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| -> Result<usize> {
            let name = key(k);
            file.meta(&name)
                .and_then(|v| v.as_u64())
                .map(|x| x as usize)
                .ok_or_else(|| field(&name, "missing or not an integer"))
        };
        let f = |k: &str, default: f32| -> Result<f32> {
            let name = key(k);
            match file.meta(&name) {
                None => Ok(default),
                Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| field(&name, "not a number")),
            }
        };
        let hidden_size = u("embedding_length")?;
        let num_heads = u("attention.head_count")?;
        let num_kv_heads = u("attention.head_count_kv").unwrap_or(num_heads);
        let head_dim = u("attention.key_length").unwrap_or(hidden_size.checked_div(num_heads).unwrap_or(0));
        let rope_dim = u("rope.dimension_count").unwrap_or(head_dim);
        let vocab_size = match u("vocab_size") {
            Ok(n) => n,
            Err(_) => file
                .meta("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array())
                .map(|a| a.len())
                .ok_or_else(|| field(&key("vocab_size"), "missing, and no tokenizer.ggml.tokens to count"))?,
        };
        let scaling = if file.tensors.contains_key("rope_freqs.weight") {
            let (_, d) = file.tensor_f32("rope_freqs.weight")?;
            RopeScaling::Divisors(d)
        } else {
            match file.meta(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
                None | Some("none") => RopeScaling::None,
                Some("linear") => RopeScaling::Linear { factor: f("rope.scaling.factor", 1.0)? },
                Some(other) => {
                    return Err(field(&key("rope.scaling.type"), &format!("`{other}` is not supported")));
                }
            }
        };
        let bos = file.meta("tokenizer.ggml.bos_token_id").and_then(|v| v.as_u64()).map(|x| x as u32);
        let eos = file.meta("tokenizer.ggml.eos_token_id").and_then(|v| v.as_u64()).map(|x| x as u32);
        let cfg = ModelConfig {
            family,
            vocab_size,
            hidden_size,
            intermediate_size: u("feed_forward_length")?,
            num_layers: u("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: f("attention.layer_norm_rms_epsilon", 1e-5)?,
            rope: RopeConfig { theta: f("rope.freq_base", 10_000.0)?, dim: rope_dim, scaling },
            max_position_embeddings: u("context_length")?,
            tie_word_embeddings: !file.tensors.contains_key("output.weight"),
            qkv_bias: file.tensors.contains_key("blk.0.attn_q.bias"),
            bos_token_id: bos,
            eos_token_ids: eos.into_iter().collect(),
        };
        cfg.validate(path)?;
        Ok(cfg)
    }
}

fn parse_rope_scaling(v: Option<&Value>, path: &Path) -> Result<RopeScaling> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let field = |name: &str, reason: String| ModelError::Config {
        path: path.to_path_buf(),
        field: format!("rope_scaling.{name}"),
        reason,
    };
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(Value::as_str)
        .ok_or_else(|| field("rope_type", "missing".into()))?;
    let num = |name: &str| -> Result<f32> {
        v.get(name)
            .and_then(Value::as_f64)
            .map(|x| x as f32)
            .ok_or_else(|| field(name, "missing or not a number".into()))
    };
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: num("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        },
        other => {
            return Err(field("rope_type", format!("`{other}` is not supported (linear, llama3 are)")));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "eos_token_id": [2, 3]})
    }

    #[test]
    fn reads_llama3_scaling_and_defaults() {
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        let c = ModelConfig::from_hf_value(&v, Path::new("config.json")).unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.eos_token_ids, vec![2, 3]);
        assert!(matches!(c.rope.scaling, RopeScaling::Llama3 { factor: 8.0, .. }));
        assert!(!c.qkv_bias && !c.tie_word_embeddings);
    }

    #[test]
    fn reads_rope_parameters_of_transformers_5() {
        let mut v = base();
        v.as_object_mut().unwrap().remove("rope_theta");
        v["rope_parameters"] = json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6});
        let c = ModelConfig::from_hf_value(&v, Path::new("config.json")).unwrap();
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 2.0 });
        v["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 5e5});
        let c = ModelConfig::from_hf_value(&v, Path::new("config.json")).unwrap();
        assert_eq!((c.rope.theta, c.rope.scaling), (5e5, RopeScaling::None));
    }

    #[test]
    fn errors_name_the_field() {
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        let e = ModelConfig::from_hf_value(&v, Path::new("m/config.json")).unwrap_err().to_string();
        assert!(e.contains("m/config.json") && e.contains("hidden_size"), "{e}");

        let mut v = base();
        v["num_key_value_heads"] = json!(3);
        let e = ModelConfig::from_hf_value(&v, Path::new("c.json")).unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");

        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        let e = ModelConfig::from_hf_value(&v, Path::new("c.json")).unwrap_err().to_string();
        assert!(e.contains("yarn"), "{e}");
    }
}
