//! Causal attention over the paged KV cache on the CPU.
//!
//! Work is split into tasks of (sequence, KV head, chunk of query rows,
//! range of keys). A task serves every query head of its GQA group with two
//! products over the stacked heads (`attn_kernel.rs`): scores Sᵀ = K·Qᵀ,
//! then O = P·V, reading keys and values in place from each run of
//! consecutive cache blocks (a forked header is one run, the blocks
//! allocated after it another). Splitting the keys (flash-decoding style:
//! each task returns its rows' running max and sum, merged afterwards) keeps
//! both cores busy when a few query rows attend to a long context — a
//! question prefilled after injected memory, or decode. Causal chunks read
//! only keys their last row may see.

use std::cell::RefCell;

use rayon::prelude::*;

use super::attn_kernel::{self, Dims};
use super::matmul::{Strided, gemm_strided};
use super::{CpuKvStore, CpuTensor, vmath};
use crate::backend::{AttentionShape, SeqSpan};
use crate::error::{EngineError, Result};

/// Query rows per task.
const ROWS_PER_TASK: usize = 64;
/// Smallest key chunk worth a task of its own.
const MIN_KEYS_PER_TASK: usize = 64;

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
        s.check()?;
        if s.q_start + s.q_len > q.rows || s.block_table.len() * spec.block_size < s.context_len {
            return Err(EngineError::Shape(format!(
                "attention span {si}: {} queries, context {}, {} blocks, {} rows",
                s.q_len,
                s.context_len,
                s.block_table.len(),
                q.rows
            )));
        }
    }
    let tasks = plan(spans, num_kv_heads);
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
            let (hj, r) = (stacked / rows, stacked % rows);
            let h = t.kv_head * group + hj;
            let dst = (s.q_start + t.r0 + r) * q.cols + h * d;
            let o = &mut out.data[dst..dst + d];
            let at = stacked * d..(stacked + 1) * d;
            if let [p] = &partials[i..j] {
                // One key chunk: nothing to rescale.
                let inv = 1.0 / p.sum[stacked];
                o.iter_mut().zip(&p.o[at]).for_each(|(o, x)| *o = x * inv);
                continue;
            }
            let m = partials[i..j].iter().map(|p| p.max[stacked]).fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0f32;
            for p in &partials[i..j] {
                if p.sum[stacked] == 0.0 {
                    continue;
                }
                let w = (p.max[stacked] - m).exp();
                total += w * p.sum[stacked];
                for (o, x) in o.iter_mut().zip(&p.o[at.clone()]) {
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

/// Splits the work so that both cores stay busy: chunks of up to
/// [`ROWS_PER_TASK`] query rows, and when these make fewer than two tasks
/// per thread (a question of a few rows after a long memory, decode), key
/// chunks of at least [`MIN_KEYS_PER_TASK`]. Keys are cut rather than rows
/// because a task's cost is its keys × stacked rows either way, but cutting
/// rows reads every key once per row chunk and leaves fewer rows to fill
/// the kernels' 16-lane columns; key chunks only add a cheap merge.
fn plan(spans: &[SeqSpan<'_>], num_kv_heads: usize) -> Vec<Task> {
    let row_tasks: usize = spans.iter().map(|s| s.q_len.div_ceil(ROWS_PER_TASK) * num_kv_heads).sum();
    let want = 2 * rayon::current_num_threads();
    let splits = if row_tasks >= want { 1 } else { want.div_ceil(row_tasks.max(1)) };
    let mut tasks = Vec::new();
    for (si, s) in spans.iter().enumerate() {
        for g in 0..num_kv_heads {
            for r0 in (0..s.q_len).step_by(ROWS_PER_TASK) {
                let r1 = (r0 + ROWS_PER_TASK).min(s.q_len);
                let n_keys = s.row_end(r1 - 1);
                let chunk = n_keys.div_ceil(splits).max(MIN_KEYS_PER_TASK);
                for k0 in (0..n_keys).step_by(chunk) {
                    tasks.push(Task { span: si, kv_head: g, r0, r1, k0, k1: (k0 + chunk).min(n_keys) });
                }
            }
        }
    }
    tasks
}

/// `k0..k1` cut where the block table stops being consecutive (each piece
/// is then one contiguous run of the cache) and at `at`.
fn pieces(table: &[u32], block_size: usize, k0: usize, k1: usize, at: usize) -> Vec<(usize, usize)> {
    let mut cuts = vec![k0];
    let mut b = k0 / block_size + 1;
    while b * block_size < k1 {
        if table[b] != table[b - 1].wrapping_add(1) {
            cuts.push(b * block_size);
        }
        b += 1;
    }
    if k0 < at && at < k1 {
        let i = cuts.partition_point(|&c| c < at);
        if cuts.get(i) != Some(&at) {
            cuts.insert(i, at);
        }
    }
    cuts.push(k1);
    cuts.windows(2).map(|w| (w[0], w[1])).collect()
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
    let rows = t.r1 - t.r0;
    let n_keys = t.k1 - t.k0;
    let stacked = group * rows;
    // One AVX-512 lane per stacked query row; the padding columns are zero
    // queries whose results are never read.
    let mp = stacked.next_multiple_of(16);
    // Causal mask: key p is visible to query row r0 + r iff p < its row end
    // (its own cache index + 1). Keys before `all_see` are visible to every
    // row of the task; those from it on (at most a row chunk when the rows
    // are consecutive, more when they are scattered) are masked below.
    let all_see = s.row_end(t.r0).clamp(t.k0, t.k1);
    let cut = pieces(s.block_table, store.spec().block_size, t.k0, t.k1, all_see);
    // An fp8 cache's keys and values of the task, decoded to f32 in key
    // order (buffers reused from the thread's last task).
    let mut decoded = DECODED.with_borrow_mut(std::mem::take);
    if let Some(f) = &store.fp8 {
        let (dk, dv) = (grown(&mut decoded.0, n_keys * d), grown(&mut decoded.1, n_keys * d));
        let bs = store.spec().block_size;
        for &(a, z) in &cut {
            let first = s.block_table[a / bs] as usize * bs + a % bs;
            let span = (a - t.k0) * d..(z - t.k0) * d;
            f.decode_run(store.spec(), (layer, t.kv_head), first, &mut dk[span.clone()], &mut dv[span]);
        }
    }
    // Each piece's keys and values (first key, keys, values): in place, or
    // decoded.
    let runs: Vec<(usize, &[f32], &[f32])> = cut
        .into_iter()
        .map(|(a, z)| match store.fp8 {
            None => {
                let (keys, values) = key_run(store, layer, s.block_table, t.kv_head, a, z);
                (a, keys, values)
            }
            Some(_) => {
                let span = (a - t.k0) * d..(z - t.k0) * d;
                (a, &decoded.0[span.clone()], &decoded.1[span])
            }
        })
        .collect();
    let partial = SCRATCH.with_borrow_mut(|Scratch { qt, scores }| {
        // Qᵀ of the group's query heads, scaled: column j·rows + r is head
        // kv_head·group + j at query row r0 + r.
        let rows_at: Vec<usize> = (0..group)
            .flat_map(|j| (0..rows).map(move |r| (s.q_start + t.r0 + r) * q.cols + (t.kv_head * group + j) * d))
            .collect();
        let qt = grown(qt, d * mp);
        attn_kernel::pack_queries_t(qt, &q.data, &rows_at, d, mp, scale);
        // Every element is written by the products, run by run.
        let st = grown(scores, n_keys * mp);
        // The kernel raises a column maximum as it goes; the tail's is taken
        // after its mask instead, so what it raises for the tail is dropped.
        let (mut max, mut unmasked_tail_max) = (vec![f32::NEG_INFINITY; mp], vec![f32::NEG_INFINITY; mp]);
        for &(a, keys, values) in &runs {
            let m = if a >= all_see { &mut unmasked_tail_max } else { &mut max };
            let dims = Dims { n: keys.len() / d, d, mp };
            attn_kernel::scores_t(&mut st[(a - t.k0) * mp..][..dims.n * mp], m, (keys, values), qt, dims);
        }
        for (i, row) in st[(all_see - t.k0) * mp..].chunks_exact_mut(mp).enumerate() {
            // Rows r0 + first_row.. of each head see key all_see + i.
            let first_row = s.rows_ending_by(t.r0, t.r1, all_see + i);
            for j in 0..group {
                row[j * rows..j * rows + first_row].fill(f32::NEG_INFINITY);
            }
            for (m, &x) in max.iter_mut().zip(row.iter()) {
                *m = m.max(x);
            }
        }
        // A row that sees no key of this chunk keeps max −∞ and sum 0 (the
        // merge skips it); its shift must be finite so exp(−∞ − shift) = 0.
        let shift: Vec<f32> = max.iter().map(|&m| if m == f32::NEG_INFINITY { 0.0 } else { m }).collect();
        let mut sum = vec![0f32; mp];
        vmath::exp_sub_cols_sum(st, &shift, &mut sum);
        let mut o = vec![0f32; stacked * d];
        for (i, &(a, _, values)) in runs.iter().enumerate() {
            let dims = Dims { n: values.len() / d, d, mp };
            let p = &st[(a - t.k0) * mp..][..dims.n * mp];
            attn_kernel::weighted_values(&mut o, p, values, dims, (stacked, i > 0));
        }
        max.truncate(stacked);
        sum.truncate(stacked);
        Partial { o, max, sum }
    });
    drop(runs);
    DECODED.with_borrow_mut(|b| *b = decoded);
    partial
}

/// Buffers a task reuses from the previous task on its thread: packed
/// queries and score rows run to hundreds of KB, which a fresh allocation
/// per task pays for in page faults and zeroing.
#[derive(Default)]
struct Scratch {
    qt: Vec<f32>,
    scores: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
    /// An fp8 cache's keys and values of one task, decoded.
    static DECODED: RefCell<(Vec<f32>, Vec<f32>)> = RefCell::default();
}

/// The first `n` elements of `buf`, grown (never shrunk) to hold them: tasks
/// of different sizes alternate, and shrinking then growing would zero the
/// difference each time. What the slice holds is left from earlier tasks.
fn grown(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    &mut buf[..n]
}

/// Keys and values of positions `a..z` of one KV head, in place: `a..z`
/// must lie in consecutive blocks (a piece of [`pieces`]).
fn key_run<'a>(
    store: &'a CpuKvStore,
    layer: usize,
    table: &[u32],
    head: usize,
    a: usize,
    z: usize,
) -> (&'a [f32], &'a [f32]) {
    let (d, bs) = (store.spec().head_dim, store.spec().block_size);
    let src = store.offset(table[a / bs] as usize * bs + a % bs, head);
    let n = (z - a) * d;
    (&store.k[layer][src..src + n], &store.v[layer][src..src + n])
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
        assert_eq!(pieces(&table, 16, 0, 160, 0), vec![(0, 48), (48, 128), (128, 160)]);
        // A range starting mid-run, one inside a run, and a cut at the
        // first key some rows must not see.
        assert_eq!(pieces(&table, 16, 40, 100, 40), vec![(40, 48), (48, 100)]);
        assert_eq!(pieces(&table, 16, 50, 120, 100), vec![(50, 100), (100, 120)]);
        assert_eq!(pieces(&table, 16, 50, 120, 128), vec![(50, 120)]);
        assert_eq!(pieces(&table, 16, 0, 160, 128), vec![(0, 48), (48, 128), (128, 160)]);
        // Scattered single blocks: one piece each.
        let scattered = [5, 3, 9, 1];
        assert_eq!(pieces(&scattered, 16, 0, 64, 0), vec![(0, 16), (16, 32), (32, 48), (48, 64)]);
    }

    #[test]
    fn keys_are_cut_when_rows_are_few() {
        let threads = rayon::current_num_threads();
        let table: Vec<u32> = (0..200).collect();
        let span = |q_len, context_len| SeqSpan { q_start: 0, q_len, context_len, block_table: &table, row_ends: None };
        // A question of 19 rows after 1,240 cached keys, 3 KV heads: every
        // task holds all 19 rows; each head's keys are covered exactly once.
        let t = plan(&[span(19, 1259)], 3);
        assert!(t.iter().all(|t| (t.r0, t.r1) == (0, 19)));
        for g in 0..3 {
            let mut keys: Vec<(usize, usize)> = t.iter().filter(|t| t.kv_head == g).map(|t| (t.k0, t.k1)).collect();
            keys.sort();
            assert_eq!(keys.first().map(|k| k.0), Some(0));
            assert!(keys.windows(2).all(|w| w[0].1 == w[1].0) && keys.last().map(|k| k.1) == Some(1259));
        }
        assert!(t.len() >= (2 * threads).min(3 * 1259usize.div_ceil(MIN_KEYS_PER_TASK)));
        // A long prefill: row chunks, each reading only the keys its rows see.
        let t = plan(&[span(200, 200)], 2);
        assert_eq!(t.len(), 2 * 200usize.div_ceil(ROWS_PER_TASK));
        assert!(t.iter().all(|t| t.r1 - t.r0 <= ROWS_PER_TASK && (t.k0, t.k1) == (0, t.r1)));
    }

    /// Paged attention against a dense reference: GQA, several sequences
    /// (a prefill after cached keys, a decode step, a fresh prompt), block
    /// tables out of order, head sizes on the vector path and off it.
    /// (q_len, context_len, block table, row ends).
    type Case = (usize, usize, Vec<u32>, Option<Vec<u32>>);

    #[test]
    fn paged_attention_matches_a_dense_reference() {
        for (heads, kv_heads, d) in [(9, 3, 64), (4, 4, 16), (4, 2, 24)] {
            let spec = crate::backend::KvSpec {
                num_layers: 2,
                num_blocks: 64,
                block_size: 16,
                num_kv_heads: kv_heads,
                head_dim: d,
                dtype: Default::default(),
            };
            let mut store = CpuKvStore::new(spec);
            // (q_len, context_len, blocks, row ends): blocks scattered and
            // reversed; the last two are rows recomputed in place among
            // cached ones (scattered, and more than one task's rows).
            let seqs: [Case; 5] = [
                (19, 300, (0..19).map(|b| if b < 3 { 40 + b } else { 22 - b }).collect(), None),
                (1, 75, vec![60, 61, 30, 31, 63], None),
                (40, 40, vec![50, 51, 52], None),
                (5, 120, (0..8).map(|b| 20 + 2 * b).collect(), Some(vec![3, 17, 18, 90, 120])),
                (70, 230, (0..15).map(|b| 21 + 2 * b).collect(), Some((0..70).map(|i| 2 + 3 * i + i / 40).collect())),
            ];
            let val = |i: usize, salt: f32| ((i as f32) * 0.37 + salt).sin();
            for (k, buf) in store.k.iter_mut().enumerate() {
                buf.iter_mut().enumerate().for_each(|(i, x)| *x = val(i, k as f32));
            }
            for (k, buf) in store.v.iter_mut().enumerate() {
                buf.iter_mut().enumerate().for_each(|(i, x)| *x = val(i, 7.0 + k as f32));
            }
            let rows: usize = seqs.iter().map(|s| s.0).sum();
            let mut q = CpuTensor::zeros(rows, heads * d);
            q.data.iter_mut().enumerate().for_each(|(i, x)| *x = val(i, 3.0) * 2.0);
            let mut q_start = 0;
            let spans: Vec<SeqSpan<'_>> = seqs
                .iter()
                .map(|(q_len, context_len, table, ends)| {
                    let s = SeqSpan {
                        q_start,
                        q_len: *q_len,
                        context_len: *context_len,
                        block_table: table,
                        row_ends: ends.as_deref(),
                    };
                    q_start += q_len;
                    s
                })
                .collect();
            let shape = AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim: d, scale: 0.3 };
            let got = paged_attention(&q, &store, 1, shape, &spans).unwrap();
            for s in &spans {
                for r in 0..s.q_len {
                    let pos = s.row_end(r) - 1;
                    for h in 0..heads {
                        let g = h / (heads / kv_heads);
                        let qrow = &q.data[(s.q_start + r) * q.cols + h * d..][..d];
                        let at = |p: usize| store.offset(s.block_table[p / 16] as usize * 16 + p % 16, g);
                        let scores: Vec<f32> = (0..=pos)
                            .map(|p| {
                                0.3 * qrow.iter().zip(&store.k[1][at(p)..at(p) + d]).map(|(a, b)| a * b).sum::<f32>()
                            })
                            .collect();
                        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let w: Vec<f32> = scores.iter().map(|x| (x - m).exp()).collect();
                        let total: f32 = w.iter().sum();
                        for c in 0..d {
                            let want: f32 = (0..=pos).map(|p| w[p] * store.v[1][at(p) + c]).sum::<f32>() / total;
                            let x = got.data[(s.q_start + r) * q.cols + h * d + c];
                            assert!(
                                (x - want).abs() < 1e-5,
                                "heads {heads}/{kv_heads} d {d}, row {r} head {h} dim {c}: {x} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
