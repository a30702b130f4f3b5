//! The Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM2): one
//! forward pass over the [`Backend`] trait, for every backend.
//!
//! Families differ only in what the config and the weights say: QKV bias
//! (Qwen2), tied embeddings, RoPE base and scaling, GQA ratio, head_dim.
//! Reads top to bottom: Linear → Attention → Mlp → Block → Llama.

use inferscale_model::{HostTensor, ModelConfig, ModelFiles};
use rayon::prelude::*;

use crate::backend::{AttentionShape, Backend, NewRows, SeqSpan, Tensors};
use crate::blend::{BlendRows, SELECT_LAYER};
use crate::error::{EngineError, Result};
use crate::rope::Rope;

/// What one forward pass computes: new tokens of several sequences,
/// concatenated, with their positions and cache slots.
#[derive(Debug, Clone, Default)]
pub struct ForwardBatch<'a> {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    /// Cache slot of each token (where its K and V are written).
    pub slots: Vec<u32>,
    pub spans: Vec<SeqSpan<'a>>,
    /// Rows whose logits are wanted (usually each sequence's last token).
    pub logit_rows: Vec<usize>,
    /// Rows whose pre-RoPE K and V to return from every layer (in order).
    pub capture: Vec<usize>,
    /// kv+blend: rows recomputing injected tokens, some of which stop after
    /// a layer (`crate::blend`). Not combined with `capture`.
    pub blend: Option<BlendRows>,
}

/// What a forward pass returns.
pub struct ForwardOutput<B: Backend> {
    /// `[logit_rows, vocab]`, or `None` when no logits were asked for.
    pub logits: Option<B::Tensor>,
    /// Per layer, the captured rows' pre-RoPE K and V (`[rows, kv_heads·head_dim]`).
    pub captured: Option<Vec<(B::Tensor, B::Tensor)>>,
    /// With a narrowing blend: the rows that went through every layer.
    pub kept: Option<Vec<usize>>,
}

/// Per-layer view of the forward in progress.
struct Step<'s, 'a> {
    batch: &'s ForwardBatch<'a>,
    rope: &'s Rope,
    layer: usize,
}

struct Linear<B: Backend> {
    w: B::Tensor,
    b: Option<B::Tensor>,
}

impl<B: Backend> Linear<B> {
    fn load(be: &B, files: &ModelFiles, name: &str, out: usize, inp: usize, bias: bool) -> Result<Self> {
        Self::load_fused(be, files, &[(name, out)], inp, bias)
    }

    /// Several projections of the same input stacked into one matrix (Q, K
    /// and V; gate and up), so that one GEMM reads them all: fewer launches,
    /// and wide matrices keep a GPU busy where thin ones would not.
    fn load_fused(be: &B, files: &ModelFiles, parts: &[(&str, usize)], inp: usize, bias: bool) -> Result<Self> {
        let out: usize = parts.iter().map(|p| p.1).sum();
        let mut ws = Vec::with_capacity(parts.len());
        let mut b = Vec::with_capacity(if bias { out } else { 0 });
        for &(name, rows) in parts {
            ws.push(files.weights.load(&format!("{name}.weight"), &[rows, inp])?.data);
            if bias {
                b.extend(files.weights.load(&format!("{name}.bias"), &[rows])?.data);
            }
        }
        let w = be.upload(&HostTensor { shape: vec![out, inp], data: concat(ws) })?;
        let b = if bias { Some(be.upload(&HostTensor { shape: vec![out], data: b })?) } else { None };
        Ok(Linear { w, b })
    }

    fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.linear(x, &self.w, self.b.as_ref())
    }
}

/// The matrices of a fused projection stacked: a lone one as it is, several
/// copied into one buffer by every core. An 8B model's weights are 32 GB of
/// f32 on their way to the device, and one thread copying them (faulting
/// in each fresh page) took longer than generating, converting and
/// uploading them together (docs/performance.md, "Loading weights").
fn concat(mut parts: Vec<Vec<f32>>) -> Vec<f32> {
    if parts.len() == 1 {
        return parts.pop().unwrap_or_default();
    }
    const CHUNK: usize = 1 << 16;
    let mut out = vec![0f32; parts.iter().map(Vec::len).sum()];
    let mut rest = &mut out[..];
    for p in &parts {
        let (dst, tail) = rest.split_at_mut(p.len());
        dst.par_chunks_mut(CHUNK).zip(p.par_chunks(CHUNK)).for_each(|(d, s)| d.copy_from_slice(s));
        rest = tail;
    }
    out
}

