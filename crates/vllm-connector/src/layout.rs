//! Where vLLM keeps one layer's K and V, read off the cache tensor itself.
//!
//! vLLM's attention backends disagree on the cache's shape, and the same
//! backend changed it between releases. `register_kv_caches` hands us the
//! tensors and nothing else, so the layout is detected from the shape and
//! checked against the model's geometry; anything that does not match
//! exactly one known layout is an error, and the connector then loads
//! nothing (vLLM recomputes the tokens) instead of writing garbage.
//!
//! The three logical layouts (shape as `tensor.shape` reports it):
//! - [`Layout::KvFirst`]    `(2, blocks, block_size, heads, dim)`
//! - [`Layout::BlockFirst`] `(blocks, 2, block_size, heads, dim)`
//! - [`Layout::Packed`]     `(blocks, heads, block_size, 2·dim)`: K in the
//!   first `dim` values of the last axis, V in the second (vLLM ≥ 0.26).
//!
//! Backends also permute the physical order (NHD vs HND) by strides while
//! keeping the logical shape, so addressing goes through the tensor's
//! strides, never through an assumed contiguous order.

use crate::error::{ConnectorError, Result};

/// Which of vLLM's cache shapes a layer's tensor has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    KvFirst,
    BlockFirst,
    Packed,
}

impl Layout {
    pub fn as_str(self) -> &'static str {
        match self {
            Layout::KvFirst => "kv_first",
            Layout::BlockFirst => "block_first",
            Layout::Packed => "packed",
        }
    }
}

/// What the model says one layer's cache must hold per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Element type of a cache tensor. fp8 caches (scaled) are not supported:
/// a load into one fails closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    /// From torch's name (`torch.bfloat16` or `bfloat16`).
    pub fn parse(name: &str) -> Result<DType> {
        match name.strip_prefix("torch.").unwrap_or(name) {
            "float32" | "float" => Ok(DType::F32),
            "float16" | "half" => Ok(DType::F16),
            "bfloat16" => Ok(DType::BF16),
            other => Err(ConnectorError::Unsupported(format!("cache dtype {other} (float32, float16, bfloat16)"))),
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

/// Element strides of one token's K/V element `(block, kv, slot, head, dim)`:
/// the offset of `K or V [d]` of head `h` at slot `n` of block `b` is
/// `b·block + kv·kv_stride + n·slot + h·head + d·dim` (kv 0 = K, 1 = V).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    pub block: usize,
    pub kv: usize,
    pub slot: usize,
    pub head: usize,
    pub dim: usize,
}

/// One layer's cache as the connector addresses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheView {
    pub layout: Layout,
    pub dtype: DType,
    pub num_blocks: usize,
    pub geometry: Geometry,
    pub strides: Strides,
    /// One past the largest element offset any `(block, kv, slot, head, dim)` reaches.
    pub extent: usize,
}

/// The layout of a tensor of `shape`, given the model's geometry.
pub fn detect(shape: &[usize], g: &Geometry) -> Result<Layout> {
    let tail = [g.block_size, g.kv_heads, g.head_dim];
    let mut found = Vec::new();
    if shape.len() == 5 && shape[2..] == tail {
        if shape[0] == 2 {
            found.push(Layout::KvFirst);
        }
        if shape[1] == 2 {
            found.push(Layout::BlockFirst);
        }
    }
    if shape.len() == 4 && shape[1] == g.kv_heads && shape[2] == g.block_size && shape[3] == 2 * g.head_dim {
        found.push(Layout::Packed);
    }
    match found[..] {
        [one] => Ok(one),
        [] => Err(ConnectorError::Layout(format!(
            "cache shape {shape:?} is none of (2, blocks, {bs}, {h}, {d}), (blocks, 2, {bs}, {h}, {d}), \
             (blocks, {h}, {bs}, {})",
            2 * g.head_dim,
            bs = g.block_size,
            h = g.kv_heads,
            d = g.head_dim
        ))),
        _ => Err(ConnectorError::Layout(format!(
            "cache shape {shape:?} fits both (2, blocks, ...) and (blocks, 2, ...): ambiguous with 2 blocks"
        ))),
    }
}

