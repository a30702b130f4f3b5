//! BERT encoders for sentence embeddings (all-MiniLM-L6-v2 and its kin),
//! over the same [`Backend`] trait as the decoder. Reads top to bottom:
//! Embeddings → SelfAttention → Layer → Bert → sentence embeddings.
//!
//! A batch of texts is one forward pass: the token rows of all texts are
//! concatenated and attention runs within each text's span, so no padding
//! is computed. Pooling follows the model's sentence-transformers config:
//! mean over tokens, then L2 normalisation.

use inferscale_model::{BertConfig, EncoderFiles, Pooling, Tokenizer};

use crate::backend::{AttentionShape, Backend};
use crate::error::{EngineError, Result};

struct Dense<B: Backend> {
    w: B::Tensor,
    b: B::Tensor,
}

impl<B: Backend> Dense<B> {
    fn load(be: &B, files: &EncoderFiles, name: &str, out: usize, inp: usize) -> Result<Self> {
        Ok(Dense {
            w: be.upload(&files.weights.load(&format!("{name}.weight"), &[out, inp])?)?,
            b: be.upload(&files.weights.load(&format!("{name}.bias"), &[out])?)?,
        })
    }

    fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.linear(x, &self.w, Some(&self.b))
    }
}

struct LayerNorm<B: Backend> {
    w: B::Tensor,
    b: B::Tensor,
    eps: f32,
}

impl<B: Backend> LayerNorm<B> {
    fn load(be: &B, files: &EncoderFiles, name: &str) -> Result<Self> {
        let h = files.config.hidden_size;
        Ok(LayerNorm {
            w: be.upload(&files.weights.load(&format!("{name}.weight"), &[h])?)?,
            b: be.upload(&files.weights.load(&format!("{name}.bias"), &[h])?)?,
            eps: files.config.layer_norm_eps,
        })
    }

    fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.layer_norm(x, &self.w, &self.b, self.eps)
    }
}

struct Embeddings<B: Backend> {
    word: B::Tensor,
    position: B::Tensor,
    token_type: B::Tensor,
    norm: LayerNorm<B>,
}

impl<B: Backend> Embeddings<B> {
    fn load(be: &B, files: &EncoderFiles) -> Result<Self> {
        let c = &files.config;
        let t = |name: &str, rows| -> Result<B::Tensor> {
            be.upload(&files.weights.load(&format!("embeddings.{name}.weight"), &[rows, c.hidden_size])?)
        };
        Ok(Embeddings {
            word: t("word_embeddings", c.vocab_size)?,
            position: t("position_embeddings", c.max_position_embeddings)?,
            token_type: t("token_type_embeddings", c.type_vocab_size)?,
            norm: LayerNorm::load(be, files, "embeddings.LayerNorm")?,
        })
    }

    /// Word + position (counted per text) + token type 0, normalised.
    fn forward(&self, be: &B, tokens: &[u32], positions: &[u32]) -> Result<B::Tensor> {
        let mut x = be.embedding(&self.word, tokens)?;
        be.add_assign(&mut x, &be.embedding(&self.position, positions)?)?;
        be.add_assign(&mut x, &be.embedding(&self.token_type, &vec![0; tokens.len()])?)?;
        self.norm.forward(be, &x)
    }
}

struct Layer<B: Backend> {
    query: Dense<B>,
    key: Dense<B>,
    value: Dense<B>,
    attn_out: Dense<B>,
    attn_norm: LayerNorm<B>,
    intermediate: Dense<B>,
    output: Dense<B>,
    out_norm: LayerNorm<B>,
}

impl<B: Backend> Layer<B> {
    fn load(be: &B, files: &EncoderFiles, l: usize) -> Result<Self> {
        let (h, i) = (files.config.hidden_size, files.config.intermediate_size);
        let p = |n: &str| format!("encoder.layer.{l}.{n}");
        Ok(Layer {
            query: Dense::load(be, files, &p("attention.self.query"), h, h)?,
            key: Dense::load(be, files, &p("attention.self.key"), h, h)?,
            value: Dense::load(be, files, &p("attention.self.value"), h, h)?,
            attn_out: Dense::load(be, files, &p("attention.output.dense"), h, h)?,
            attn_norm: LayerNorm::load(be, files, &p("attention.output.LayerNorm"))?,
            intermediate: Dense::load(be, files, &p("intermediate.dense"), i, h)?,
            output: Dense::load(be, files, &p("output.dense"), h, i)?,
            out_norm: LayerNorm::load(be, files, &p("output.LayerNorm"))?,
        })
    }

