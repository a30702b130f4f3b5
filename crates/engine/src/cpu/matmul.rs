//! Matrix products on the CPU through the `gemm` crate.

use gemm::{Parallelism, gemm};

/// Below this many multiply-adds a product runs on the calling thread:
/// splitting small products across threads costs more than it saves.
const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// Up to this many rows of `a`, products take the streaming path: decode
/// steps are bound by reading the weights, and a GEMM's packing of the
/// weight matrix would read it twice.
const SMALL_M: usize = 16;
/// Weight rows per parallel task on the streaming path.
const ROWS_PER_TASK: usize = 64;

/// `out[m, n] = a[m, k] · b[n, k]ᵀ`, all row-major and contiguous.
pub fn matmul_bt(out: &mut [f32], a: &[f32], b: &[f32], m: usize, n: usize, k: usize) {
    assert!(out.len() == m * n && a.len() == m * k && b.len() == n * k, "matmul_bt shapes");
    if m <= SMALL_M && k > 0 {
        return matmul_bt_small(out, a, b, m, n, k);
    }
    let par = if m * n * k >= PARALLEL_MIN_FLOPS { Parallelism::Rayon(0) } else { Parallelism::None };
    // SAFETY: the slices have the lengths asserted above, and the strides
    // below address exactly those elements: a is [m,k] row-major, bᵀ reads b
    // [n,k] with column stride k, out is [m,n] row-major.
    unsafe {
        gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// Streams each row of `b` once and dots it with every row of `a`.
fn matmul_bt_small(out: &mut [f32], a: &[f32], b: &[f32], m: usize, n: usize, k: usize) {
    use rayon::prelude::*;
    // Transposed result [n, m] so that tasks own contiguous output.
    let mut t = vec![0f32; n * m];
    t.par_chunks_mut(ROWS_PER_TASK * m).zip(b.par_chunks(ROWS_PER_TASK * k)).for_each(|(t, b)| {
        let rows = b.len() / k;
        let mut j = 0;
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // 4 weight rows × 2 input rows per kernel call: each loaded
            // weight vector feeds two FMAs and reductions are amortised.
            while j + 4 <= rows {
                let mut i = 0;
                while i + 2 <= m {
                    // SAFETY: features detected above; slices hold 4 rows of b and 2 rows of a of length k.
                    let r = unsafe { dot_4x2_avx2(&b[j * k..(j + 4) * k], &a[i * k..(i + 2) * k], k) };
                    for (jj, pair) in r.chunks_exact(2).enumerate() {
                        t[(j + jj) * m + i] = pair[0];
                        t[(j + jj) * m + i + 1] = pair[1];
                    }
                    i += 2;
                }
                if i < m {
                    for jj in j..j + 4 {
                        t[jj * m + i] = dot(&a[i * k..(i + 1) * k], &b[jj * k..(jj + 1) * k]);
                    }
                }
                j += 4;
            }
        }
        for jj in j..rows {
            for i in 0..m {
                t[jj * m + i] = dot(&a[i * k..(i + 1) * k], &b[jj * k..(jj + 1) * k]);
            }
        }
    });
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = t[j * m + i];
        }
    }
}

/// Dots of 4 rows of `w` with 2 rows of `x` (each of length `k`), returned
/// as `[w0·x0, w0·x1, w1·x0, …]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_4x2_avx2(w: &[f32], x: &[f32], k: usize) -> [f32; 8] {
    use std::arch::x86_64::*;
    assert!(w.len() >= 4 * k && x.len() >= 2 * k);
    let (pw, px) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut c = 0;
    // SAFETY: loads read 8 floats at row offsets c..c+8 ≤ k within the asserted lengths.
    unsafe {
        while c + 8 <= k {
            let x0 = _mm256_loadu_ps(px.add(c));
            let x1 = _mm256_loadu_ps(px.add(k + c));
            for r in 0..4 {
                let wv = _mm256_loadu_ps(pw.add(r * k + c));
                acc[2 * r] = _mm256_fmadd_ps(wv, x0, acc[2 * r]);
                acc[2 * r + 1] = _mm256_fmadd_ps(wv, x1, acc[2 * r + 1]);
            }
            c += 8;
        }
        let mut out = [0f32; 8];
        for (o, a) in out.iter_mut().zip(acc) {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), a);
            *o = lanes.iter().sum();
        }
        for r in 0..4 {
            for cc in c..k {
                let wv = w[r * k + cc];
                out[2 * r] += wv * x[cc];
                out[2 * r + 1] += wv * x[k + cc];
            }
        }
        out
    }
}

/// Dot product, with an AVX2/FMA kernel where the CPU has one.
pub(crate) fn dot(x: &[f32], y: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the features the kernel is compiled for were just detected.
            return unsafe { dot_avx2(x, y) };
        }
    }
    dot_portable(x, y)
}

fn dot_portable(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (xc, yc) = (x.chunks_exact(8), y.chunks_exact(8));
    let tail: f32 = xc.remainder().iter().zip(yc.remainder()).map(|(a, b)| a * b).sum();
    for (a, b) in xc.zip(yc) {
        for l in 0..8 {
            acc[l] += a[l] * b[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(x: &[f32], y: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len().min(y.len());
    let (px, py) = (x.as_ptr(), y.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: every load reads 8 floats at offsets < n, bounded by the loop conditions.
    unsafe {
        while i + 32 <= n {
            for (l, a) in acc.iter_mut().enumerate() {
                let o = i + 8 * l;
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(o)), _mm256_loadu_ps(py.add(o)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)), acc[0]);
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), s);
        lanes.iter().sum::<f32>() + x[i..n].iter().zip(&y[i..n]).map(|(a, b)| a * b).sum::<f32>()
    }
}

/// A strided view of a matrix: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Strided<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl Strided<'_> {
    /// Whether every element of an `[m, n]` view lies inside `data`.
    fn fits(&self, m: usize, n: usize) -> bool {
        m == 0 || n == 0 || self.data.len() > (m - 1) * self.rs + (n - 1) * self.cs
    }
}

/// Single-threaded product used inside attention tasks:
/// `out[m, n] (row stride out_rs) = alpha · a[m, k] · b[k, n]`.
pub(crate) fn gemm_strided(
    out: &mut [f32],
    out_rs: usize,
    a: Strided<'_>,
    b: Strided<'_>,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(out.len() >= (m - 1) * out_rs + n, "gemm_strided out");
    assert!(a.fits(m, k) && b.fits(k, n), "gemm_strided operands");
    // SAFETY: the asserts above bound every element the strides address.
    unsafe {
        gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            out_rs as isize,
            false,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            0.0,
            alpha,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_paths_match_naive_product() {
        for (m, n, k) in [(5, 70, 37), (40, 9, 33), (1, 130, 64), (8, 131, 576), (3, 4, 5)] {
            check(m, n, k);
        }
    }

    fn check(m: usize, n: usize, k: usize) {
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.1).sin()).collect();
        let b: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.3).cos()).collect();
        let mut out = vec![0.0; m * n];
        matmul_bt(&mut out, &a, &b, m, n, k);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|x| a[i * k + x] * b[j * k + x]).sum();
                assert!((out[i * n + j] - want).abs() < 1e-4, "({m},{n},{k}) at ({i},{j})");
            }
        }
    }
}
