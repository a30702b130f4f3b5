//! A plain dense forward pass with an arbitrary attention mask: the
//! reference for E3 (block-diagonal attention). It shares only the weights,
//! the validated GEMM and RoPE frequencies with the engine; masking,
//! attention, norms and the layer wiring are written out here again.

use inferscale_engine::cpu::matmul_bt;
use inferscale_engine::rope::Rope;
use inferscale_model::ModelFiles;

/// What [`Dense::forward_blend`] computes.
#[derive(Default)]
pub struct BlendReference {
    /// Stream B's logits, one row per token.
    pub logits: Vec<Vec<f32>>,
    /// Per layer, per token: `Σ (v_B − v_A)²`.
    pub deviation: Vec<Vec<f32>>,
    /// Per layer: stream B's rotated queries and keys, `[tokens, width]`.
    pub q: Vec<Vec<f32>>,
    pub k: Vec<Vec<f32>>,
}

/// Per-layer weights, as HostTensor data.
struct Layer {
    ln1: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    o: Vec<f32>,
    ln2: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

pub struct Dense {
    files_cfg: inferscale_model::ModelConfig,
    embed: Vec<f32>,
    lm_head: Vec<f32>,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: Rope,
}

fn linear(x: &[f32], w: &[f32], b: Option<&Vec<f32>>, n: usize, out: usize, inp: usize) -> Vec<f32> {
    let mut y = vec![0f32; n * out];
    matmul_bt(&mut y, x, w, n, out, inp);
    if let Some(b) = b {
        for row in y.chunks_exact_mut(out) {
            for (a, b) in row.iter_mut().zip(b) {
                *a += b;
            }
        }
    }
    y
}

fn rms(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut y = vec![0f32; x.len()];
    for (o, r) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        let ms = r.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for i in 0..d {
            o[i] = w[i] * (r[i] * inv);
        }
    }
    y
}

fn rotate(x: &mut [f32], head_dim: usize, positions: &[u32], rope: &Rope) {
    let width = x.len() / positions.len();
    let half = rope.dim() / 2;
    for (row, &p) in x.chunks_exact_mut(width).zip(positions) {
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let a = p as f32 * rope.inv_freq()[i];
                let (c, s) = (a.cos(), a.sin());
                let (x1, x2) = (head[i], head[i + half]);
                head[i] = x1 * c - x2 * s;
                head[i + half] = x2 * c + x1 * s;
            }
        }
    }
}

impl Dense {
    pub fn load(files: &ModelFiles) -> Dense {
        let c = files.config.clone();
        let w = |name: &str, shape: &[usize]| files.weights.load(name, shape).unwrap().data;
        let (h, qd, kd, i) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let layers = (0..c.num_layers)
            .map(|l| {
                let p = |n: &str| format!("model.layers.{l}.{n}");
                let bias = |n: &str, len| c.qkv_bias.then(|| w(&p(n), &[len]));
                Layer {
                    ln1: w(&p("input_layernorm.weight"), &[h]),
                    q: w(&p("self_attn.q_proj.weight"), &[qd, h]),
                    k: w(&p("self_attn.k_proj.weight"), &[kd, h]),
                    v: w(&p("self_attn.v_proj.weight"), &[kd, h]),
                    bq: bias("self_attn.q_proj.bias", qd),
                    bk: bias("self_attn.k_proj.bias", kd),
                    bv: bias("self_attn.v_proj.bias", kd),
                    o: w(&p("self_attn.o_proj.weight"), &[h, qd]),
                    ln2: w(&p("post_attention_layernorm.weight"), &[h]),
                    gate: w(&p("mlp.gate_proj.weight"), &[i, h]),
                    up: w(&p("mlp.up_proj.weight"), &[i, h]),
                    down: w(&p("mlp.down_proj.weight"), &[h, i]),
                }
            })
            .collect();
        let embed = w("model.embed_tokens.weight", &[c.vocab_size, h]);
        let lm_head = if files.weights.contains("lm_head.weight") {
            w("lm_head.weight", &[c.vocab_size, h])
        } else {
            embed.clone()
        };
        Dense { norm: w("model.norm.weight", &[h]), rope: Rope::new(&c.rope), files_cfg: c, embed, lm_head, layers }
    }

