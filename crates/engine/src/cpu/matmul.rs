//! General matrix products on the CPU through the `gemm` crate: attention's
//! strided products and row-major `a · bᵀ` (benchmarks, reference code).
//! Weight products use the packed kernel in `packed.rs`.

use gemm::{Parallelism, gemm};

/// Below this many multiply-adds a product runs on the calling thread:
/// splitting small products across threads costs more than it saves.
const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// `out[m, n] = a[m, k] · b[n, k]ᵀ`, all row-major and contiguous.
pub fn matmul_bt(out: &mut [f32], a: &[f32], b: &[f32], m: usize, n: usize, k: usize) {
    assert!(out.len() == m * n && a.len() == m * k && b.len() == n * k, "matmul_bt shapes");
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
        for (m, n, k) in [(5, 70, 37), (40, 9, 33), (1, 130, 64)] {
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