impl CacheView {
    /// Checks a cache tensor's shape, strides (in elements) and storage size
    /// (elements reachable from its first element) against `g`.
    pub fn new(shape: &[usize], strides: &[usize], storage_elems: usize, dtype: DType, g: &Geometry) -> Result<Self> {
        if strides.len() != shape.len() {
            return Err(ConnectorError::Layout(format!("{} strides for a {}-dim cache", strides.len(), shape.len())));
        }
        let layout = detect(shape, g)?;
        let (num_blocks, s) = match layout {
            Layout::KvFirst => (
                shape[1],
                Strides { kv: strides[0], block: strides[1], slot: strides[2], head: strides[3], dim: strides[4] },
            ),
            Layout::BlockFirst => (
                shape[0],
                Strides { block: strides[0], kv: strides[1], slot: strides[2], head: strides[3], dim: strides[4] },
            ),
            Layout::Packed => (
                shape[0],
                Strides {
                    block: strides[0],
                    head: strides[1],
                    slot: strides[2],
                    kv: g.head_dim * strides[3],
                    dim: strides[3],
                },
            ),
        };
        // The largest offset reached; every extent is ≥ 1 by the checks above
        // except `num_blocks`, which a zero-block cache would make empty.
        if num_blocks == 0 {
            return Err(ConnectorError::Layout("cache with no blocks".into()));
        }
        let last = (num_blocks - 1) * s.block
            + s.kv
            + (g.block_size - 1) * s.slot
            + (g.kv_heads - 1) * s.head
            + (g.head_dim - 1) * s.dim;
        if last >= storage_elems {
            return Err(ConnectorError::Layout(format!(
                "cache strides {strides:?} reach element {last}, the storage holds {storage_elems}"
            )));
        }
        // Distinct (kv, head, dim) of one slot must not alias: the K and V
        // halves and the heads each need their own elements.
        let row = [(s.dim, g.head_dim), (s.head, g.kv_heads), (s.kv, 2)];
        if !non_overlapping(&row) {
            return Err(ConnectorError::Layout(format!("cache strides {strides:?} make K, V or heads overlap")));
        }
        Ok(CacheView { layout, dtype, num_blocks, geometry: *g, strides: s, extent: last + 1 })
    }

    /// Element offset of `kv` (0 = K, 1 = V), `head`, dimension 0 at `slot`
    /// of `block`.
    pub fn offset(&self, block: usize, slot: usize, kv: usize, head: usize) -> usize {
        block * self.strides.block + kv * self.strides.kv + slot * self.strides.slot + head * self.strides.head
    }
}

/// Whether axes `(stride, extent)` address distinct elements for distinct
/// indices (sufficient check: sorted by stride, each stride is at least the
/// span of the smaller axes).
fn non_overlapping(axes: &[(usize, usize)]) -> bool {
    let mut a: Vec<(usize, usize)> = axes.iter().copied().filter(|&(_, n)| n > 1).collect();
    a.sort_unstable();
    let mut span = 1;
    for (stride, n) in a {
        if stride < span {
            return false;
        }
        span += stride * (n - 1);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: Geometry = Geometry { block_size: 16, kv_heads: 3, head_dim: 8 };

    fn contiguous(shape: &[usize]) -> Vec<usize> {
        let mut s = vec![1; shape.len()];
        for i in (0..shape.len() - 1).rev() {
            s[i] = s[i + 1] * shape[i + 1];
        }
        s
    }

    #[test]
    fn detects_each_layout_and_rejects_the_rest() {
        assert_eq!(detect(&[2, 10, 16, 3, 8], &G).ok(), Some(Layout::KvFirst));
        assert_eq!(detect(&[10, 2, 16, 3, 8], &G).ok(), Some(Layout::BlockFirst));
        assert_eq!(detect(&[10, 3, 16, 16], &G).ok(), Some(Layout::Packed));
        // Two blocks: both 5-dim layouts fit, so neither is trusted.
        assert!(detect(&[2, 2, 16, 3, 8], &G).is_err());
        // Wrong head count, head size, block size or rank.
        assert!(detect(&[2, 10, 16, 4, 8], &G).is_err());
        assert!(detect(&[10, 3, 16, 8], &G).is_err());
        assert!(detect(&[10, 3, 32, 16], &G).is_err());
        assert!(detect(&[10, 16, 3, 8], &G).is_err());
    }

    #[test]
    fn packed_addresses_k_then_v_in_the_last_axis() {
        let shape = [10, 3, 16, 16];
        let v = CacheView::new(&shape, &contiguous(&shape), 10 * 3 * 16 * 16, DType::F32, &G).unwrap();
        assert_eq!(v.offset(1, 2, 0, 1), 3 * 16 * 16 + 16 * 16 + 2 * 16);
        assert_eq!(v.offset(1, 2, 1, 1) - v.offset(1, 2, 0, 1), 8);
        assert_eq!(v.extent, 10 * 3 * 16 * 16);
    }

    #[test]
    fn permuted_strides_are_followed_and_checked() {
        // Packed logical (B, H, N, 2D) stored as (B, N, H, 2D): vLLM's NHD order.
        let (b, h, n, d2) = (10, 3, 16, 16);
        let strides = [n * h * d2, d2, h * d2, 1];
        let v = CacheView::new(&[b, h, n, d2], &strides, b * n * h * d2, DType::BF16, &G).unwrap();
        assert_eq!(v.offset(0, 1, 0, 0), h * d2);
        assert_eq!(v.offset(0, 0, 0, 1), d2);
        // Storage too small for the strides: refused.
        assert!(CacheView::new(&[b, h, n, d2], &strides, b * n * h * d2 - 1, DType::BF16, &G).is_err());
        // Heads aliasing each other: refused.
        assert!(CacheView::new(&[b, h, n, d2], &[n * h * d2, 0, h * d2, 1], b * n * h * d2, DType::BF16, &G).is_err());
    }

    #[test]
    fn dtypes_by_torch_name() {
        assert_eq!(DType::parse("torch.bfloat16").ok(), Some(DType::BF16));
        assert_eq!(DType::parse("float16").ok(), Some(DType::F16));
        assert!(DType::parse("torch.float8_e4m3fn").is_err());
    }
}
