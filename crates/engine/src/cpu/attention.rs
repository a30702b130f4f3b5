//! Causal attention over the paged KV cache on the CPU.
//!
//! Work is split into tasks of (sequence, KV head, chunk of query rows,
//! chunk of keys). A task gathers its keys and values into contiguous
//! buffers once and serves every query head of its GQA group with two GEMMs
//! over the stacked heads: scores = Q·Kᵀ, then P·V. Splitting the keys
//! (flash-decoding style: each task returns its rows' running max and sum,
//! merged afterwards) keeps both cores busy when a few query rows attend to a
//! long context — a question prefilled after injected memory, or decode.
//! Causal chunks read only keys their last row may see.

use std::cell::RefCell;

use rayon::prelude::*;

use super::matmul::{Strided, gemm_strided};
use super::{CpuKvStore, CpuTensor, vmath};
use crate::backend::{AttentionShape, SeqSpan};
use crate::error::{EngineError, Result};

/// Query rows per task.
const ROWS_PER_TASK: usize = 64;
/// Smallest key chunk worth a task of its own.
const MIN_KEYS_PER_TASK: usize = 256;
/// Shortest run of consecutive blocks read in place rather than copied
/// with its neighbour (a product over fewer keys costs more than the copy).
const MIN_RUN_KEYS: usize = 32;

struct Task {
    span: usize,
    kv_head: usize,
    r0: usize,
    r1: usize,
    k0: usize,
    k1: usize,
}

/// A task's partial result for `group × rows` stacked query rows:
/// unnormalised outputs, row maxima and row sums of exponentials.
struct Partial {
    o: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
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
    }
    let tasks = plan(spans, num_kv_heads, spec.block_size);
    let group = num_heads / num_kv_heads;
    let ctx = TaskCtx { q, store, layer, group, d, scale };
    let partials: Vec<Partial> = tasks.par_iter().map(|t| run_task(t, &spans[t.span], &ctx)).collect();

    // Merge the key chunks of each (span, kv head, row chunk); tasks of one
    // row chunk are adjacent in the plan.
    let mut out = CpuTensor::zeros(q.rows, q.cols);
    let mut i = 0;
    while i < tasks.len() {
        let t = &tasks[i];
        let mut j = i + 1;
        while j < tasks.len() && (tasks[j].span, tasks[j].kv_head, tasks[j].r0) == (t.span, t.kv_head, t.r0) {
            j += 1;
        }
        let rows = t.r1 - t.r0;
        let s = &spans[t.span];
        for stacked in 0..group * rows {
            let m = partials[i..j].iter().map(|p| p.max[stacked]).fold(f32::NEG_INFINITY, f32::max);
            let (hj, r) = (stacked / rows, stacked % rows);
            let h = t.kv_head * group + hj;
            let dst = (s.q_start + t.r0 + r) * q.cols + h * d;
            let o = &mut out.data[dst..dst + d];
            let mut total = 0f32;
            for p in &partials[i..j] {
                if p.sum[stacked] == 0.0 {
                    continue;
                }
                let w = (p.max[stacked] - m).exp();
                total += w * p.sum[stacked];
                for (o, x) in o.iter_mut().zip(&p.o[stacked * d..(stacked + 1) * d]) {
                    *o += w * x;
                }
            }
            let inv = 1.0 / total;
            o.iter_mut().for_each(|x| *x *= inv);
        }
        i = j;
    }
    Ok(out)
}