fn load_vector<B: Backend>(be: &B, files: &ModelFiles, name: &str, len: usize) -> Result<B::Tensor> {
    be.upload(&files.weights.load(name, &[len])?)
}

struct Attention<B: Backend> {
    /// q_proj, k_proj and v_proj stacked.
    qkv_proj: Linear<B>,
    o_proj: Linear<B>,
    widths: [usize; 3],
    shape: AttentionShape,
}

impl<B: Backend> Attention<B> {
    fn load(be: &B, files: &ModelFiles, prefix: &str) -> Result<Self> {
        let c = &files.config;
        let p = |n: &str| format!("{prefix}.self_attn.{n}");
        Ok(Attention {
            qkv_proj: Linear::load_fused(
                be,
                files,
                &[(&p("q_proj"), c.q_dim()), (&p("k_proj"), c.kv_dim()), (&p("v_proj"), c.kv_dim())],
                c.hidden_size,
                c.qkv_bias,
            )?,
            o_proj: Linear::load(be, files, &p("o_proj"), c.hidden_size, c.q_dim(), false)?,
            widths: [c.q_dim(), c.kv_dim(), c.kv_dim()],
            shape: AttentionShape {
                num_heads: c.num_heads,
                num_kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
                scale: 1.0 / (c.head_dim as f32).sqrt(),
            },
        })
    }

    /// The attention output, and the captured rows' pre-RoPE K and V if asked.
    fn forward(
        &self,
        be: &B,
        x: &B::Tensor,
        step: &Step<'_, '_>,
        kv: &mut B::KvStore,
    ) -> Result<(B::Tensor, Option<LayerKv<B>>)> {
        let d = self.shape.head_dim;
        let (batch, rope, layer) = (step.batch, step.rope, step.layer);
        if batch.capture.is_empty() {
            let q = self.write_kv(be, x, step, kv)?;
            return Ok((self.attend(be, &q, &batch.spans, layer, kv)?, None));
        }
        let qkv = self.qkv_proj.forward(be, x)?;
        let [mut q, mut k, v]: [B::Tensor; 3] = be
            .split_cols(&qkv, &self.widths)?
            .try_into()
            .map_err(|_| crate::error::EngineError::Shape("split_cols returned the wrong number of parts".into()))?;
        let captured = Some((be.select_rows(&k, &batch.capture)?, be.select_rows(&v, &batch.capture)?));
        be.rope(&mut q, d, &batch.positions, rope)?;
        be.rope(&mut k, d, &batch.positions, rope)?;
        be.write_kv(kv, layer, &k, &v, NewRows { positions: &batch.positions, slots: &batch.slots }, rope)?;
        let y = be.attention(&q, kv, layer, self.shape, &batch.spans)?;
        Ok((self.o_proj.forward(be, &y)?, captured))
    }

    /// Projects every row, writes its K and V (rotated) into the cache and
    /// returns its Q (rotated): the first half of `forward`.
    fn write_kv(&self, be: &B, x: &B::Tensor, step: &Step<'_, '_>, kv: &mut B::KvStore) -> Result<B::Tensor> {
        let qkv = self.qkv_proj.forward(be, x)?;
        let rows = NewRows { positions: &step.batch.positions, slots: &step.batch.slots };
        be.qkv_rope_write(&qkv, self.shape, step.rope, rows, kv, step.layer)
    }

    /// Attention of `q` over the cache of `layer`, projected back: the
    /// second half of `forward`.
    fn attend(&self, be: &B, q: &B::Tensor, spans: &[SeqSpan<'_>], layer: usize, kv: &B::KvStore) -> Result<B::Tensor> {
        let y = be.attention(q, kv, layer, self.shape, spans)?;
        self.o_proj.forward(be, &y)
    }
}

/// One layer's (K, V).
pub type LayerKv<B> = (<B as Tensors>::Tensor, <B as Tensors>::Tensor);

struct Mlp<B: Backend> {
    /// gate_proj and up_proj stacked.
    gate_up_proj: Linear<B>,
    down_proj: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn load(be: &B, files: &ModelFiles, prefix: &str) -> Result<Self> {
        let c = &files.config;
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Ok(Mlp {
            gate_up_proj: Linear::load_fused(
                be,
                files,
                &[(&format!("{prefix}.mlp.gate_proj"), i), (&format!("{prefix}.mlp.up_proj"), i)],
                h,
                false,
            )?,
            down_proj: Linear::load(be, files, &format!("{prefix}.mlp.down_proj"), h, i, false)?,
        })
    }

    fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let act = be.linear_silu_mul(x, &self.gate_up_proj.w, self.gate_up_proj.b.as_ref())?;
        self.down_proj.forward(be, &act)
    }
}

struct Block<B: Backend> {
    input_layernorm: B::Tensor,
    attn: Attention<B>,
    post_attention_layernorm: B::Tensor,
    mlp: Mlp<B>,
    eps: f32,
}

impl<B: Backend> Block<B> {
    fn load(be: &B, files: &ModelFiles, layer: usize) -> Result<Self> {
        let prefix = format!("model.layers.{layer}");
        let h = files.config.hidden_size;
        Ok(Block {
            input_layernorm: load_vector(be, files, &format!("{prefix}.input_layernorm.weight"), h)?,
            attn: Attention::load(be, files, &prefix)?,
            post_attention_layernorm: load_vector(be, files, &format!("{prefix}.post_attention_layernorm.weight"), h)?,
            mlp: Mlp::load(be, files, &prefix)?,
            eps: files.config.rms_norm_eps,
        })
    }

    /// Adds the previous block's MLP output (`pending`) to the residual
    /// stream `x` — fused with this block's first norm — and returns this
    /// block's MLP output, for the next block (or the final norm) to add.
    fn forward(
        &self,
        be: &B,
        x: &mut B::Tensor,
        pending: Option<B::Tensor>,
        step: &Step<'_, '_>,
        kv: &mut B::KvStore,
    ) -> Result<(B::Tensor, Option<LayerKv<B>>)> {
        let h = self.norm_in(be, x, pending)?;
        let (attn, captured) = self.attn.forward(be, &h, step, kv)?;
        Ok((self.finish(be, x, &attn)?, captured))
    }

    /// `x += pending`, then the attention's input norm of `x`.
    fn norm_in(&self, be: &B, x: &mut B::Tensor, pending: Option<B::Tensor>) -> Result<B::Tensor> {
        match pending {
            Some(p) => be.add_rms_norm(x, &p, &self.input_layernorm, self.eps),
            None => be.rms_norm(x, &self.input_layernorm, self.eps),
        }
    }

    /// `x += attn`, then the MLP of its norm (returned, for the next block to add).
    fn finish(&self, be: &B, x: &mut B::Tensor, attn: &B::Tensor) -> Result<B::Tensor> {
        let h = be.add_rms_norm(x, attn, &self.post_attention_layernorm, self.eps)?;
        self.mlp.forward(be, &h)
    }
}

/// A loaded Llama-family model on backend `B`.
pub struct Llama<B: Backend> {
    config: ModelConfig,
    embed_tokens: B::Tensor,
    blocks: Vec<Block<B>>,
    norm: B::Tensor,
    /// `None` when the output projection is tied to the embeddings.
    lm_head: Option<B::Tensor>,
    rope: Rope,
}

