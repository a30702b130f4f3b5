//! Worker side on host memory: stored pre-RoPE K rotated to its prompt
//! positions and written with V into one layer of vLLM's paged cache, in
//! any of the layouts of [`crate::layout`].
//!
//! The rotation is the engine's own ([`Rope`]), so KV written here is the
//! KV our engine's injection writes (docs/design.md §1, E1–E4); only the final
//! rounding to the cache's dtype is added (round to nearest even, as
//! torch's `.to()` does).

use half::{bf16, f16};
use inferscale_engine::rope::Rope;

use crate::error::{ConnectorError, Result};
use crate::layout::CacheView;

/// One layer of a cache tensor's storage, typed.
pub enum CacheMut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [f16]),
    BF16(&'a mut [bf16]),
}

impl CacheMut<'_> {
    fn len(&self) -> usize {
        match self {
            CacheMut::F32(s) => s.len(),
            CacheMut::F16(s) => s.len(),
            CacheMut::BF16(s) => s.len(),
        }
    }

    fn write(&mut self, at: usize, stride: usize, row: &[f32]) {
        match self {
            CacheMut::F32(s) => row.iter().enumerate().for_each(|(d, &x)| s[at + d * stride] = x),
            CacheMut::F16(s) => row.iter().enumerate().for_each(|(d, &x)| s[at + d * stride] = f16::from_f32(x)),
            CacheMut::BF16(s) => row.iter().enumerate().for_each(|(d, &x)| s[at + d * stride] = bf16::from_f32(x)),
        }
    }
}

/// One chunk's rows of one layer: `[len, kv_heads·head_dim]` pre-RoPE K and V,
/// placed at prompt positions `start..start + len`.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub start: usize,
}

impl Rows<'_> {
    fn len(&self, kv_dim: usize) -> usize {
        self.k.len() / kv_dim
    }
}

/// Slot of prompt position `p` in a request's blocks.
fn slot(view: &CacheView, block_ids: &[u32], p: usize) -> Result<(usize, usize)> {
    let bs = view.geometry.block_size;
    let block = *block_ids
        .get(p / bs)
        .ok_or_else(|| ConnectorError::Plan(format!("position {p} is past the request's {} blocks", block_ids.len())))?
        as usize;
    if block >= view.num_blocks {
        return Err(ConnectorError::Plan(format!("block {block} of a cache of {} blocks", view.num_blocks)));
    }
    Ok((block, p % bs))
}

