//! Token sampling: greedy, temperature, top-k, top-p, seeded.

use crate::error::{EngineError, Result};

/// How the next token is chosen and when generation stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p; 1 disables.
    pub top_p: f32,
    pub seed: u64,
    pub max_tokens: usize,
    /// Generation stops when the text contains one of these; it is not part of the output.
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            max_tokens: 256,
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams { max_tokens, ..Default::default() }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |name, reason: &str| Err(EngineError::InvalidSampling { name, reason: reason.to_string() });
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", "must be a finite number ≥ 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]");
        }
        if self.stop.iter().any(String::is_empty) {
            return bad("stop", "stop strings must not be empty");
        }
        Ok(())
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, reproducible across
/// platforms, which is all sampling needs.
#[derive(Debug, Clone)]
pub struct Rng([u64; 4]);

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let mut next = || {
            sm = sm.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Index of the largest logit, lowest index on ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The gap between the two largest logits (how near a greedy choice was
/// to a tie).
pub fn top2_margin(logits: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in logits {
        if x > a {
            (a, b) = (x, a);
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// log-softmax in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// Picks the next token from `logits` under `params`.
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut Rng) -> u32 {
    if params.temperature == 0.0 || params.top_k == 1 {
        return argmax(logits);
    }
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    if params.top_k > 0 {
        order.truncate(params.top_k);
    }
    let t = params.temperature as f64;
    let max = logits[order[0] as usize] as f64;
    let mut probs: Vec<f64> = order.iter().map(|&i| ((logits[i as usize] as f64 - max) / t).exp()).collect();
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    if params.top_p < 1.0 {
        let mut acc = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                acc += p;
                acc >= params.top_p as f64
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        order.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let mut r = rng.next_f64() * total;
    for (p, &id) in probs.iter().zip(&order) {
        if r < *p {
            return id;
        }
        r -= p;
    }
    order[order.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_lowest_index_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        let p = SamplingParams::greedy(1);
        assert_eq!(sample(&[0.0, 2.0, 1.0], &p, &mut Rng::new(1)), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let p = SamplingParams { temperature: 1.0, top_k: 3, seed: 7, ..Default::default() };
        let mut order: Vec<usize> = (0..50).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let allowed = &order[..3];
        let (mut r1, mut r2) = (Rng::new(7), Rng::new(7));
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let a = sample(&logits, &p, &mut r1);
            assert_eq!(a, sample(&logits, &p, &mut r2));
            assert!(allowed.contains(&(a as usize)));
            seen.insert(a);
        }
        assert!(seen.len() > 1, "temperature 1 over 3 tokens should vary");
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // Probabilities ≈ [0.64, 0.24, 0.09, 0.03]: p = 0.5 keeps only the first.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let p = SamplingParams { temperature: 1.0, top_p: 0.5, ..Default::default() };
        let mut rng = Rng::new(3);
        for _ in 0..100 {
            assert_eq!(sample(&logits, &p, &mut rng), 0);
        }
    }

    #[test]
    fn invalid_params_are_rejected() {
        let p = SamplingParams { top_p: 0.0, ..Default::default() };
        assert!(p.validate().is_err());
        let p = SamplingParams { temperature: f32::NAN, ..Default::default() };
        assert!(p.validate().is_err());
    }
}
