//! The CPU backend's paged KV store, and the writes that injection makes
//! into it.
//!
//! Injection is a copy: every layer's stored K (rotated on the way) and V of
//! every injected token, tens of MB for 50 facts of a small model, read once
//! and written once. Ordinary stores first read each destination line into
//! the cache (read-for-ownership) and later write it back, so a copy costs
//! three memory transfers per line; streaming (non-temporal) stores write
//! whole lines straight to memory and cost one. On a two-core machine whose
//! memory bandwidth is the limit, that halves the injection's time. The
//! attention that follows reads the lines from memory either way: tens of
//! MB do not stay in a shared last-level cache.

use std::ops::{Deref, DerefMut};

use rayon::prelude::*;

use super::kv_fp8::Fp8Store;
use crate::backend::{KvCacheDtype, KvSpec};
use crate::rope::Rope;

/// One cache line of floats.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A zeroed f32 buffer starting on a cache line, so that every head row of
/// the cache (`head_dim` floats, a multiple of 16 in every model we serve)
/// fills whole lines and can be written with streaming stores.
pub(crate) struct LineBuf {
    lines: Vec<Line>,
    len: usize,
}

impl LineBuf {
    /// `len` zeros, written in parallel: the first touch of each page (its
    /// fault and zeroing) is paid here, at allocation, and not by the first
    /// request that uses a block.
    pub(crate) fn zeroed(len: usize) -> Self {
        let n = len.div_ceil(16);
        let mut lines: Vec<Line> = Vec::with_capacity(n);
        lines.spare_capacity_mut().par_chunks_mut(1024).for_each(|chunk| {
            for l in chunk {
                l.write(Line([0.0; 16]));
            }
        });
        // SAFETY: the loop above initialised all n elements of the capacity.
        unsafe { lines.set_len(n) };
        LineBuf { lines, len }
    }
}

impl Deref for LineBuf {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: `lines` holds at least `len` contiguous, initialised f32s
        // (a Line is 16 of them with no padding: repr(C), size 64).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl DerefMut for LineBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

impl std::fmt::Debug for LineBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LineBuf({} floats)", self.len)
    }
}

/// Paged K/V: per layer, `[kv_heads, num_blocks, block_size, head_dim]`, so a
/// head's block is one contiguous run, and so are consecutive block ids —
/// attention reads such runs in place instead of gathering them. An fp8
/// store keeps codes in the same layout (`fp8`) and no f32 buffers.
#[derive(Debug)]
pub struct CpuKvStore {
    pub(crate) spec: KvSpec,
    pub(crate) k: Vec<LineBuf>,
    pub(crate) v: Vec<LineBuf>,
    pub(crate) fp8: Option<Fp8Store>,
}

impl CpuKvStore {
    pub(crate) fn new(spec: KvSpec) -> Self {
        if spec.dtype == KvCacheDtype::Fp8 {
            return CpuKvStore { spec, k: Vec::new(), v: Vec::new(), fp8: Some(Fp8Store::new(spec)) };
        }
        let per_layer = spec.capacity() * spec.kv_dim();
        CpuKvStore {
            spec,
            k: (0..spec.num_layers).map(|_| LineBuf::zeroed(per_layer)).collect(),
            v: (0..spec.num_layers).map(|_| LineBuf::zeroed(per_layer)).collect(),
            fp8: None,
        }
    }

    pub fn spec(&self) -> KvSpec {
        self.spec
    }

    /// Offset of (slot, head) in a layer's buffer.
    pub(crate) fn offset(&self, slot: usize, head: usize) -> usize {
        head_offset(self.spec, slot, head)
    }
}

/// Offset of (slot, head) in a layer's buffer of a store shaped `spec`.
fn head_offset(spec: KvSpec, slot: usize, head: usize) -> usize {
    (head * spec.num_blocks * spec.block_size + slot) * spec.head_dim
}