/// Writes `chunks` into `cache` (one layer, addressed by `view`) at the
/// slots of `block_ids`, skipping positions below `from` (vLLM already has
/// them). Everything is checked before the first write.
pub fn write_layer(
    cache: &mut CacheMut<'_>,
    view: &CacheView,
    rope: &Rope,
    chunks: &[Rows<'_>],
    block_ids: &[u32],
    from: usize,
) -> Result<()> {
    let g = view.geometry;
    let kv_dim = g.kv_heads * g.head_dim;
    if cache.len() < view.extent {
        return Err(ConnectorError::Layout(format!(
            "cache of {} elements, its strides need {}",
            cache.len(),
            view.extent
        )));
    }
    for c in chunks {
        if c.k.len() != c.v.len() || c.k.len() % kv_dim != 0 {
            return Err(ConnectorError::Plan(format!(
                "chunk rows of {} K and {} V values, not a multiple of kv_dim {kv_dim}",
                c.k.len(),
                c.v.len()
            )));
        }
        let end = c.start + c.len(kv_dim);
        if end > from {
            slot(view, block_ids, c.start.max(from))?;
            slot(view, block_ids, end - 1)?;
        }
    }
    let (mut cos, mut sin) = (Vec::with_capacity(g.head_dim), Vec::with_capacity(g.head_dim));
    let mut head = vec![0f32; g.head_dim];
    for c in chunks {
        for t in 0..c.len(kv_dim) {
            let p = c.start + t;
            if p < from {
                continue;
            }
            let (block, n) = slot(view, block_ids, p)?;
            cos.clear();
            sin.clear();
            rope.cos_sin(p as u32, &mut cos, &mut sin);
            for h in 0..g.kv_heads {
                let at = t * kv_dim + h * g.head_dim;
                head.copy_from_slice(&c.k[at..at + g.head_dim]);
                rope.rotate(&mut head, &cos, &sin);
                cache.write(view.offset(block, n, 0, h), view.strides.dim, &head);
                cache.write(view.offset(block, n, 1, h), view.strides.dim, &c.v[at..at + g.head_dim]);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use inferscale_model::{RopeConfig, RopeScaling};

    use super::*;
    use crate::layout::{DType, Geometry};

    const G: Geometry = Geometry { block_size: 4, kv_heads: 2, head_dim: 4 };

    fn rope() -> Rope {
        Rope::new(&RopeConfig { theta: 10_000.0, dim: 4, scaling: RopeScaling::None })
    }

    /// Reads back K/V of position `p` through plain index arithmetic on the
    /// logical shape, independently of [`CacheView::offset`].
    fn read(data: &[f32], shape: &[usize], p: usize, block_ids: &[u32], kv: usize, h: usize, d: usize) -> f32 {
        let (b, n) = (block_ids[p / 4] as usize, p % 4);
        let idx: Vec<usize> = match shape.len() {
            5 if shape[0] == 2 => vec![kv, b, n, h, d],
            5 => vec![b, kv, n, h, d],
            _ => vec![b, h, n, kv * 4 + d],
        };
        let mut off = 0;
        for (i, x) in idx.iter().enumerate() {
            off = off * shape[i] + x;
        }
        data[off]
    }

    #[test]
    fn every_layout_holds_the_rotated_keys_and_the_values() {
        let rope = rope();
        let kv_dim = 8;
        // Two chunks: positions 0..3 and 3..9; the request owns blocks 4, 1, 6.
        let k: Vec<f32> = (0..9 * kv_dim).map(|i| (i as f32 * 0.37).sin()).collect();
        let v: Vec<f32> = (0..9 * kv_dim).map(|i| (i as f32 * 0.11).cos()).collect();
        let chunks = [
            Rows { k: &k[..3 * kv_dim], v: &v[..3 * kv_dim], start: 0 },
            Rows { k: &k[3 * kv_dim..], v: &v[3 * kv_dim..], start: 3 },
        ];
        let blocks = [4u32, 1, 6];
        for shape in [vec![2, 8, 4, 2, 4], vec![8, 2, 4, 2, 4], vec![8, 2, 4, 8]] {
            let n: usize = shape.iter().product();
            let mut strides = vec![1; shape.len()];
            for i in (0..shape.len() - 1).rev() {
                strides[i] = strides[i + 1] * shape[i + 1];
            }
            let view = CacheView::new(&shape, &strides, n, DType::F32, &G).unwrap();
            let mut data = vec![f32::NAN; n];
            write_layer(&mut CacheMut::F32(&mut data), &view, &rope, &chunks, &blocks, 2).unwrap();
            for p in 0..9 {
                for h in 0..2 {
                    let mut want = k[p * kv_dim + h * 4..p * kv_dim + h * 4 + 4].to_vec();
                    let (mut c, mut s) = (Vec::new(), Vec::new());
                    rope.cos_sin(p as u32, &mut c, &mut s);
                    rope.rotate(&mut want, &c, &s);
                    for d in 0..4 {
                        let (gk, gv) =
                            (read(&data, &shape, p, &blocks, 0, h, d), read(&data, &shape, p, &blocks, 1, h, d));
                        if p < 2 {
                            // Below `from`: vLLM's own, untouched.
                            assert!(gk.is_nan() && gv.is_nan(), "{shape:?} p {p}");
                        } else {
                            assert_eq!(gk, want[d], "{shape:?} K p {p} h {h} d {d}");
                            assert_eq!(gv, v[p * kv_dim + h * 4 + d], "{shape:?} V p {p} h {h} d {d}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn half_caches_round_to_nearest() {
        let shape = [2, 3, 4, 2, 4];
        let view = CacheView::new(&shape, &[96, 32, 8, 4, 1], 192, DType::BF16, &G).unwrap();
        let k = vec![0.0f32; 8];
        let v: Vec<f32> = (0..8).map(|i| 1.0 + i as f32 / 3.0).collect();
        let mut data = vec![bf16::ZERO; 192];
        write_layer(&mut CacheMut::BF16(&mut data), &view, &rope(), &[Rows { k: &k, v: &v, start: 0 }], &[1], 0)
            .unwrap();
        for (d, want) in v.iter().enumerate().take(4) {
            assert_eq!(data[96 + 32 + d], bf16::from_f32(*want));
        }
    }

    #[test]
    fn positions_past_the_blocks_are_refused_before_any_write() {
        let shape = [8, 2, 4, 8];
        let view = CacheView::new(&shape, &[64, 32, 8, 1], 512, DType::F32, &G).unwrap();
        let rows = vec![1.0f32; 6 * 8];
        let mut data = vec![0f32; 512];
        let chunks = [Rows { k: &rows, v: &rows, start: 0 }];
        assert!(write_layer(&mut CacheMut::F32(&mut data), &view, &rope(), &chunks, &[3], 0).is_err());
        assert!(data.iter().all(|&x| x == 0.0));
        // A block id outside the cache.
        assert!(write_layer(&mut CacheMut::F32(&mut data), &view, &rope(), &chunks, &[3, 9], 0).is_err());
        assert!(data.iter().all(|&x| x == 0.0));
    }
}
