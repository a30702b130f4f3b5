//! Fused kernels for the steps of a layer that would otherwise be several
//! small launches: at a question's 20 rows or a decode batch each launch is
//! a few microseconds of mostly idle device, and a layer had fourteen.
//! Each fused op computes the same bits as the ops it replaces (the
//! engine's defaults spell those out), which `inferscale check` verifies.

use inferscale_engine::Result;
use inferscale_engine::backend::{AttentionShape, KvSpec, NewRows, Tensors};
use inferscale_engine::rope::{Rope, TABLE_POSITIONS};

use crate::backend::{CudaBackend, CudaKvStore, CudaTensor, shape_err};

impl CudaBackend {
    /// `x += y`, then RMSNorm of `x`: one block per row.
    pub(crate) fn fused_add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        let _span = self.span("add_rms_norm");
        if (x.rows, x.cols) != (y.rows, y.cols) || weight.len() != x.cols {
            return Err(shape_err(format!("add_rms_norm: [{}, {}] + [{}, {}]", x.rows, x.cols, y.rows, y.cols)));
        }
        if !x.cols.is_multiple_of(8) || x.cols > 8 * 1024 {
            Tensors::add_assign(self, x, y)?;
            return Tensors::rms_norm(self, x, weight, eps);
        }
        let out = self.tensor(x.rows, x.cols)?;
        let (o, xp, yp, w, c) = (self.tp(&out), self.tp(x), self.tp(y), self.tp(weight), x.cols as i32);
        let threads = (x.cols / 8).div_ceil(32) * 32;
        self.launch_pdl(
            &self.k.add_rms_norm_v8,
            Self::rows_cfg(x.rows, threads as u32),
            &[&o, &xp, &yp, &w, &c, &eps],
        )?;
        Ok(out)
    }

    /// Q rotated out of `qkv`; K rotated and V copied into the cache.
    pub(crate) fn fused_qkv_rope_write(
        &self,
        qkv: &CudaTensor,
        shape: AttentionShape,
        rope: &Rope,
        rows: NewRows<'_>,
        store: &mut CudaKvStore,
        layer: usize,
    ) -> Result<CudaTensor> {
        let _span = self.span("qkv_rope_write");
        let (q_cols, kv_cols) = check_qkv(qkv, shape, rope, &rows, store.spec, layer)?;
        let d = shape.head_dim;
        let q = self.tensor(qkv.rows, q_cols)?;
        let (kc, vc) = self.layer_ptrs(store, layer)?;
        let r = self.rope_tables(rope)?;
        let (pos, slots) = (self.meta(rows.positions)?, self.meta(rows.slots)?);
        let (qp, src, pp, sp) = (self.tp(&q), self.tp(qkv), self.ptr(&pos), self.ptr(&slots));
        let (qc, kvc, hd, rot) = (q_cols as i32, kv_cols as i32, d as i32, rope.dim() as i32);
        let (cs, sn, inv, tp) = (self.ptr(&r.cos), self.ptr(&r.sin), self.ptr(&r.inv_freq), TABLE_POSITIONS as u32);
        self.launch_pdl(
            &self.k.qkv_rope_write,
            Self::rows_cfg(qkv.rows, 128),
            &[&qp, &kc, &vc, &src, &pp, &sp, &qc, &kvc, &hd, &rot, &cs, &sn, &inv, &tp],
        )?;
        Ok(q)
    }
}

/// The widths of Q and of K (= V) in a fused QKV row, once `qkv`, `rows`
/// and `rope` are found to fit `shape` and the store's `spec`.
pub(crate) fn check_qkv(
    qkv: &CudaTensor,
    shape: AttentionShape,
    rope: &Rope,
    rows: &NewRows<'_>,
    spec: KvSpec,
    layer: usize,
) -> Result<(usize, usize)> {
    let d = shape.head_dim;
    let (q_cols, kv_cols) = (shape.num_heads * d, shape.num_kv_heads * d);
    spec.check(layer, rows.slots)?;
    if qkv.cols != q_cols + 2 * kv_cols
        || rows.positions.len() != qkv.rows
        || rows.slots.len() != qkv.rows
        || kv_cols != spec.kv_dim()
        || rope.dim() > d
        || !rope.dim().is_multiple_of(4)
        || !d.is_multiple_of(8)
    {
        return Err(shape_err(format!(
            "qkv_rope_write: [{}, {}] for {}/{} heads of {d}, {} positions, {} slots",
            qkv.rows,
            qkv.cols,
            shape.num_heads,
            shape.num_kv_heads,
            rows.positions.len(),
            rows.slots.len()
        )));
    }
    Ok((q_cols, kv_cols))
}
