//! The two products of CPU attention, with the scores kept transposed.
//!
//! An attention task has few stacked query rows (a GQA group's heads times a
//! chunk of rows: 3 × 19 for a question asked over injected memory, 3 for a
//! decode step) and many keys. A general GEMM packs both operands on every
//! call, and at these sizes the packing and its dispatch cost as much as the
//! product. Here nothing the cache holds is packed or transposed:
//!
//! - scores are computed as `Sᵀ = K · Qᵀ`: each key row is read in place from
//!   the cache and broadcast against `Qᵀ`, which the task packs once as
//!   `[head_dim][mp]` (`mp`: stacked rows rounded up to 16, one AVX-512 lane
//!   per query row), so `Sᵀ` is `[keys][mp]`;
//! - `O = P · V` streams V's rows (one to a few vectors each) against
//!   columns of `Pᵀ`, which is `Sᵀ` after the softmax.
//!
//! Both are register-tiled AVX-512 kernels (24 accumulators, one broadcast
//! load per row of the tile, FMA-bound); other CPUs, and head sizes that are
//! not a multiple of 16 for `P · V`, take a portable loop with the same
//! layout.

/// The sizes of a task's products: `n` keys of `d` dimensions, and `mp`
/// columns of stacked query rows (a multiple of 16).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub n: usize,
    pub d: usize,
    pub mp: usize,
}

/// `st[i·mp + m] = Σ_c k[i·d + c] · qt[c·mp + m]` for keys `i < n` and
/// columns `m < mp`: the transposed scores of `n` keys (`[n, d]`, row-major)
/// against packed queries `qt` (`[d, mp]`). `mp` must be a multiple of 16.
/// `max[m]` is raised to the largest score of column `m` on the way (the
/// softmax needs it, and the registers hold the scores already). The same
/// keys' values `v` (`[n, d]`) are brought into L2 meanwhile, for the
/// product that follows the softmax.
pub(crate) fn scores_t(st: &mut [f32], max: &mut [f32], (k, v): (&[f32], &[f32]), qt: &[f32], dims: Dims) {
    let Dims { n, d, mp } = dims;
    assert!(mp.is_multiple_of(16), "scores_t: mp {mp} is not a multiple of 16");
    assert!(st.len() >= n * mp && max.len() >= mp, "scores_t outputs");
    assert!(k.len() >= n * d && v.len() >= n * d && qt.len() >= d * mp, "scores_t operands");
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        for m0 in (0..mp).step_by(64) {
            // SAFETY: AVX-512F was detected; the asserts above bound every
            // row and column the strips address (columns m0..m0 + 16·MV ≤ mp).
            unsafe {
                match ((mp - m0) / 16).min(4) {
                    4 => avx512::score_strip::<6, 4>(st, max, (k, v), qt, dims, m0),
                    3 => avx512::score_strip::<8, 3>(st, max, (k, v), qt, dims, m0),
                    2 => avx512::score_strip::<12, 2>(st, max, (k, v), qt, dims, m0),
                    _ => avx512::score_strip::<12, 1>(st, max, (k, v), qt, dims, m0),
                }
            }
        }
        return;
    }
    scores_t_portable(st, max, k, qt, dims);
}

/// `o[m·d + c] = Σ_i pt[i·mp + m] · v[i·d + c]` for stacked rows `m < rows`
/// and `c < d`: the probabilities `pt` (`[n, mp]`, transposed) times the
/// values `v` (`[n, d]`, row-major). With `accumulate`, added to what `o`
/// holds (the keys of a task come in several runs).
pub(crate) fn weighted_values(o: &mut [f32], pt: &[f32], v: &[f32], dims: Dims, (rows, accumulate): (usize, bool)) {
    let Dims { n, d, mp } = dims;
    assert!(rows <= mp, "weighted_values: {rows} rows in a width of {mp}");
    assert!(o.len() >= rows * d && pt.len() >= n * mp && v.len() >= n * d, "weighted_values operands");
    #[cfg(target_arch = "x86_64")]
    if d.is_multiple_of(16) && std::is_x86_feature_detected!("avx512f") {
        for c0 in (0..d).step_by(64) {
            // SAFETY: AVX-512F was detected; the asserts above bound every
            // row and column the strips address (columns c0..c0 + 16·DV ≤ d).
            unsafe {
                let at = (rows, c0, accumulate);
                match ((d - c0) / 16).min(4) {
                    4 => avx512::value_strip::<6, 4>(o, pt, v, dims, at),
                    3 => avx512::value_strip::<8, 3>(o, pt, v, dims, at),
                    2 => avx512::value_strip::<12, 2>(o, pt, v, dims, at),
                    _ => avx512::value_strip::<12, 1>(o, pt, v, dims, at),
                }
            }
        }
        return;
    }
    weighted_values_portable(o, pt, v, dims, (rows, accumulate));
}

