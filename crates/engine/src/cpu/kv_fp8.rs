//! The CPU's fp8 paged cache (`--kv-cache-dtype fp8`, docs/design.md §2.2):
//! e4m3 codes in the f32 store's layout, a scale per (slot, KV head), each
//! slot's RoPE position, and per layer the key offsets the keys are stored
//! relative to. The row arithmetic is [`crate::fp8_cache`]'s, shared with
//! the device kernels to come.
//!
//! A key at position p is kept as the codes of `R(p)·(k − o)`; reading it
//! back adds `R(p)·o`, rotated from the layer's offset by the slot's
//! position. The CPU's attention reads keys as f32 rows, so it adds the
//! rotated offset to each key as it decodes it — the same sum as adding
//! `q·R(p)·o` to each score ([`crate::fp8_cache::OffsetScore`], what a
//! kernel reading codes does), once per key instead of once per query.

use rayon::prelude::*;

use super::kv_store::LayerChunk;
use crate::backend::KvSpec;
use crate::error::{EngineError, Result};
use crate::fp8_cache::{decode_row_adding, encode_key_row, encode_row};
use crate::rope::Rope;

#[derive(Debug)]
pub(crate) struct Fp8Store {
    /// Per layer, codes `[kv_heads, capacity, head_dim]` (the f32 store's layout).
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
    /// Per layer, one scale per `[kv_heads, capacity]` row.
    k_scale: Vec<Vec<f32>>,
    v_scale: Vec<Vec<f32>>,
    /// Each slot's RoPE position: what its key's offset was rotated to.
    positions: Vec<u32>,
    /// Per layer, the key offsets `[kv_dim]` before RoPE (zeros until
    /// calibrated: plain rounding).
    offsets: Vec<Vec<f32>>,
    /// The rotation the offsets turn with (set at calibration).
    rope: Option<Rope>,
    /// Whether any key has been written (calibration must come first).
    written: bool,
}

impl Fp8Store {
    pub(crate) fn new(spec: KvSpec) -> Self {
        let (cap, dim) = (spec.capacity(), spec.kv_dim());
        let layers = spec.num_layers;
        Fp8Store {
            k: (0..layers).map(|_| vec![0u8; cap * dim]).collect(),
            v: (0..layers).map(|_| vec![0u8; cap * dim]).collect(),
            k_scale: (0..layers).map(|_| vec![1f32; cap * spec.num_kv_heads]).collect(),
            v_scale: (0..layers).map(|_| vec![1f32; cap * spec.num_kv_heads]).collect(),
            positions: vec![0; cap],
            offsets: vec![vec![0f32; dim]; layers],
            rope: None,
            written: false,
        }
    }

    pub(crate) fn calibrate(&mut self, spec: KvSpec, offsets: &[Vec<f32>], rope: &Rope) -> Result<()> {
        if self.written {
            return Err(EngineError::Shape(
                "fp8 KV cache: calibrated after keys were written (they were stored against other offsets)".into(),
            ));
        }
        if offsets.len() != spec.num_layers || offsets.iter().any(|o| o.len() != spec.kv_dim()) {
            return Err(EngineError::Shape(format!(
                "fp8 KV cache: {} offset rows for {} layers of width {}",
                offsets.len(),
                spec.num_layers,
                spec.kv_dim()
            )));
        }
        if let Some(bad) = offsets.iter().position(|o| o.iter().any(|x| !x.is_finite())) {
            return Err(EngineError::Shape(format!("fp8 KV cache: layer {bad}'s key offsets are not finite")));
        }
        self.offsets = offsets.to_vec();
        self.rope = Some(rope.clone());
        Ok(())
    }

    /// Whether layer `layer`'s offsets are all zero (nothing to rotate).
    fn plain(&self, layer: usize) -> bool {
        self.rope.is_none() || self.offsets[layer].iter().all(|&o| o == 0.0)
    }