/// Splits the work so that both cores stay busy: row chunks first, then key
/// chunks when there are few row chunks and long contexts; a key chunk is
/// cut where the sequence's blocks stop being consecutive (a forked header,
/// then the blocks allocated after it), so each piece is read in place.
fn plan(spans: &[SeqSpan<'_>], num_kv_heads: usize, block_size: usize) -> Vec<Task> {
    let row_tasks: usize = spans.iter().map(|s| s.q_len.div_ceil(ROWS_PER_TASK) * num_kv_heads).sum();
    let want = 2 * rayon::current_num_threads();
    let mut tasks = Vec::new();
    for (si, s) in spans.iter().enumerate() {
        let first_pos = s.context_len - s.q_len;
        for g in 0..num_kv_heads {
            for r0 in (0..s.q_len).step_by(ROWS_PER_TASK) {
                let r1 = (r0 + ROWS_PER_TASK).min(s.q_len);
                let n_keys = first_pos + r1;
                let splits = if row_tasks >= want { 1 } else { want.div_ceil(row_tasks) };
                let chunk = n_keys.div_ceil(splits).max(MIN_KEYS_PER_TASK);
                for k0 in (0..n_keys).step_by(chunk) {
                    for (a, z) in runs(s.block_table, block_size, k0, (k0 + chunk).min(n_keys)) {
                        tasks.push(Task { span: si, kv_head: g, r0, r1, k0: a, k1: z });
                    }
                }
            }
        }
    }
    tasks
}

/// `k0..k1` cut at every block boundary where the table's blocks stop
/// being consecutive, pieces shorter than [`MIN_RUN_KEYS`] joined to a
/// neighbour (that piece is then copied by [`gather`]).
fn runs(table: &[u32], block_size: usize, k0: usize, k1: usize) -> Vec<(usize, usize)> {
    let mut cuts = vec![k0];
    let mut b = k0 / block_size + 1;
    while b * block_size < k1 {
        if table[b] != table[b - 1].wrapping_add(1) {
            cuts.push(b * block_size);
        }
        b += 1;
    }
    cuts.push(k1);
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(cuts.len() - 1);
    for w in cuts.windows(2) {
        match out.last_mut() {
            Some(last) if w[1] - w[0] < MIN_RUN_KEYS || last.1 - last.0 < MIN_RUN_KEYS => last.1 = w[1],
            _ => out.push((w[0], w[1])),
        }
    }
    out
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

fn run_task(t: &Task, s: &SeqSpan<'_>, ctx: &TaskCtx<'_>) -> Partial {
    let TaskCtx { q, store, layer, group, d, scale } = *ctx;
    let first_pos = s.context_len - s.q_len;
    let rows = t.r1 - t.r0;
    let n_keys = t.k1 - t.k0;
    let stacked = group * rows;
    // The group's query heads stacked: row (j, r) = head kv_head·group + j, query row r0 + r.
    let mut qs = vec![0f32; stacked * d];
    for j in 0..group {
        let h = t.kv_head * group + j;
        for r in 0..rows {
            let src = (s.q_start + t.r0 + r) * q.cols + h * d;
            qs[(j * rows + r) * d..(j * rows + r + 1) * d].copy_from_slice(&q.data[src..src + d]);
        }
    }
    SCRATCH.with_borrow_mut(|Scratch { scores, kv }| {
        let (keys, values) = gather(store, layer, s.block_table, t.kv_head, t.k0, t.k1, kv);
        // Every element is written below, by the product or the mask.
        scores.resize(stacked * n_keys, 0.0);
        let scores = &mut scores[..stacked * n_keys];
        gemm_strided(
            scores,
            n_keys,
            Strided { data: &qs, rs: d, cs: 1 },
            Strided { data: keys, rs: 1, cs: d },
            (stacked, n_keys, d),
            scale,
        );
        let mut max = vec![f32::NEG_INFINITY; stacked];
        let mut sum = vec![0f32; stacked];
        for (i, row) in scores.chunks_exact_mut(n_keys).enumerate() {
            // Keys this row may see, relative to the chunk.
            let visible = (first_pos + t.r0 + i % rows + 1).saturating_sub(t.k0).min(n_keys);
            let (live, masked) = row.split_at_mut(visible);
            masked.fill(0.0);
            if visible == 0 {
                continue;
            }
            let m = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            max[i] = m;
            sum[i] = vmath::exp_shift_sum(live, m);
        }
        let mut o = vec![0f32; stacked * d];
        gemm_strided(
            &mut o,
            d,
            Strided { data: scores, rs: n_keys, cs: 1 },
            Strided { data: values, rs: d, cs: 1 },
            (stacked, d, n_keys),
            1.0,
        );
        Partial { o, max, sum }
    })
}

/// Buffers a task reuses from the previous task on its thread: score rows
/// and gathered keys and values run to hundreds of KB, which a fresh
/// allocation per task pays for in page faults and zeroing.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    kv: (Vec<f32>, Vec<f32>),
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// Positions `k0..k1` of one KV head as contiguous `[k1 - k0, d]` K and V:
/// borrowed from the cache when the blocks are consecutive, else copied
/// into `buf`.
fn gather<'a>(
    store: &'a CpuKvStore,
    layer: usize,
    table: &[u32],
    head: usize,
    k0: usize,
    k1: usize,
    buf: &'a mut (Vec<f32>, Vec<f32>),
) -> (&'a [f32], &'a [f32]) {
    let d = store.spec().head_dim;
    let bs = store.spec().block_size;
    let n = k1 - k0;
    let (b0, b1) = (k0 / bs, (k1 - 1) / bs);
    if table[b0..=b1].windows(2).all(|w| w[1] == w[0] + 1) {
        let src = store.offset(table[b0] as usize * bs + k0 % bs, head);
        return (&store.k[layer][src..src + n * d], &store.v[layer][src..src + n * d]);
    }
    let (k, v) = buf;
    // Every element is copied over below.
    k.resize(n * d, 0.0);
    v.resize(n * d, 0.0);
    let (k, v) = (&mut k[..n * d], &mut v[..n * d]);
    let mut pos = k0;
    while pos < k1 {
        let (bi, off) = (pos / bs, pos % bs);
        let len = (bs - off).min(k1 - pos);
        let src = store.offset(table[bi] as usize * bs + off, head);
        let dst = (pos - k0) * d;
        k[dst..dst + len * d].copy_from_slice(&store.k[layer][src..src + len * d]);
        v[dst..dst + len * d].copy_from_slice(&store.v[layer][src..src + len * d]);
        pos += len;
    }
    (k, v)
}

/// Dense bidirectional attention within each span (encoders), one task per
/// (span, head): scores = q·kᵀ over the span, softmax, then p·v.
pub fn bidirectional(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    shape: AttentionShape,
    spans: &[(usize, usize)],
) -> Result<CpuTensor> {
    let AttentionShape { num_heads, num_kv_heads, head_dim: d, scale } = shape;
    let width = num_heads * d;
    let same = |t: &CpuTensor| t.cols == width && t.rows == q.rows;
    if num_heads != num_kv_heads || !same(q) || !same(k) || !same(v) {
        return Err(EngineError::Shape(format!("bidirectional attention: q/k/v widths for {num_heads}×{d}")));
    }
    if let Some(s) = spans.iter().find(|(start, len)| start + len > q.rows) {
        return Err(EngineError::Shape(format!("span {s:?} beyond {} rows", q.rows)));
    }
    let tasks: Vec<(usize, usize)> = (0..spans.len()).flat_map(|s| (0..num_heads).map(move |h| (s, h))).collect();
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(s, h)| {
            let (start, len) = spans[s];
            let mut scores = vec![0f32; len * len];
            let off = start * width + h * d;
            gemm_strided(
                &mut scores,
                len,
                Strided { data: &q.data[off..], rs: width, cs: 1 },
                Strided { data: &k.data[off..], rs: 1, cs: width },
                (len, len, d),
                scale,
            );
            for row in scores.chunks_exact_mut(len) {
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum = vmath::exp_shift_sum(row, m);
                row.iter_mut().for_each(|x| *x /= sum);
            }
            let mut o = vec![0f32; len * d];
            gemm_strided(
                &mut o,
                d,
                Strided { data: &scores, rs: len, cs: 1 },
                Strided { data: &v.data[off..], rs: width, cs: 1 },
                (len, d, len),
                1.0,
            );
            o
        })
        .collect();
    let mut out = CpuTensor::zeros(q.rows, width);
    for (&(s, h), o) in tasks.iter().zip(results) {
        let (start, len) = spans[s];
        for r in 0..len {
            let dst = (start + r) * width + h * d;
            out.data[dst..dst + d].copy_from_slice(&o[r * d..(r + 1) * d]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_ranges_are_cut_where_blocks_stop_being_consecutive() {
        // A forked 3-block header, then blocks allocated after it.
        let table = [7, 8, 9, 20, 21, 22, 23, 24, 40, 41];
        assert_eq!(runs(&table, 16, 0, 160), vec![(0, 48), (48, 128), (128, 160)]);
        // A key chunk starting mid-run, and one inside a run.
        assert_eq!(runs(&table, 16, 40, 100), vec![(40, 100)], "an 8-key piece joins its neighbour");
        assert_eq!(runs(&table, 16, 50, 120), vec![(50, 120)]);
        // Scattered single blocks: pieces below the minimum are joined (copied).
        let scattered = [5, 3, 9, 1];
        assert_eq!(runs(&scattered, 16, 0, 64), vec![(0, 64)]);
        let pairs = [5, 6, 9, 10];
        assert_eq!(runs(&pairs, 16, 0, 64), vec![(0, 32), (32, 64)]);
        assert_eq!(runs(&scattered, 8, 0, 32), vec![(0, 32)]);
    }
}