    /// Post-norm BERT layer: x = LN(x + attn(x)); x = LN(x + mlp(x)).
    fn forward(&self, be: &B, x: &B::Tensor, shape: AttentionShape, spans: &[(usize, usize)]) -> Result<B::Tensor> {
        let q = self.query.forward(be, x)?;
        let k = self.key.forward(be, x)?;
        let v = self.value.forward(be, x)?;
        let mut a = self.attn_out.forward(be, &be.attention_bidirectional(&q, &k, &v, shape, spans)?)?;
        be.add_assign(&mut a, x)?;
        let x = self.attn_norm.forward(be, &a)?;
        let mut y = self.output.forward(be, &be.gelu(&self.intermediate.forward(be, &x)?)?)?;
        be.add_assign(&mut y, &x)?;
        self.out_norm.forward(be, &y)
    }
}

/// A loaded BERT encoder with its tokenizer and pooling.
pub struct Bert<B: Backend> {
    config: BertConfig,
    pooling: Pooling,
    tokenizer: Tokenizer,
    embeddings: Embeddings<B>,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> Bert<B> {
    pub fn load(be: &B, files: EncoderFiles) -> Result<Self> {
        let embeddings = Embeddings::load(be, &files)?;
        let layers = (0..files.config.num_layers).map(|l| Layer::load(be, &files, l)).collect::<Result<_>>()?;
        Ok(Bert { config: files.config, pooling: files.pooling, tokenizer: files.tokenizer, embeddings, layers })
    }

    /// Width of the embeddings.
    pub fn dim(&self) -> usize {
        self.config.hidden_size
    }

    /// Token ids the model sees for `text`: `[CLS] … [SEP]`, cut to the
    /// model's `max_seq_length` as sentence-transformers does (the end is
    /// dropped, `[SEP]` kept).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.tokenizer.encode(text, true)?;
        let max = self.pooling.max_seq_length;
        if ids.len() > max
            && let Some(&sep) = ids.last()
        {
            ids.truncate(max - 1);
            ids.push(sep);
        }
        Ok(ids)
    }

    /// Sentence embeddings of `texts`, in one forward pass.
    pub fn embed(&self, be: &B, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        let ids: Vec<Vec<u32>> = texts.iter().map(|t| self.tokenize(t)).collect::<Result<_>>()?;
        self.embed_ids(be, &ids)
    }

    /// Sentence embeddings of pre-tokenized inputs (each non-empty, within
    /// `max_seq_length`).
    pub fn embed_ids(&self, be: &B, ids: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(ids.len());
        for t in ids {
            if t.is_empty() || t.len() > self.pooling.max_seq_length {
                return Err(EngineError::Shape(format!(
                    "encoder input of {} tokens (1..={} allowed)",
                    t.len(),
                    self.pooling.max_seq_length
                )));
            }
            if let Some(&id) = t.iter().find(|&&id| id as usize >= self.config.vocab_size) {
                return Err(EngineError::TokenOutOfRange { id, vocab: self.config.vocab_size });
            }
            spans.push((tokens.len(), t.len()));
            tokens.extend_from_slice(t);
            positions.extend(0..t.len() as u32);
        }
        let d = self.config.hidden_size / self.config.num_heads;
        let shape = AttentionShape {
            num_heads: self.config.num_heads,
            num_kv_heads: self.config.num_heads,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let mut x = self.embeddings.forward(be, &tokens, &positions)?;
        for layer in &self.layers {
            x = layer.forward(be, &x, shape, &spans)?;
        }
        let states = be.to_host(&x)?;
        let h = self.config.hidden_size;
        Ok(spans
            .iter()
            .map(|&(start, len)| pool(&states.data[start * h..(start + len) * h], h, self.pooling))
            .collect())
    }
}

/// Mean over token rows, then L2 normalisation if the model asks for it.
fn pool(rows: &[f32], h: usize, pooling: Pooling) -> Vec<f32> {
    let n = (rows.len() / h) as f32;
    let mut v = vec![0f32; h];
    for row in rows.chunks_exact(h) {
        for (a, x) in v.iter_mut().zip(row) {
            *a += x;
        }
    }
    v.iter_mut().for_each(|a| *a /= n);
    if pooling.normalize {
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
        v.iter_mut().for_each(|a| *a /= norm);
    }
    v
}