    /// `R(p)·o` for every head of `layer` into `out` (`[kv_dim]`), with the
    /// position's cos/sin in `cos`/`sin` (`[rot/2]`).
    fn rotated_offset(&self, spec: KvSpec, layer: usize, cos: &[f32], sin: &[f32], out: &mut [f32]) {
        out.copy_from_slice(&self.offsets[layer]);
        if let Some(rope) = &self.rope {
            for head in out.chunks_exact_mut(spec.head_dim) {
                rope.rotate(head, cos, sin);
            }
        }
    }

    /// Records the positions of the slots a write fills (the same for every layer).
    pub(crate) fn set_positions(&mut self, slots: &[u32], positions: &[u32]) {
        for (&s, &p) in slots.iter().zip(positions) {
            self.positions[s as usize] = p;
        }
    }

    /// Writes rows of keys already rotated to `positions` (`[n, kv_dim]`)
    /// and values to `slots` of `layer`: a key as the codes of its
    /// difference from the offset rotated the same way.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write(
        &mut self,
        spec: KvSpec,
        layer: usize,
        k: &[f32],
        v: &[f32],
        slots: &[u32],
        positions: &[u32],
        rope: &Rope,
    ) {
        self.written = true;
        self.set_positions(slots, positions);
        let (d, width, cap) = (spec.head_dim, spec.kv_dim(), spec.capacity());
        // The rotated offset stays zero where there is none to rotate.
        let plain = self.plain(layer);
        let (mut cos, mut sin, mut ro) = (Vec::new(), Vec::new(), vec![0f32; width]);
        let mut residual = vec![0f32; d];
        for (i, (&slot, &p)) in slots.iter().zip(positions).enumerate() {
            if !plain {
                cos.clear();
                sin.clear();
                rope.cos_sin(p, &mut cos, &mut sin);
                self.rotated_offset(spec, layer, &cos, &sin, &mut ro);
            }
            for h in 0..spec.num_kv_heads {
                let (src, row) = (i * width + h * d, h * cap + slot as usize);
                let codes = &mut self.k[layer][row * d..(row + 1) * d];
                self.k_scale[layer][row] =
                    encode_key_row(&k[src..src + d], &ro[h * d..(h + 1) * d], &mut residual, codes);
                self.v_scale[layer][row] = encode_row(&v[src..src + d], &mut self.v[layer][row * d..(row + 1) * d]);
            }
        }
    }

    /// Injection into every layer: each token's stored pre-RoPE key and the
    /// layer's offset, each rotated by the position's cos/sin, and their
    /// difference as codes — the arithmetic of [`Fp8Store::write`] on the
    /// key the forward pass rotates, so an injected key's codes are the
    /// forward pass's wherever its rotated key is (E1: layer 0); its value
    /// as codes. [`Fp8Store::set_positions`] records the positions.
    pub(crate) fn inject(&mut self, spec: KvSpec, layers: Vec<Vec<LayerChunk<'_>>>, rope: &Rope) {
        self.written = true;
        let (d, width, cap) = (spec.head_dim, spec.kv_dim(), spec.capacity());
        let offsets = &self.offsets;
        let plain: Vec<bool> = (0..spec.num_layers).map(|l| self.plain(l)).collect();
        let parts = self.k.par_iter_mut().zip(&mut self.v).zip(self.k_scale.par_iter_mut().zip(&mut self.v_scale));
        parts.zip(layers).enumerate().for_each(|(layer, (((kl, vl), (ks, vs)), chunks))| {
            let o = &offsets[layer];
            let half = rope.dim() / 2;
            // The rotated offset stays zero where there is none to rotate.
            let (mut rk, mut ro, mut residual) = (vec![0f32; d], vec![0f32; d], vec![0f32; d]);
            for c in &chunks {
                for (i, &slot) in c.slots.iter().enumerate() {
                    let (cos, sin) = (&c.cos[i * half..(i + 1) * half], &c.sin[i * half..(i + 1) * half]);
                    for h in 0..spec.num_kv_heads {
                        let (src, row) = (i * width + h * d, h * cap + slot as usize);
                        rk.copy_from_slice(&c.k[src..src + d]);
                        rope.rotate(&mut rk, cos, sin);
                        if !plain[layer] {
                            ro.copy_from_slice(&o[h * d..(h + 1) * d]);
                            rope.rotate(&mut ro, cos, sin);
                        }
                        ks[row] = encode_key_row(&rk, &ro, &mut residual, &mut kl[row * d..(row + 1) * d]);
                        vs[row] = encode_row(&c.v[src..src + d], &mut vl[row * d..(row + 1) * d]);
                    }
                }
            }
        });
    }

    /// Keys and values of `n` consecutive slots from `first` of one head,
    /// decoded into `k` and `v` (`[n, head_dim]` each): codes times scale,
    /// and for keys the offset rotated to each slot's position.
    pub(crate) fn decode_run(
        &self,
        spec: KvSpec,
        (layer, head): (usize, usize),
        first: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) {
        let (d, cap) = (spec.head_dim, spec.capacity());
        let plain = self.plain(layer);
        let o = &self.offsets[layer][head * d..(head + 1) * d];
        let (mut cos, mut sin, mut ro) = (Vec::new(), Vec::new(), vec![0f32; d]);
        for (i, (kr, vr)) in k.chunks_exact_mut(d).zip(v.chunks_exact_mut(d)).enumerate() {
            let row = head * cap + first + i;
            let (ks, vs) = (self.k_scale[layer][row], self.v_scale[layer][row]);
            let (kc, vc) = (&self.k[layer][row * d..(row + 1) * d], &self.v[layer][row * d..(row + 1) * d]);
            decode_row_adding(vc, vs, None, vr);
            if plain {
                decode_row_adding(kc, ks, None, kr);
                continue;
            }
            if let Some(rope) = &self.rope {
                cos.clear();
                sin.clear();
                rope.cos_sin(self.positions[first + i], &mut cos, &mut sin);
                ro.copy_from_slice(o);
                rope.rotate(&mut ro, &cos, &sin);
            }
            decode_row_adding(kc, ks, Some(&ro), kr);
        }
    }

    /// The decoded K and V rows (`[n, kv_dim]` each) of `slots` in `layer`.
    pub(crate) fn gather(&self, spec: KvSpec, layer: usize, slots: &[u32], k: &mut [f32], v: &mut [f32]) {
        let (d, width) = (spec.head_dim, spec.kv_dim());
        for (i, &slot) in slots.iter().enumerate() {
            for h in 0..spec.num_kv_heads {
                let at = i * width + h * d;
                self.decode_run(spec, (layer, h), slot as usize, &mut k[at..at + d], &mut v[at..at + d]);
            }
        }
    }

    /// Copies whole blocks `(src, dst)`: codes, scales and positions.
    pub(crate) fn copy_blocks(&mut self, spec: KvSpec, pairs: &[(u32, u32)]) {
        let (bs, d, nb) = (spec.block_size, spec.head_dim, spec.num_blocks);
        for layer in 0..spec.num_layers {
            for h in 0..spec.num_kv_heads {
                for &(src, dst) in pairs {
                    let (src, dst) = ((h * nb + src as usize) * bs, (h * nb + dst as usize) * bs);
                    for codes in [&mut self.k[layer], &mut self.v[layer]] {
                        codes.copy_within(src * d..(src + bs) * d, dst * d);
                    }
                    for scales in [&mut self.k_scale[layer], &mut self.v_scale[layer]] {
                        scales.copy_within(src..src + bs, dst);
                    }
                }
            }
        }
        for &(src, dst) in pairs {
            let (src, dst) = (src as usize * bs, dst as usize * bs);
            self.positions.copy_within(src..src + bs, dst);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

    use inferscale_model::{RopeConfig, RopeScaling};

    use super::super::{CpuBackend, CpuKvStore, CpuTensor, attention};
    use crate::backend::{AttentionShape, InjectChunk, KvCacheDtype, KvSpec, NewRows, PagedKv, SeqSpan};
    use crate::rope::Rope;
    use crate::sampling::Rng;

    const D: usize = 32;
    const HEADS: usize = 2;

    fn spec(dtype: KvCacheDtype) -> KvSpec {
        KvSpec { num_layers: 2, num_blocks: 16, block_size: 4, num_kv_heads: HEADS, head_dim: D, dtype }
    }

    fn rope() -> Rope {
        Rope::new(&RopeConfig { theta: 10_000.0, dim: D, scaling: RopeScaling::None })
    }

    fn uniform(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale).collect()
    }

    /// Pre-RoPE keys whose channel 3 of head 0 sits near −300 and channel
    /// 20 of head 1 near 150, varying by about ±1 (Qwen2.5's k_proj bias),
    /// the rest of magnitude ~1; the offsets are their channel means.
    fn keys(n: usize) -> (Vec<f32>, Vec<f32>) {
        let mut rng = Rng::new(7);
        let mut k = uniform(&mut rng, n * HEADS * D, 1.0);
        for row in k.chunks_exact_mut(HEADS * D) {
            row[3] -= 300.0;
            row[D + 20] += 150.0;
        }
        let offsets = crate::fp8_cache::key_offsets(&k, HEADS * D).unwrap();
        (k, offsets)
    }

    fn rotated(rope: &Rope, k: &[f32], positions: &[u32]) -> Vec<f32> {
        let mut out = k.to_vec();
        for (row, &p) in out.chunks_exact_mut(HEADS * D).zip(positions) {
            let (mut c, mut s) = (Vec::new(), Vec::new());
            rope.cos_sin(p, &mut c, &mut s);
            row.chunks_exact_mut(D).for_each(|h| rope.rotate(h, &c, &s));
        }
        out
    }

    fn tensor(rows: usize, data: Vec<f32>) -> CpuTensor {
        let cols = data.len() / rows;
        CpuTensor { rows, cols, data, packed: None }
    }

    fn max_err(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
    }

    /// Keys written after RoPE and keys injected before it read back as the
    /// rotated keys, within e4m3's rounding of what is left once the offset
    /// is out (within ±2 a channel: at most an eighth) — where a cache without
    /// offsets rounds the −300 channel in steps of 16. Values as well.
    #[test]
    fn written_and_injected_keys_read_back_within_the_residuals_rounding() {
        let (be, rope, n) = (CpuBackend, rope(), 24);
        let (k, offsets) = keys(n);
        let v = uniform(&mut Rng::new(8), n * HEADS * D, 2.0);
        let positions: Vec<u32> = (0..n as u32).map(|i| 40 + 3 * i).collect();
        let want = rotated(&rope, &k, &positions);
        let (written, injected): (Vec<u32>, Vec<u32>) = ((0..n as u32).collect(), (32..32 + n as u32).collect());

        let read = |store: &mut CpuKvStore| {
            let (kt, vt) = (tensor(n, want.clone()), tensor(n, v.clone()));
            be.write_kv(store, 1, &kt, &vt, NewRows { positions: &positions, slots: &written }, &rope).unwrap();
            let (ks, vs) = ([tensor(n, k.clone()), tensor(n, k.clone())], [tensor(n, v.clone()), tensor(n, v.clone())]);
            let chunk = InjectChunk { k: &ks, v: &vs, positions: &positions, slots: &injected };
            be.inject_kv(store, &[chunk], &rope).unwrap();
            let a = be.gather_kv(store, 1, &written).unwrap();
            let b = be.gather_kv(store, 1, &injected).unwrap();
            (a, b)
        };
        let mut fp8 = be.new_kv_store(spec(KvCacheDtype::Fp8)).unwrap();
        be.calibrate_kv(&mut fp8, &[offsets.clone(), offsets.clone()], &rope).unwrap();
        let ((kw, vw), (ki, vi)) = read(&mut fp8);
        let (ew, ei) = (max_err(&kw.data, &want), max_err(&ki.data, &want));
        // The residual is within ±2: half an e4m3 step there is at most 1/8.
        assert!(ew < 0.15 && ei < 0.15, "keys: written {ew}, injected {ei}");
        // Values: a scale per row, three mantissa bits.
        assert!(max_err(&vw.data, &v) < 2.0 / 16.0 && max_err(&vi.data, &v) < 2.0 / 16.0);

        // Without offsets (an uncalibrated store rounds keys as they are).
        let mut plain = be.new_kv_store(spec(KvCacheDtype::Fp8)).unwrap();
        let ((kp, _), _) = read(&mut plain);
        let ep = max_err(&kp.data, &want);
        eprintln!("key error: written {ew:.3}, injected {ei:.3}; plain rounding {ep:.2}");
        assert!(ep > 20.0 * ew.max(ei), "plain rounding {ep} against offsets {ew} / {ei}");

        // Calibration comes before the first write, never after.
        assert!(be.calibrate_kv(&mut plain, &[offsets.clone(), offsets], &rope).is_err());
    }

    /// Attention over an fp8 cache is attention over its decoded keys and
    /// values: the same as an f32 cache holding what `gather_kv` returns,
    /// for a prefill after cached keys and a decode step over scattered
    /// blocks, GQA. Copied blocks read back the same.
    #[test]
    fn attention_reads_what_the_cache_decodes() {
        let (be, rope) = (CpuBackend, rope());
        let n = 40;
        let (k, offsets) = keys(n);
        let v = uniform(&mut Rng::new(9), n * HEADS * D, 1.0);
        let positions: Vec<u32> = (0..n as u32).collect();
        let table: Vec<u32> = vec![9, 3, 4, 12, 0, 1, 7, 6, 15, 2];
        let slots: Vec<u32> = (0..n).map(|t| table[t / 4] * 4 + (t % 4) as u32).collect();
        let mut fp8 = be.new_kv_store(spec(KvCacheDtype::Fp8)).unwrap();
        be.calibrate_kv(&mut fp8, &[offsets.clone(), offsets], &rope).unwrap();
        let (kt, vt) = (tensor(n, rotated(&rope, &k, &positions)), tensor(n, v));
        be.write_kv(&mut fp8, 0, &kt, &vt, NewRows { positions: &positions, slots: &slots }, &rope).unwrap();
        let (kd, vd) = be.gather_kv(&fp8, 0, &slots).unwrap();
        let mut f32s = be.new_kv_store(spec(KvCacheDtype::Native)).unwrap();
        be.write_kv(&mut f32s, 0, &kd, &vd, NewRows { positions: &positions, slots: &slots }, &rope).unwrap();

        let heads = 3 * HEADS;
        let q = tensor(13, uniform(&mut Rng::new(10), 13 * heads * D, 1.0));
        let spans = [
            SeqSpan { q_start: 0, q_len: 12, context_len: n - 1, block_table: &table, row_ends: None },
            SeqSpan { q_start: 12, q_len: 1, context_len: n, block_table: &table, row_ends: None },
        ];
        let shape = AttentionShape { num_heads: heads, num_kv_heads: HEADS, head_dim: D, scale: 0.2 };
        let got = attention::paged_attention(&q, &fp8, 0, shape, &spans).unwrap();
        let want = attention::paged_attention(&q, &f32s, 0, shape, &spans).unwrap();
        assert!(max_err(&got.data, &want.data) < 1e-5, "{}", max_err(&got.data, &want.data));

        // Copy-on-write of blocks 3 and 4 to 10 and 11.
        be.copy_blocks(&mut fp8, &[(3, 10), (4, 11)]).unwrap();
        let (a, b) = (&slots[4..12], (40..48).collect::<Vec<u32>>());
        let (ka, va) = be.gather_kv(&fp8, 0, a).unwrap();
        let (kb, vb) = be.gather_kv(&fp8, 0, &b).unwrap();
        assert_eq!((ka.data, va.data), (kb.data, vb.data));
    }
}