impl<B: Backend> Llama<B> {
    pub fn load(be: &B, files: &ModelFiles) -> Result<Self> {
        let c = &files.config;
        let embed_tokens =
            be.upload(&files.weights.load("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])?)?;
        let blocks = (0..c.num_layers).map(|l| Block::load(be, files, l)).collect::<Result<_>>()?;
        let norm = load_vector(be, files, "model.norm.weight", c.hidden_size)?;
        // Some checkpoints mark embeddings tied yet still ship lm_head; the
        // tensor wins when present, as in HF.
        let lm_head = if c.tie_word_embeddings && !files.weights.contains("lm_head.weight") {
            None
        } else {
            Some(be.upload(&files.weights.load("lm_head.weight", &[c.vocab_size, c.hidden_size])?)?)
        };
        Ok(Llama { config: c.clone(), embed_tokens, blocks, norm, lm_head, rope: Rope::new(&c.rope) })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// Runs the batch through every layer, writing its K and V into `kv`;
    /// returns the logits of `batch.logit_rows` and the captured KV.
    pub fn forward(&self, be: &B, batch: &ForwardBatch<'_>, kv: &mut B::KvStore) -> Result<ForwardOutput<B>> {
        let mut x = be.embedding(&self.embed_tokens, &batch.tokens)?;
        let mut pending = None;
        let Some(blend) = batch.blend.as_ref().filter(|b| b.narrows()) else {
            let all = 0..self.blocks.len();
            let layer_kvs = self.layers(be, batch, all, &mut x, &mut pending, kv)?;
            let captured = (!batch.capture.is_empty()).then_some(layer_kvs);
            return self.head(be, batch, x, pending, captured, None);
        };
        if !batch.capture.is_empty() {
            return Err(EngineError::Shape("a blend pass cannot capture KV".into()));
        }
        // Every candidate through the layers before the selection layer and
        // into its K and V, where the request's rank (the distance of its
        // values from the injected ones, or the question's attention to its
        // key) picks the rows that go on. Rows that stop need nothing more
        // of that layer than their K and V: the selection layer's attention
        // and MLP run on the kept rows only.
        let s = SELECT_LAYER.min(self.blocks.len() - 1);
        self.layers(be, batch, 0..s, &mut x, &mut pending, kv)?;
        let slots: Vec<u32> = blend.rows().iter().map(|&r| batch.slots[r]).collect();
        let injected = blend.ranks_by_deviation().then(|| be.gather_kv(kv, s, &slots)).transpose()?;
        let block = &self.blocks[s];
        let h = block.norm_in(be, &mut x, pending.take())?;
        let q = block.attn.write_kv(be, &h, &Step { batch, rope: &self.rope, layer: s }, kv)?;
        let (fresh_k, fresh_v) = be.gather_kv(kv, s, &slots)?;
        let deviation = injected.map(|(_, v)| be.row_sq_distance(&fresh_v, &v)).transpose()?;
        let scores = blend.scores(be, &q, &fresh_k, deviation.as_deref(), block.attn.shape)?;
        let kept = blend.kept(batch.tokens.len(), &scores)?;
        let narrowed = Narrowed::new(batch, &kept)?;
        let rest = narrowed.batch(batch);
        let mut x = be.select_rows(&x, &kept)?;
        let attn = block.attn.attend(be, &be.select_rows(&q, &kept)?, &rest.spans, s, kv)?;
        let mut pending = Some(block.finish(be, &mut x, &attn)?);
        self.layers(be, &rest, s + 1..self.blocks.len(), &mut x, &mut pending, kv)?;
        self.head(be, &rest, x, pending, None, Some(kept))
    }

    /// Runs `batch` through `layers`, threading the residual stream `x` and
    /// the last block's MLP output not yet added to it (`pending`); returns
    /// the K and V each layer captured (none unless `batch.capture` asks).
    fn layers(
        &self,
        be: &B,
        batch: &ForwardBatch<'_>,
        layers: std::ops::Range<usize>,
        x: &mut B::Tensor,
        pending: &mut Option<B::Tensor>,
        kv: &mut B::KvStore,
    ) -> Result<Vec<LayerKv<B>>> {
        let mut captured = Vec::new();
        for layer in layers {
            let step = Step { batch, rope: &self.rope, layer };
            let (mlp, layer_kv) = self.blocks[layer].forward(be, x, pending.take(), &step, kv)?;
            *pending = Some(mlp);
            captured.extend(layer_kv);
        }
        Ok(captured)
    }

    /// The final norm and the output head over `batch.logit_rows`.
    fn head(
        &self,
        be: &B,
        batch: &ForwardBatch<'_>,
        mut x: B::Tensor,
        pending: Option<B::Tensor>,
        captured: Option<Vec<LayerKv<B>>>,
        kept: Option<Vec<usize>>,
    ) -> Result<ForwardOutput<B>> {
        let logits = if batch.logit_rows.is_empty() {
            None
        } else {
            if let Some(p) = pending {
                be.add_assign(&mut x, &p)?;
            }
            // Every row in order (a decode step) needs no selection.
            let every_row = batch.logit_rows.iter().copied().eq(0..be.dims(&x).0);
            let x = if every_row { x } else { be.select_rows(&x, &batch.logit_rows)? };
            let x = be.rms_norm(&x, &self.norm, self.config.rms_norm_eps)?;
            Some(be.linear(&x, self.lm_head.as_ref().unwrap_or(&self.embed_tokens), None)?)
        };
        Ok(ForwardOutput { logits, captured, kept })
    }
}

/// A forward batch after some rows stopped: the metadata of the rows that
/// go on, with per-row ends for every span (its rows are no longer the
/// cache's last entries). Owns what the narrowed [`ForwardBatch`] borrows.
pub(crate) struct Narrowed {
    positions: Vec<u32>,
    slots: Vec<u32>,
    logit_rows: Vec<usize>,
    /// Per remaining span: (index in the original batch, first row, ends).
    spans: Vec<(usize, usize, Vec<u32>)>,
}

impl Narrowed {
    /// `kept`: ascending rows of `batch`, holding every logit row.
    pub fn new(batch: &ForwardBatch<'_>, kept: &[usize]) -> Result<Self> {
        let mut new_index = vec![usize::MAX; batch.tokens.len()];
        for (i, &r) in kept.iter().enumerate() {
            new_index[r] = i;
        }
        let logit_rows = batch
            .logit_rows
            .iter()
            .map(|&r| match new_index[r] {
                usize::MAX => Err(EngineError::Shape(format!("blend dropped logit row {r}"))),
                i => Ok(i),
            })
            .collect::<Result<_>>()?;
        let mut spans = Vec::new();
        for (si, s) in batch.spans.iter().enumerate() {
            let rows: Vec<usize> = (0..s.q_len).filter(|&r| new_index[s.q_start + r] != usize::MAX).collect();
            if let Some(&first) = rows.first() {
                let ends = rows.iter().map(|&r| s.row_end(r) as u32).collect();
                spans.push((si, new_index[s.q_start + first], ends));
            }
        }
        Ok(Narrowed {
            positions: kept.iter().map(|&r| batch.positions[r]).collect(),
            slots: kept.iter().map(|&r| batch.slots[r]).collect(),
            logit_rows,
            spans,
        })
    }

    /// The narrowed batch (block tables and context lengths from `batch`).
    pub fn batch<'a>(&'a self, batch: &ForwardBatch<'a>) -> ForwardBatch<'a> {
        let spans = self
            .spans
            .iter()
            .map(|(si, q_start, ends)| {
                let s = &batch.spans[*si];
                SeqSpan {
                    q_start: *q_start,
                    q_len: ends.len(),
                    context_len: s.context_len,
                    block_table: s.block_table,
                    row_ends: Some(ends),
                }
            })
            .collect();
        ForwardBatch {
            tokens: Vec::new(),
            positions: self.positions.clone(),
            slots: self.slots.clone(),
            spans,
            logit_rows: self.logit_rows.clone(),
            capture: Vec::new(),
            blend: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowing_keeps_row_ends_and_remaps_logit_rows() {
        let table = [0u32, 1, 2];
        let batch = ForwardBatch {
            tokens: (0..8).collect(),
            positions: (10..18).collect(),
            slots: (20..28).collect(),
            // Sequence A: 3 injected tokens recomputed in place (cache
            // 4..7) then a 2-token question (7..9); sequence B: one decode.
            spans: vec![
                SeqSpan { q_start: 0, q_len: 5, context_len: 9, block_table: &table, row_ends: Some(&[5, 6, 7, 8, 9]) },
                SeqSpan { q_start: 5, q_len: 3, context_len: 30, block_table: &table, row_ends: None },
            ],
            logit_rows: vec![4, 7],
            capture: Vec::new(),
            blend: None,
        };
        let n = Narrowed::new(&batch, &[1, 3, 4, 5, 6, 7]).unwrap();
        let b = n.batch(&batch);
        assert_eq!(b.positions, vec![11, 13, 14, 15, 16, 17]);
        assert_eq!(b.slots, vec![21, 23, 24, 25, 26, 27]);
        assert_eq!(b.logit_rows, vec![2, 5]);
        assert_eq!((b.spans[0].q_start, b.spans[0].q_len, b.spans[0].row_ends), (0, 3, Some(&[6, 8, 9][..])));
        assert_eq!((b.spans[1].q_start, b.spans[1].q_len, b.spans[1].row_ends), (3, 3, Some(&[28, 29, 30][..])));
        assert!(Narrowed::new(&batch, &[0, 1, 2, 3, 5, 6, 7]).is_err(), "a logit row was dropped");
    }

    #[test]
    fn fused_weights_are_stacked_in_order() {
        let (a, b, c): (Vec<f32>, Vec<f32>, Vec<f32>) =
            ((0..150_000).map(|x| x as f32).collect(), vec![-1.0; 70_001], vec![-2.0, -3.0]);
        let want: Vec<f32> = a.iter().chain(&b).chain(&c).copied().collect();
        assert_eq!(concat(vec![a.clone(), b, c]), want);
        assert_eq!(concat(vec![a.clone()]), a);
        assert_eq!(concat(vec![Vec::new(), vec![4.0]]), vec![4.0]);
    }
}