    /// Logits of every row, with `mask(i, j)` saying whether row i attends to row j.
    pub fn forward(&self, tokens: &[u32], positions: &[u32], mask: impl Fn(usize, usize) -> bool) -> Vec<Vec<f32>> {
        let mut x = self.embed(tokens);
        for l in &self.layers {
            let (q, k, v) = self.qkv(l, &x, positions);
            let att = self.attend(&q, &k, &v, &mask);
            self.finish_layer(l, &mut x, &att);
        }
        self.logits(&x)
    }

    /// kv+blend's reference. Stream A is the prompt under `kv_mask` — what
    /// the injected KV was computed with (E3). Stream B computes, at each
    /// layer, the rows `recompute(layer, row)` names, attending causally
    /// over B's keys and values for those rows and A's for the others (the
    /// injected entries). Returns B's logits of every row and, per layer,
    /// each row's `Σ (v_B − v_A)²` (the deviation rank) and B's rotated
    /// queries and keys as computed, before any row is replaced by A's (what
    /// the question rank reads).
    pub fn forward_blend(
        &self,
        tokens: &[u32],
        positions: &[u32],
        kv_mask: impl Fn(usize, usize) -> bool,
        recompute: impl Fn(usize, usize) -> bool,
    ) -> BlendReference {
        let kd = self.files_cfg.kv_dim();
        let (mut xa, mut xb) = (self.embed(tokens), self.embed(tokens));
        let mut r = BlendReference::default();
        for (li, l) in self.layers.iter().enumerate() {
            let (qa, ka, va) = self.qkv(l, &xa, positions);
            let att = self.attend(&qa, &ka, &va, &kv_mask);
            self.finish_layer(l, &mut xa, &att);
            let (qb, mut kb, mut vb) = self.qkv(l, &xb, positions);
            let dev = (0..tokens.len())
                .map(|j| {
                    vb[j * kd..(j + 1) * kd].iter().zip(&va[j * kd..(j + 1) * kd]).map(|(b, a)| (b - a) * (b - a)).sum()
                })
                .collect();
            r.deviation.push(dev);
            r.q.push(qb.clone());
            r.k.push(kb.clone());
            for j in (0..tokens.len()).filter(|&j| !recompute(li, j)) {
                kb[j * kd..(j + 1) * kd].copy_from_slice(&ka[j * kd..(j + 1) * kd]);
                vb[j * kd..(j + 1) * kd].copy_from_slice(&va[j * kd..(j + 1) * kd]);
            }
            let att = self.attend(&qb, &kb, &vb, &|i: usize, j: usize| j <= i);
            self.finish_layer(l, &mut xb, &att);
        }
        r.logits = self.logits(&xb);
        r
    }

