//! Vectorised elementwise math for the CPU backend.
//!
//! `exp` calls into libm run one element at a time; softmax over long
//! contexts and SiLU over wide MLPs spend most of their time there. The
//! Cephes single-precision polynomial below (max error ~2 ulp on the range
//! used) is branch-free, so the compiler vectorises it; each public function
//! is compiled for AVX-512 and AVX2 and dispatched at run time.

/// exp(x) for x in [-87.3, 88.7] (clamped outside), ~2 ulp. (Cephes' last
/// coefficient, 5.0000001201e-1, rounds to 0.5 in f32.)
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.7);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * C1 - n * C2;
    let z = r * r;
    let p =
        ((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1) * r + 0.5;
    let y = p * z + r + 1.0;
    // 2^n by building the exponent bits; n ∈ [-126, 128] after the clamp.
    // Adding 2^23 puts the integer n + 127 (in [1, 255]) in the low mantissa
    // bits: integer ops only, so the loop stays vectorised (an `as i32` cast
    // saturates, which compiles to a scalar conversion per lane).
    let biased = (n + (127.0 + 8_388_608.0)).to_bits().wrapping_sub(0x4B00_0000);
    let scale = f32::from_bits(biased.min(255) << 23);
    y * scale
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
        assert_eq!(exp(-1000.0), (-87.3f32).exp().max(exp(-87.3)));
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
}
