//! Weights packed for the CPU's matrix kernel, and the kernel itself.
//!
//! A weight `[out, in]` is stored as panels of [`NR`] output rows, each panel
//! laid out `[in][NR]`: the kernel streams a panel once per block of [`MR`]
//! input rows, loading NR consecutive floats per step and broadcasting one
//! value of each input row against them (MR × NR/16 accumulators in AVX-512
//! registers). Packing once at load replaces the per-call packing a general
//! GEMM does, which dominates at the small row counts of decode and of short
//! prefills (a question after injected memory).

use rayon::prelude::*;

/// Output rows per panel (three AVX-512 vectors).
pub const NR: usize = 48;
/// Input rows per kernel call.
const MR: usize = 8;

/// A weight matrix `[rows, cols]` in panel layout.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedMatrix {
    rows: usize,
    cols: usize,
    /// `ceil(rows / NR)` panels of `cols × NR` floats; rows past the end are zero.
    data: Vec<f32>,
}

impl PackedMatrix {
    pub fn pack(rows: usize, cols: usize, w: &[f32]) -> Self {
        assert_eq!(w.len(), rows * cols, "pack shape");
        let panels = rows.div_ceil(NR);
        let mut data = vec![0f32; panels * cols * NR];
        data.par_chunks_mut(cols * NR).enumerate().for_each(|(p, panel)| {
            for r in 0..NR.min(rows - p * NR) {
                let row = &w[(p * NR + r) * cols..(p * NR + r + 1) * cols];
                for (kk, &x) in row.iter().enumerate() {
                    panel[kk * NR + r] = x;
                }
            }
        });
        PackedMatrix { rows, cols, data }
    }

    /// Row `r` of the original matrix.
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let (p, c) = (r / NR, r % NR);
        let panel = &self.data[p * self.cols * NR..(p + 1) * self.cols * NR];
        for (kk, o) in out.iter_mut().enumerate().take(self.cols) {
            *o = panel[kk * NR + c];
        }
    }

    pub fn unpack(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.row(r, row);
        }
        out
    }

    /// `out[m, rows] = a[m, cols] · selfᵀ`, parallel over panels.
    pub fn matmul(&self, a: &[f32], m: usize, out: &mut [f32]) {
        let (n, k) = (self.rows, self.cols);
        assert!(a.len() == m * k && out.len() == m * n, "packed matmul shapes");
        if m == 0 || n == 0 {
            return;
        }
        let kernel = Kernel::detect();
        // Each task fills an [m, NR] block for one panel; blocks are then
        // scattered into the row-major output.
        let blocks: Vec<Vec<f32>> = self
            .data
            .par_chunks(k * NR)
            .map(|panel| {
                let mut c = vec![0f32; m * NR];
                let mut i = 0;
                while i < m {
                    let mr = (m - i).min(MR);
                    let (ai, ci) = (&a[i * k..(i + mr) * k], &mut c[i * NR..(i + mr) * NR]);
                    kernel.run(mr, ai, k, panel, ci);
                    i += mr;
                }
                c
            })
            .collect();
        for (p, c) in blocks.iter().enumerate() {
            let w = NR.min(n - p * NR);
            for i in 0..m {
                out[i * n + p * NR..i * n + p * NR + w].copy_from_slice(&c[i * NR..i * NR + w]);
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kernel {
    Avx512,
    Portable,
}

impl Kernel {
    fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            return Kernel::Avx512;
        }
        Kernel::Portable
    }

    /// `c[mr, NR] = a[mr, k] · panel[k, NR]`.
    fn run(self, mr: usize, a: &[f32], k: usize, panel: &[f32], c: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self == Kernel::Avx512 {
            // SAFETY: AVX-512F was detected; a holds mr rows of k, the panel k × NR, c mr × NR.
            unsafe {
                match mr {
                    8 => avx512::<8>(a, k, panel, c),
                    7 => avx512::<7>(a, k, panel, c),
                    6 => avx512::<6>(a, k, panel, c),
                    5 => avx512::<5>(a, k, panel, c),
                    4 => avx512::<4>(a, k, panel, c),
                    3 => avx512::<3>(a, k, panel, c),
                    2 => avx512::<2>(a, k, panel, c),
                    _ => avx512::<1>(a, k, panel, c),
                }
            }
            return;
        }
        portable(mr, a, k, panel, c);
    }
}

fn portable(mr: usize, a: &[f32], k: usize, panel: &[f32], c: &mut [f32]) {
    for i in 0..mr {
        let row = &mut c[i * NR..(i + 1) * NR];
        row.fill(0.0);
        for kk in 0..k {
            let x = a[i * k + kk];
            for (o, w) in row.iter_mut().zip(&panel[kk * NR..(kk + 1) * NR]) {
                *o += x * w;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512<const R: usize>(a: &[f32], k: usize, panel: &[f32], c: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(a.len() >= R * k && panel.len() >= k * NR && c.len() >= R * NR);
    let (pa, pb) = (a.as_ptr(), panel.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); 3]; R];
    // SAFETY: reads a[i*k + kk] for i < R, kk < k and panel[kk*NR .. kk*NR + 48]
    // for kk < k, all within the asserted lengths.
    unsafe {
        for kk in 0..k {
            let b0 = _mm512_loadu_ps(pb.add(kk * NR));
            let b1 = _mm512_loadu_ps(pb.add(kk * NR + 16));
            let b2 = _mm512_loadu_ps(pb.add(kk * NR + 32));
            for (i, row) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*pa.add(i * k + kk));
                row[0] = _mm512_fmadd_ps(x, b0, row[0]);
                row[1] = _mm512_fmadd_ps(x, b1, row[1]);
                row[2] = _mm512_fmadd_ps(x, b2, row[2]);
            }
        }
        let pc = c.as_mut_ptr();
        for (i, row) in acc.iter().enumerate() {
            for (j, v) in row.iter().enumerate() {
                _mm512_storeu_ps(pc.add(i * NR + 16 * j), *v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_product_matches_naive_for_every_remainder() {
        for (m, n, k) in [(1, 1, 1), (3, 47, 5), (8, 48, 16), (9, 97, 33), (17, 130, 64), (70, 20, 20)] {
            let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
            let p = PackedMatrix::pack(n, k, &w);
            assert_eq!(p.unpack(), w);
            let mut out = vec![0f32; m * n];
            p.matmul(&a, m, &mut out);
            let mut port = vec![0f32; m * NR];
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|x| a[i * k + x] * w[j * k + x]).sum();
                    assert!((out[i * n + j] - want).abs() < 1e-4, "({m},{n},{k}) at ({i},{j})");
                }
            }
            // The portable kernel agrees with the vector one on the first panel.
            for i in (0..m).step_by(MR) {
                let mr = (m - i).min(MR);
                portable(mr, &a[i * k..(i + mr) * k], k, &p.data[..k * NR], &mut port[i * NR..(i + mr) * NR]);
            }
            for i in 0..m {
                for j in 0..n.min(NR) {
                    assert!((port[i * NR + j] - out[i * n + j]).abs() < 1e-4);
                }
            }
        }
    }
}
