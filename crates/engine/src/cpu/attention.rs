//! Causal attention over the paged KV cache on the CPU.
//!
//! Work is split into tasks of (sequence, KV head, chunk of query rows); a
//! task gathers its KV head's cached keys and values into contiguous buffers
//! once and serves every query head of its group (GQA) from them, with two
//! GEMMs per head: scores = q·Kᵀ, then out = softmax(scores)·V. A chunk only
//! reads the keys its last row may see, so causal prefill does about half
//! the work of a full square.

use rayon::prelude::*;

use super::matmul::{Strided, gemm_strided};
use super::{CpuKvStore, CpuTensor};
use crate::backend::{AttentionShape, SeqSpan};
use crate::error::{EngineError, Result};

/// Query rows per task: enough to make the GEMMs efficient, few enough to
/// keep both cores busy on one sequence.
const ROWS_PER_TASK: usize = 64;

struct Task {
    span: usize,
    kv_head: usize,
    r0: usize,
    r1: usize,
}

pub fn paged_attention(
    q: &CpuTensor,
    store: &CpuKvStore,
    layer: usize,
    shape: AttentionShape,
    spans: &[SeqSpan<'_>],
) -> Result<CpuTensor> {
    let AttentionShape { num_heads, num_kv_heads, head_dim: d, scale } = shape;
    let spec = store.spec();
    if q.cols != num_heads * d || spec.num_kv_heads != num_kv_heads || spec.head_dim != d || layer >= spec.num_layers {
        return Err(EngineError::Shape(format!(
            "attention: q width {} for {num_heads}×{d}, store {spec:?}, layer {layer}",
            q.cols
        )));
    }
    let mut tasks = Vec::new();
    for (si, s) in spans.iter().enumerate() {
        if s.q_len > s.context_len
            || s.q_start + s.q_len > q.rows
            || s.block_table.len() * spec.block_size < s.context_len
        {
            return Err(EngineError::Shape(format!(
                "attention span {si}: {} queries, context {}, {} blocks, {} rows",
                s.q_len,
                s.context_len,
                s.block_table.len(),
                q.rows
            )));
        }
        for g in 0..num_kv_heads {
            for r0 in (0..s.q_len).step_by(ROWS_PER_TASK) {
                tasks.push(Task { span: si, kv_head: g, r0, r1: (r0 + ROWS_PER_TASK).min(s.q_len) });
            }
        }
    }
    let group = num_heads / num_kv_heads;
    let ctx = TaskCtx { q, store, layer, group, d, scale };
    let results: Vec<(usize, Vec<f32>)> =
        tasks.par_iter().enumerate().map(|(ti, t)| (ti, run_task(t, &spans[t.span], &ctx))).collect();

    let mut out = CpuTensor::zeros(q.rows, q.cols);
    for (ti, buf) in results {
        let t = &tasks[ti];
        let s = &spans[t.span];
        let rows = t.r1 - t.r0;
        // buf is [group, rows, d]
        for j in 0..group {
            let h = t.kv_head * group + j;
            for i in 0..rows {
                let dst = (s.q_start + t.r0 + i) * q.cols + h * d;
                let src = (j * rows + i) * d;
                out.data[dst..dst + d].copy_from_slice(&buf[src..src + d]);
            }
        }
    }
    Ok(out)
}

/// What every task of one attention call shares.
struct TaskCtx<'a> {
    q: &'a CpuTensor,
    store: &'a CpuKvStore,
    layer: usize,
    group: usize,
    d: usize,
    scale: f32,
}

/// One task's output, `[group, rows, d]`.
fn run_task(t: &Task, s: &SeqSpan<'_>, ctx: &TaskCtx<'_>) -> Vec<f32> {
    let TaskCtx { q, store, layer, group, d, scale } = *ctx;
    let first_pos = s.context_len - s.q_len;
    let rows = t.r1 - t.r0;
    let n_keys = first_pos + t.r1;
    let (keys, values) = gather(store, layer, s.block_table, t.kv_head, n_keys);
    let mut scores = vec![0f32; rows * n_keys];
    let mut out = vec![0f32; group * rows * d];
    for j in 0..group {
        let h = t.kv_head * group + j;
        let q_off = (s.q_start + t.r0) * q.cols + h * d;
        gemm_strided(
            &mut scores,
            n_keys,
            Strided { data: &q.data[q_off..], rs: q.cols, cs: 1 },
            Strided { data: &keys, rs: 1, cs: d },
            (rows, n_keys, d),
            scale,
        );
        for (i, row) in scores.chunks_exact_mut(n_keys).enumerate() {
            softmax_causal(row, first_pos + t.r0 + i + 1);
        }
        gemm_strided(
            &mut out[j * rows * d..],
            d,
            Strided { data: &scores, rs: n_keys, cs: 1 },
            Strided { data: &values, rs: d, cs: 1 },
            (rows, d, n_keys),
            1.0,
        );
    }
    out
}

/// Softmax over the first `visible` entries; the rest become 0.
fn softmax_causal(row: &mut [f32], visible: usize) {
    let (live, masked) = row.split_at_mut(visible);
    let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for x in live.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    live.iter_mut().for_each(|x| *x *= inv);
    masked.fill(0.0);
}

/// Copies positions `0..n` of one KV head into contiguous `[n, d]` K and V.
fn gather(store: &CpuKvStore, layer: usize, table: &[u32], head: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let d = store.spec().head_dim;
    let bs = store.spec().block_size;
    let mut k = vec![0f32; n * d];
    let mut v = vec![0f32; n * d];
    for (bi, &block) in table.iter().enumerate() {
        let start = bi * bs;
        if start >= n {
            break;
        }
        let len = (n - start).min(bs);
        let src = store.offset(block as usize * bs, head);
        k[start * d..(start + len) * d].copy_from_slice(&store.k[layer][src..src + len * d]);
        v[start * d..(start + len) * d].copy_from_slice(&store.v[layer][src..src + len * d]);
    }
    (k, v)
}