/// `qt[c·mp + m] = scale · q[rows[m] + c]` for `c < d` and `m <
/// rows.len()`, zero in the padding columns up to `mp`: the queries of a
/// task (rows of `q` starting at the offsets `rows`) transposed for
/// [`scores_t`]. A gather per 16 columns on AVX-512; scattering the rows
/// column by column costs as much as a short task's products.
pub(crate) fn pack_queries_t(qt: &mut [f32], q: &[f32], rows: &[usize], d: usize, mp: usize, scale: f32) {
    assert!(mp.is_multiple_of(16) && rows.len() <= mp && qt.len() >= d * mp, "pack_queries_t shapes");
    assert!(rows.iter().all(|&r| r + d <= q.len()), "pack_queries_t: a query row beyond q");
    #[cfg(target_arch = "x86_64")]
    if q.len() <= i32::MAX as usize && std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was detected; every gathered offset rows[m] + c
        // lies in q (asserted), offsets fit in i32, and qt holds d·mp floats.
        unsafe { avx512::pack_queries_t(qt, q, rows, d, mp, scale) };
        return;
    }
    let qt = &mut qt[..d * mp];
    qt.fill(0.0);
    for (m, &r) in rows.iter().enumerate() {
        for (dst, &x) in qt[m..].iter_mut().step_by(mp).zip(&q[r..r + d]) {
            *dst = x * scale;
        }
    }
}

fn scores_t_portable(st: &mut [f32], max: &mut [f32], k: &[f32], qt: &[f32], Dims { n, d, mp }: Dims) {
    for (srow, krow) in st[..n * mp].chunks_exact_mut(mp).zip(k.chunks_exact(d)) {
        srow.fill(0.0);
        for (&x, qrow) in krow.iter().zip(qt.chunks_exact(mp)) {
            for (s, q) in srow.iter_mut().zip(qrow) {
                *s += x * q;
            }
        }
        for (m, &s) in max.iter_mut().zip(srow.iter()) {
            *m = m.max(s);
        }
    }
}

