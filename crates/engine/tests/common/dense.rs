//! A plain dense forward pass with an arbitrary attention mask: the
//! reference for E3 (block-diagonal attention). It shares only the weights,
//! the validated GEMM and RoPE frequencies with the engine; masking,
//! attention, norms and the layer wiring are written out here again.

use inferscale_engine::cpu::matmul_bt;
use inferscale_engine::rope::Rope;
use inferscale_model::ModelFiles;

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
        let c = &self.files_cfg;
        let (n, h, d) = (tokens.len(), c.hidden_size, c.head_dim);
        let (qd, kd, inter) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
        let group = c.num_heads / c.num_kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        let mut x: Vec<f32> =
            tokens.iter().flat_map(|&t| self.embed[t as usize * h..(t as usize + 1) * h].to_vec()).collect();
        for l in &self.layers {
            let hn = rms(&x, &l.ln1, c.rms_norm_eps);
            let mut q = linear(&hn, &l.q, l.bq.as_ref(), n, qd, h);
            let mut k = linear(&hn, &l.k, l.bk.as_ref(), n, kd, h);
            let v = linear(&hn, &l.v, l.bv.as_ref(), n, kd, h);
            rotate(&mut q, d, positions, &self.rope);
            rotate(&mut k, d, positions, &self.rope);
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
            let o = linear(&att, &l.o, None, n, h, qd);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let hn = rms(&x, &l.ln2, c.rms_norm_eps);
            let g = linear(&hn, &l.gate, None, n, inter, h);
            let u = linear(&hn, &l.up, None, n, inter, h);
            let act: Vec<f32> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let dn = linear(&act, &l.down, None, n, h, inter);
            x.iter_mut().zip(&dn).for_each(|(a, b)| *a += b);
        }
        let xn = rms(&x, &self.norm, c.rms_norm_eps);
        let logits = linear(&xn, &self.lm_head, None, n, c.vocab_size, h);
        logits.chunks_exact(c.vocab_size).map(|r| r.to_vec()).collect()
    }
}
