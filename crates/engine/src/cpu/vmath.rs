//! Vectorised elementwise math for the CPU backend.
//!
//! `exp` calls into libm run one element at a time; softmax over long
//! contexts and SiLU over wide MLPs spend most of their time there. The
//! Cephes single-precision polynomial below (max error ~2 ulp on the range
//! used) is branch-free, so the compiler vectorises it; each public function
//! is compiled for AVX-512 and AVX2 and dispatched at run time.

/// exp(x) for x in [-87.3, 88.7], ~2 ulp; 0 below (where the true value is
/// a denormal or less, and where softmax puts masked keys: exp(−∞) must be
/// exactly 0), exp(88.7) above. (Cephes' last coefficient, 5.0000001201e-1,
/// rounds to 0.5 in f32.)
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    let underflow = x < -87.3;
    let x = x.clamp(-87.3, 88.7);
    let n = x.mul_add(LOG2E, 0.5).floor();
    let r = n.mul_add(-C2, n.mul_add(-C1, x));
    let z = r * r;
    // Horner with fused multiply-adds: the dispatched builds below enable
    // FMA, where each step is one instruction.
    let p = [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5]
        .iter()
        .fold(1.987_569_1e-4f32, |acc, &c| acc.mul_add(r, c));
    let y = p.mul_add(z, r) + 1.0;
    // 2^n by building the exponent bits; n ∈ [-126, 128] after the clamp.
    // Adding 2^23 puts the integer n + 127 (in [1, 255]) in the low mantissa
    // bits: integer ops only, so the loop stays vectorised (an `as i32` cast
    // saturates, which compiles to a scalar conversion per lane).
    let biased = (n + (127.0 + 8_388_608.0)).to_bits().wrapping_sub(0x4B00_0000);
    let scale = f32::from_bits(biased.min(255) << 23);
    if underflow { 0.0 } else { y * scale }
}

#[inline(always)]
fn exp_shift_sum_generic(xs: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = xs.chunks_exact_mut(16);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c.iter_mut()) {
            *x = exp(*x - shift);
            *a += *x;
        }
    }
    let mut tail = 0.0;
    for x in chunks.into_remainder() {
        *x = exp(*x - shift);
        tail += *x;
    }
    acc.iter().sum::<f32>() + tail
}

/// Per column of the row-major `[rows, width]` matrix `xs`: `x ← exp(x −
/// shift[col])`, and `sum[col]` ← the column's sum.
#[inline(always)]
fn exp_sub_cols_sum_generic(xs: &mut [f32], shift: &[f32], sum: &mut [f32]) {
    let width = shift.len();
    let sum = &mut sum[..width];
    sum.fill(0.0);
    for row in xs.chunks_exact_mut(width) {
        for ((x, s), acc) in row.iter_mut().zip(shift).zip(sum.iter_mut()) {
            *x = exp(*x - s);
            *acc += *x;
        }
    }
}

#[inline(always)]
fn silu_mul_generic(out: &mut [f32], gate: &[f32], up: &[f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

macro_rules! dispatch {
    ($(#[$doc:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty => $generic:ident) => {
        $(#[$doc])*
        pub fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) -> $ret { $generic($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret { $generic($($arg),*) }
                if std::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports the features the function is compiled for.
                    return unsafe { avx512($($arg),*) };
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    };
}

dispatch! {
    /// `x ← exp(x − shift)` for every element; returns the sum.
    pub fn exp_shift_sum(xs: &mut [f32], shift: f32) -> f32 => exp_shift_sum_generic
}

dispatch! {
    /// Per column of a row-major matrix `[rows, shift.len()]`: `x ← exp(x −
    /// shift[col])`; `sum` gets each column's sum.
    pub fn exp_sub_cols_sum(xs: &mut [f32], shift: &[f32], sum: &mut [f32]) -> () => exp_sub_cols_sum_generic
}

dispatch! {
    /// `out = silu(gate) · up`, elementwise.
    pub fn silu_mul(out: &mut [f32], gate: &[f32], up: &[f32]) -> () => silu_mul_generic
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_a_few_ulp_of_libm() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            worst = worst.max(((got - want) / want).abs());
            x += 0.013;
        }
        assert!(worst < 4.0 * f32::EPSILON, "relative error {worst:e}");
        assert_eq!(exp(-87.4), 0.0, "below the range: 0");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0, "a masked score: exactly 0");
        assert!(exp(-87.3) > 0.0);
        assert_eq!(exp(1000.0), exp(88.7));
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn exp_shift_sum_matches_scalar() {
        let xs: Vec<f32> = (0..37).map(|i| -(i as f32) * 0.7).collect();
        let mut ys = xs.clone();
        let s = exp_shift_sum(&mut ys, -0.5);
        let want: Vec<f32> = xs.iter().map(|x| (x + 0.5).exp()).collect();
        for (a, b) in ys.iter().zip(&want) {
            assert!((a - b).abs() <= 4.0 * f32::EPSILON * b);
        }
        assert!((s - want.iter().sum::<f32>()).abs() < 1e-5 * s);
    }

    #[test]
    fn exp_sub_cols_sum_matches_scalar() {
        let (rows, width) = (7, 19);
        let xs: Vec<f32> = (0..rows * width).map(|i| ((i as f32) * 0.7).sin() * 5.0).collect();
        let max: Vec<f32> =
            (0..width).map(|c| (0..rows).map(|r| xs[r * width + c]).fold(f32::NEG_INFINITY, f32::max)).collect();
        let mut ys = xs.clone();
        ys[3 * width + 2] = f32::NEG_INFINITY;
        let mut sum = vec![f32::NAN; width];
        exp_sub_cols_sum(&mut ys, &max, &mut sum);
        assert_eq!(ys[3 * width + 2], 0.0, "a masked score contributes nothing");
        for c in 0..width {
            let want: f32 = (0..rows).map(|r| ys[r * width + c]).sum();
            assert!((sum[c] - want).abs() <= 1e-6 * want, "column {c}");
            let x = xs[c];
            assert!((ys[c] - (x - max[c]).exp()).abs() <= 4.0 * f32::EPSILON);
        }
    }
}