fn weighted_values_portable(o: &mut [f32], pt: &[f32], v: &[f32], dims: Dims, (rows, accumulate): (usize, bool)) {
    let Dims { n, d, mp } = dims;
    let o = &mut o[..rows * d];
    if !accumulate {
        o.fill(0.0);
    }
    for (prow, vrow) in pt.chunks_exact(mp).zip(v.chunks_exact(d)).take(n) {
        for (orow, &p) in o.chunks_exact_mut(d).zip(prow) {
            for (x, w) in orow.iter_mut().zip(vrow) {
                *x += p * w;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::Dims;

    /// Keys per block of the `P · V` kernel: 64 rows of Pᵀ and of a 64-wide
    /// V strip are 32 KB, inside a 48 KB L1.
    const VALUE_KEY_BLOCK: usize = 64;

    /// # Safety
    /// AVX-512F must be available; `rows[m] + c < q.len() ≤ i32::MAX` for
    /// every `c < d`, `rows.len() ≤ mp`, `mp` a multiple of 16 and `qt`
    /// holds `d·mp` floats.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_queries_t(qt: &mut [f32], q: &[f32], rows: &[usize], d: usize, mp: usize, scale: f32) {
        let s = _mm512_set1_ps(scale);
        for m0 in (0..mp).step_by(16) {
            let live = rows.len().saturating_sub(m0).min(16);
            let mut idx = [0i32; 16];
            for (i, &r) in rows[m0..m0 + live].iter().enumerate() {
                idx[i] = r as i32;
            }
            let mask: __mmask16 = ((1u32 << live) - 1) as __mmask16;
            // SAFETY: only the `live` lanes gather, each at rows[m] + c < q.len();
            // the store writes qt[c·mp + m0 .. + 16] < d·mp.
            unsafe {
                let base = _mm512_loadu_si512(idx.as_ptr().cast());
                for c in 0..d {
                    let at = _mm512_add_epi32(base, _mm512_set1_epi32(c as i32));
                    let x = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, at, q.as_ptr().cast());
                    _mm512_storeu_ps(qt.as_mut_ptr().add(c * mp + m0), _mm512_mul_ps(x, s));
                }
            }
        }
    }

    /// Columns `m0..m0 + 16·MV` of `Sᵀ` for every key, `R` keys per tile.
    ///
    /// # Safety
    /// AVX-512F must be available; `st` holds `n·mp`, `k` `n·d` and `qt`
    /// `d·mp` floats, and `m0 + 16·MV ≤ mp`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn score_strip<const R: usize, const MV: usize>(
        st: &mut [f32],
        max: &mut [f32],
        (k, v): (&[f32], &[f32]),
        qt: &[f32],
        Dims { n, d, mp }: Dims,
        m0: usize,
    ) {
        let (ps, pk, pq, pm) = (st.as_mut_ptr(), k.as_ptr(), qt.as_ptr(), max.as_mut_ptr());
        // The values are wanted once, by the first column strip.
        let pv = (m0 == 0).then_some(v.as_ptr());
        // SAFETY: tile i covers keys i..i + R ≤ n and columns m0..m0 + 16·MV ≤ mp.
        unsafe {
            let mut hi = [_mm512_set1_ps(f32::NEG_INFINITY); MV];
            for (v, h) in hi.iter_mut().enumerate() {
                *h = _mm512_loadu_ps(pm.add(m0 + 16 * v));
            }
            let mut i = 0;
            while i + R <= n {
                // Keys come from memory a tile at a time, read column-wise:
                // fetch the tile after next while this one computes.
                prefetch(pk, (i + 2 * R).min(n) * d..(i + 3 * R).min(n) * d);
                if let Some(pv) = pv {
                    prefetch_l2(pv, i * d..(i + R) * d);
                }
                score_tile::<R, MV>(pk.add(i * d), d, pq.add(m0), mp, ps.add(i * mp + m0), &mut hi);
                i += R;
            }
            while i < n {
                score_tile::<1, MV>(pk.add(i * d), d, pq.add(m0), mp, ps.add(i * mp + m0), &mut hi);
                i += 1;
            }
            for (v, h) in hi.iter().enumerate() {
                _mm512_storeu_ps(pm.add(m0 + 16 * v), *h);
            }
        }
    }

    /// Asks for the cache lines of `base[range]` (floats) to be loaded.
    ///
    /// # Safety
    /// `range` must lie within the allocation `base` points into.
    #[inline(always)]
    unsafe fn prefetch(base: *const f32, range: std::ops::Range<usize>) {
        for at in range.step_by(16) {
            // SAFETY: `at` is inside the allocation (the caller's range).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(at).cast()) };
        }
    }

    /// [`prefetch`] into L2 only: lines wanted later, not by the next tile.
    ///
    /// # Safety
    /// As for [`prefetch`].
    #[inline(always)]
    unsafe fn prefetch_l2(base: *const f32, range: std::ops::Range<usize>) {
        for at in range.step_by(16) {
            // SAFETY: `at` is inside the allocation (the caller's range).
            unsafe { _mm_prefetch::<_MM_HINT_T1>(base.add(at).cast()) };
        }
    }

    /// `acc[r][j] += Σ_s a[r·a_rs + s·a_cs] · b[s·b_rs + 16·j ..][..16]` over
    /// `s < steps`: `R × V` accumulators, each element of `a` broadcast once
    /// and each vector of `b` loaded once per step. Both products are this
    /// kernel: the scores with `a` the keys (rows: keys, steps: head
    /// dimensions) and `b` = Qᵀ; the values with `a` = Pᵀ (rows: stacked
    /// query rows, steps: keys) and `b` = V.
    ///
    /// # Safety
    /// AVX-512F must be available, and every element addressed lies in the
    /// allocations `a` and `b` point into.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn rank1_tile<const R: usize, const V: usize>(
        acc: &mut [[__m512; V]; R],
        a: *const f32,
        (a_rs, a_cs): (usize, usize),
        b: *const f32,
        b_rs: usize,
        steps: usize,
    ) {
        // SAFETY: the caller's bounds.
        unsafe {
            for step in 0..steps {
                let mut w = [_mm512_setzero_ps(); V];
                for (j, wv) in w.iter_mut().enumerate() {
                    *wv = _mm512_loadu_ps(b.add(step * b_rs + 16 * j));
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(*a.add(r * a_rs + step * a_cs));
                    for (acc, wv) in row.iter_mut().zip(&w) {
                        *acc = _mm512_fmadd_ps(x, *wv, *acc);
                    }
                }
            }
        }
    }

    /// `R` keys × `16·MV` columns of `Sᵀ`; `hi` takes the columns' running
    /// maxima.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn score_tile<const R: usize, const MV: usize>(
        k: *const f32,
        d: usize,
        qt: *const f32,
        mp: usize,
        st: *mut f32,
        hi: &mut [__m512; MV],
    ) {
        let mut acc = [[_mm512_setzero_ps(); MV]; R];
        // SAFETY: the caller guarantees R key rows of d floats at k, d rows
        // of mp floats at qt (16·MV of them from qt on), R rows at st.
        unsafe {
            rank1_tile(&mut acc, k, (d, 1), qt, mp, d);
            for (r, row) in acc.iter().enumerate() {
                for ((v, a), h) in row.iter().enumerate().zip(hi.iter_mut()) {
                    _mm512_storeu_ps(st.add(r * mp + 16 * v), *a);
                    *h = _mm512_max_ps(*h, *a);
                }
            }
        }
    }

    /// Columns `c0..c0 + 16·DV` of `O` for every stacked row, `R` rows per
    /// tile; `(rows, c0, accumulate)` as in `weighted_values`.
    ///
    /// # Safety
    /// AVX-512F must be available; `o` holds `rows·d`, `pt` `n·mp` and `v`
    /// `n·d` floats, `rows ≤ mp` and `c0 + 16·DV ≤ d`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn value_strip<const R: usize, const DV: usize>(
        o: &mut [f32],
        pt: &[f32],
        v: &[f32],
        Dims { n, d, mp }: Dims,
        (rows, c0, accumulate): (usize, usize, bool),
    ) {
        let (po, pp, pv) = (o.as_mut_ptr(), pt.as_ptr(), v.as_ptr());
        // Keys in blocks whose rows of Pᵀ and V stay in L1 while every row
        // tile passes over them; unblocked, each tile streams both from L2.
        let mut i0 = 0;
        // SAFETY: tile (i0, m) covers keys i0..i0 + kb ≤ n, rows m..m + R ≤
        // rows and columns c0..c0 + 16·DV ≤ d.
        unsafe {
            loop {
                let kb = (n - i0).min(VALUE_KEY_BLOCK);
                let (p, w, first) = (pp.add(i0 * mp), pv.add(i0 * d + c0), i0 == 0 && !accumulate);
                // The next block's values, while this block's tiles compute.
                prefetch(pv, ((i0 + kb) * d).min(n * d)..((i0 + 2 * kb) * d).min(n * d));
                let mut m = 0;
                while m + R <= rows {
                    value_tile::<R, DV>(p.add(m), mp, w, d, kb, po.add(m * d + c0), first);
                    m += R;
                }
                while m < rows {
                    value_tile::<1, DV>(p.add(m), mp, w, d, kb, po.add(m * d + c0), first);
                    m += 1;
                }
                i0 += kb;
                if i0 >= n {
                    break;
                }
            }
        }
    }

    /// `R` rows × `16·DV` columns of `O` over `n` keys; the accumulators
    /// start at zero when `first`, else at what `o` holds.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn value_tile<const R: usize, const DV: usize>(
        pt: *const f32,
        mp: usize,
        v: *const f32,
        d: usize,
        n: usize,
        o: *mut f32,
        first: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); DV]; R];
        // SAFETY: the caller guarantees n rows of mp floats at pt (R of them
        // from pt on), n rows of d floats at v (16·DV from v on), R rows of d at o.
        unsafe {
            if !first {
                for (r, row) in acc.iter_mut().enumerate() {
                    for (j, a) in row.iter_mut().enumerate() {
                        *a = _mm512_loadu_ps(o.add(r * d + 16 * j));
                    }
                }
            }
            rank1_tile(&mut acc, pt, (1, mp), v, d, n);
            for (r, row) in acc.iter().enumerate() {
                for (j, a) in row.iter().enumerate() {
                    _mm512_storeu_ps(o.add(r * d + 16 * j), *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32) * seed).sin()).collect()
    }

    #[test]
    fn queries_are_packed_transposed_and_scaled() {
        let (d, width) = (24, 100);
        let q: Vec<f32> = (0..10 * width).map(|i| i as f32).collect();
        for rows in [vec![0usize, 100, 376], (0..17).map(|i| 30 + i * 50).collect::<Vec<_>>()] {
            let mp = rows.len().next_multiple_of(16);
            let mut qt = vec![f32::NAN; d * mp];
            pack_queries_t(&mut qt, &q, &rows, d, mp, 0.5);
            for c in 0..d {
                for m in 0..mp {
                    let want = rows.get(m).map_or(0.0, |&r| q[r + c] * 0.5);
                    assert_eq!(qt[c * mp + m], want, "c {c} m {m}");
                }
            }
        }
    }

    /// Both kernels against the plain definitions, for every strip width
    /// and tile remainder, on the dispatched path and the portable one.
    #[test]
    fn kernels_match_the_definitions() {
        for (n, d, rows) in [
            (0usize, 64usize, 3usize),
            (1, 16, 1),
            (13, 64, 57),
            (37, 128, 19),
            (200, 64, 57),
            (29, 32, 40),
            (50, 24, 5),
            (7, 80, 64),
        ] {
            let mp = rows.next_multiple_of(16);
            let dims = Dims { n, d, mp };
            let (k, qt, v) = (data(n * d, 0.37), data(d * mp, 0.11), data(n * d, 0.23));
            let want_s: Vec<f32> =
                (0..n * mp).map(|x| (0..d).map(|c| k[(x / mp) * d + c] * qt[c * mp + x % mp]).sum()).collect();
            let want_o: Vec<f32> =
                (0..rows * d).map(|x| (0..n).map(|i| want_s[i * mp + x / d] * v[i * d + x % d]).sum()).collect();
            let close = |a: &[f32], b: &[f32], what: &str| {
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    assert!(
                        x == y || (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                        "{what} n={n} d={d} rows={rows} at {i}: {x} vs {y}"
                    );
                }
            };
            let want_max: Vec<f32> =
                (0..mp).map(|m| (0..n).map(|i| want_s[i * mp + m]).fold(f32::NEG_INFINITY, f32::max)).collect();
            type Scores = fn(&mut [f32], &mut [f32], &[f32], &[f32], &[f32], Dims);
            type Values = fn(&mut [f32], &[f32], &[f32], Dims, (usize, bool));
            let dispatched: (Scores, Values) =
                (|st, max, k, v, qt, dims| scores_t(st, max, (k, v), qt, dims), weighted_values);
            let portable: (Scores, Values) =
                (|st, max, k, _, qt, dims| scores_t_portable(st, max, k, qt, dims), weighted_values_portable);
            for (path, (scores, values)) in [("dispatched", dispatched), ("portable", portable)] {
                let (mut st, mut o) = (vec![f32::NAN; n * mp], vec![f32::NAN; rows * d]);
                let mut max = vec![f32::NEG_INFINITY; mp];
                scores(&mut st, &mut max, &k, &v, &qt, dims);
                close(&st, &want_s, &format!("{path} scores"));
                close(&max, &want_max, &format!("{path} column maxima"));
                values(&mut o, &want_s, &v, dims, (rows, false));
                close(&o, &want_o, &format!("{path} values"));
                // Accumulating onto the same result doubles it.
                values(&mut o, &want_s, &v, dims, (rows, true));
                close(&o, &want_o.iter().map(|x| 2.0 * x).collect::<Vec<_>>(), &format!("{path} accumulated values"));
            }
        }
    }
}