    /// The attention the query rows `queries` of `q` pay each key row of
    /// `k` in `keys`: per row and head, a softmax over those keys alone,
    /// summed (kv+blend's question rank, written out again).
    pub fn attention_mass(&self, q: &[f32], k: &[f32], queries: &[usize], keys: &[usize]) -> Vec<f32> {
        let c = &self.files_cfg;
        let (d, qd, kd) = (c.head_dim, c.q_dim(), c.kv_dim());
        let group = c.num_heads / c.num_kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        let mut mass = vec![0f32; keys.len()];
        for &i in queries {
            for head in 0..c.num_heads {
                let qi = &q[i * qd + head * d..][..d];
                let kh = head / group;
                let logits: Vec<f32> = keys
                    .iter()
                    .map(|&j| qi.iter().zip(&k[j * kd + kh * d..][..d]).map(|(a, b)| a * b).sum::<f32>() * scale)
                    .collect();
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = logits.iter().map(|x| (x - max).exp()).sum();
                for (m, x) in mass.iter_mut().zip(&logits) {
                    *m += (x - max).exp() / sum;
                }
            }
        }
        mass
    }

    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let h = self.files_cfg.hidden_size;
        tokens.iter().flat_map(|&t| self.embed[t as usize * h..(t as usize + 1) * h].to_vec()).collect()
    }

    /// Q and K rotated to `positions`, and V.
    fn qkv(&self, l: &Layer, x: &[f32], positions: &[u32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = &self.files_cfg;
        let (n, h, d) = (positions.len(), c.hidden_size, c.head_dim);
        let hn = rms(x, &l.ln1, c.rms_norm_eps);
        let mut q = linear(&hn, &l.q, l.bq.as_ref(), n, c.q_dim(), h);
        let mut k = linear(&hn, &l.k, l.bk.as_ref(), n, c.kv_dim(), h);
        let v = linear(&hn, &l.v, l.bv.as_ref(), n, c.kv_dim(), h);
        rotate(&mut q, d, positions, &self.rope);
        rotate(&mut k, d, positions, &self.rope);
        (q, k, v)
    }

    /// Softmax attention of every row over the rows `mask` lets it see.
    fn attend(&self, q: &[f32], k: &[f32], v: &[f32], mask: &impl Fn(usize, usize) -> bool) -> Vec<f32> {
        let c = &self.files_cfg;
        let (d, qd, kd) = (c.head_dim, c.q_dim(), c.kv_dim());
        let n = q.len() / qd;
        let group = c.num_heads / c.num_kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        let mut att = vec![0f32; n * qd];
        for head in 0..c.num_heads {
            let kh = head / group;
            for i in 0..n {
                let qi = &q[i * qd + head * d..i * qd + head * d + d];
                let mut w: Vec<(usize, f32)> = (0..n)
                    .filter(|&j| mask(i, j))
                    .map(|j| {
                        let kj = &k[j * kd + kh * d..j * kd + kh * d + d];
                        (j, qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale)
                    })
                    .collect();
                let max = w.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = w
                    .iter_mut()
                    .map(|x| {
                        x.1 = (x.1 - max).exp();
                        x.1
                    })
                    .sum();
                let out = &mut att[i * qd + head * d..i * qd + head * d + d];
                for (j, p) in w {
                    let vj = &v[j * kd + kh * d..j * kd + kh * d + d];
                    for (o, vv) in out.iter_mut().zip(vj) {
                        *o += p / sum * vv;
                    }
                }
            }
        }
        att
    }

    /// The output projection and the MLP, each added to the residual `x`.
    fn finish_layer(&self, l: &Layer, x: &mut [f32], att: &[f32]) {
        let c = &self.files_cfg;
        let (h, qd, inter) = (c.hidden_size, c.q_dim(), c.intermediate_size);
        let n = x.len() / h;
        let o = linear(att, &l.o, None, n, h, qd);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let hn = rms(x, &l.ln2, c.rms_norm_eps);
        let g = linear(&hn, &l.gate, None, n, inter, h);
        let u = linear(&hn, &l.up, None, n, inter, h);
        let act: Vec<f32> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        let dn = linear(&act, &l.down, None, n, h, inter);
        x.iter_mut().zip(&dn).for_each(|(a, b)| *a += b);
    }

    fn logits(&self, x: &[f32]) -> Vec<Vec<f32>> {
        let c = &self.files_cfg;
        let n = x.len() / c.hidden_size;
        let xn = rms(x, &self.norm, c.rms_norm_eps);
        let logits = linear(&xn, &self.lm_head, None, n, c.vocab_size, c.hidden_size);
        logits.chunks_exact(c.vocab_size).map(|r| r.to_vec()).collect()
    }
}