/// One injected chunk's layer: token `i`'s stored pre-RoPE key (`k`, `[n,
/// kv_dim]`) rotated by `cos`/`sin` (`[n, rot/2]`), and its value, written to
/// cache slot `slots[i]`.
pub(crate) struct LayerChunk<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub slots: &'a [u32],
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// Writes `chunks` into one layer's K and V buffers. Bit for bit what
/// copying each key and [`Rope::rotate`]-ing it in place gives (the same
/// products and sums, unfused), so an injected key equals the key the
/// forward pass writes (E1).
pub(crate) fn inject_layer(spec: KvSpec, kl: &mut [f32], vl: &mut [f32], chunks: &[LayerChunk<'_>], rope: &Rope) {
    #[cfg(target_arch = "x86_64")]
    if streamable(spec, rope, kl, vl) {
        // SAFETY: AVX-512F was detected and `streamable` checked the
        // alignment and widths the streaming path relies on.
        unsafe { avx512::inject_layer(spec, kl, vl, chunks, rope.dim()) };
        return;
    }
    inject_layer_portable(spec, kl, vl, chunks, rope);
}

fn inject_layer_portable(spec: KvSpec, kl: &mut [f32], vl: &mut [f32], chunks: &[LayerChunk<'_>], rope: &Rope) {
    let (d, width, half) = (spec.head_dim, spec.kv_dim(), rope.dim() / 2);
    for c in chunks {
        for (i, &slot) in c.slots.iter().enumerate() {
            let (cos, sin) = (&c.cos[i * half..(i + 1) * half], &c.sin[i * half..(i + 1) * half]);
            for h in 0..spec.num_kv_heads {
                let (dst, src) = (head_offset(spec, slot as usize, h), i * width + h * d);
                let head = &mut kl[dst..dst + d];
                head.copy_from_slice(&c.k[src..src + d]);
                rope.rotate(head, cos, sin);
                vl[dst..dst + d].copy_from_slice(&c.v[src..src + d]);
            }
        }
    }
}

/// Whether the streaming path applies: AVX-512F, head rows of whole lines
/// that start on a line, and rotated halves and the unrotated rest in whole
/// vectors.
#[cfg(target_arch = "x86_64")]
fn streamable(spec: KvSpec, rope: &Rope, kl: &[f32], vl: &[f32]) -> bool {
    let (d, rot) = (spec.head_dim, rope.dim());
    let on_line = |b: &[f32]| (b.as_ptr() as usize).is_multiple_of(64);
    std::is_x86_feature_detected!("avx512f")
        && d.is_multiple_of(16)
        && (rot / 2).is_multiple_of(16)
        && rot <= d
        && on_line(kl)
        && on_line(vl)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{KvSpec, LayerChunk};

    /// # Safety
    /// AVX-512F must be available; `kl` and `vl` start on a cache line,
    /// `head_dim` and `rot / 2` are multiples of 16, and every slot and
    /// row the chunks name lies in the buffers and tensors (checked by the
    /// caller before any write).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn inject_layer(
        spec: KvSpec,
        kl: &mut [f32],
        vl: &mut [f32],
        chunks: &[LayerChunk<'_>],
        rot: usize,
    ) {
        let (d, width, half) = (spec.head_dim, spec.kv_dim(), rot / 2);
        let (pk, pv) = (kl.as_mut_ptr(), vl.as_mut_ptr());
        for c in chunks {
            for (i, &slot) in c.slots.iter().enumerate() {
                let (cos, sin) = (&c.cos[i * half..(i + 1) * half], &c.sin[i * half..(i + 1) * half]);
                for h in 0..spec.num_kv_heads {
                    let dst = super::head_offset(spec, slot as usize, h);
                    let src = i * width + h * d;
                    let (k, v) = (&c.k[src..src + d], &c.v[src..src + d]);
                    assert!(dst + d <= kl.len().min(vl.len()), "inject: slot {slot} beyond the layer");
                    // SAFETY: dst..dst + d lies in both buffers (asserted),
                    // starts on a line (buffers on a line, d a multiple of
                    // 16), and every vector read is within k, v, cos and sin.
                    unsafe {
                        let (kd, vd) = (pk.add(dst), pv.add(dst));
                        for j in (0..half).step_by(16) {
                            let (x1, x2) =
                                (_mm512_loadu_ps(k.as_ptr().add(j)), _mm512_loadu_ps(k.as_ptr().add(half + j)));
                            let (co, si) = (_mm512_loadu_ps(cos.as_ptr().add(j)), _mm512_loadu_ps(sin.as_ptr().add(j)));
                            // Rope::rotate's arithmetic: x1·c − x2·s and x2·c + x1·s, unfused.
                            let a = _mm512_sub_ps(_mm512_mul_ps(x1, co), _mm512_mul_ps(x2, si));
                            let b = _mm512_add_ps(_mm512_mul_ps(x2, co), _mm512_mul_ps(x1, si));
                            _mm512_stream_ps(kd.add(j), a);
                            _mm512_stream_ps(kd.add(half + j), b);
                        }
                        for j in (2 * half..d).step_by(16) {
                            _mm512_stream_ps(kd.add(j), _mm512_loadu_ps(k.as_ptr().add(j)));
                        }
                        for j in (0..d).step_by(16) {
                            _mm512_stream_ps(vd.add(j), _mm512_loadu_ps(v.as_ptr().add(j)));
                        }
                    }
                }
            }
        }
        // Streaming stores are weakly ordered: make them visible before the
        // rayon join that hands the layer to whoever reads it next.
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    use inferscale_model::{RopeConfig, RopeScaling};

    use super::*;

    /// The dispatched (streaming) injection writes exactly what the portable
    /// one does, for full and partial rotary dimensions and scattered slots.
    #[test]
    fn streaming_injection_is_bit_identical_to_the_portable_one() {
        for (d, rot) in [(64, 64), (128, 128), (64, 32), (32, 32), (16, 16)] {
            let spec = KvSpec {
                num_layers: 1,
                num_blocks: 6,
                block_size: 4,
                num_kv_heads: 2,
                head_dim: d,
                dtype: Default::default(),
            };
            let rope = Rope::new(&RopeConfig { theta: 10_000.0, dim: rot, scaling: RopeScaling::None });
            let n = 5;
            let k: Vec<f32> = (0..n * spec.kv_dim()).map(|i| (i as f32 * 0.37).sin()).collect();
            let v: Vec<f32> = (0..n * spec.kv_dim()).map(|i| (i as f32 * 0.11).cos()).collect();
            let (mut cos, mut sin) = (Vec::new(), Vec::new());
            for p in [3, 9, 10, 400, 9000] {
                rope.cos_sin(p, &mut cos, &mut sin);
            }
            let slots = [1, 2, 7, 20, 23];
            let chunk = LayerChunk { k: &k, v: &v, slots: &slots, cos: &cos, sin: &sin };
            let len = spec.capacity() * spec.kv_dim();
            let (mut k1, mut v1) = (LineBuf::zeroed(len), LineBuf::zeroed(len));
            let (mut k2, mut v2) = (LineBuf::zeroed(len), LineBuf::zeroed(len));
            inject_layer(spec, &mut k1, &mut v1, std::slice::from_ref(&chunk), &rope);
            inject_layer_portable(spec, &mut k2, &mut v2, std::slice::from_ref(&chunk), &rope);
            assert_eq!(&k1[..], &k2[..], "K, head_dim {d}, rotary {rot}");
            assert_eq!(&v1[..], &v2[..], "V, head_dim {d}, rotary {rot}");
            assert!(k1.iter().any(|&x| x != 0.0), "something was written");
            assert_eq!(k1.as_ptr() as usize % 64, 0, "buffers start on a line");
        }
    }
}
