//! Token sampling: penalties, greedy or temperature with top-k, min-p and
//! top-p, seeded; and the log-probabilities a request may ask for.

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
    /// Drop tokens less likely than `min_p` times the most likely; 0 disables.
    pub min_p: f32,
    /// HF's repetition penalty over the prompt's and the output's tokens:
    /// a positive logit is divided by it, a negative one multiplied; 1 disables.
    pub repetition_penalty: f32,
    /// OpenAI's penalties over the output's tokens: the logit of a token
    /// generated `n` times loses `presence_penalty + n × frequency_penalty`.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Report each chosen token's log-probability and this many of the
    /// most likely alternatives.
    pub logprobs: Option<usize>,
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
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: None,
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
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "must be in [0, 1]");
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad("repetition_penalty", "must be a finite number > 0");
        }
        if !(self.presence_penalty.is_finite() && self.frequency_penalty.is_finite()) {
            return bad("presence_penalty", "the penalties must be finite");
        }
        if self.stop.iter().any(String::is_empty) {
            return bad("stop", "stop strings must not be empty");
        }
        Ok(())
    }

    /// Whether the logits are changed by the tokens seen before choosing.
    pub fn penalizes(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Whether choosing takes the whole distribution on the host, rather
    /// than the argmax a device can reduce to alone.
    pub fn needs_logits(&self) -> bool {
        (self.temperature != 0.0 && self.top_k != 1) || self.penalizes() || self.logprobs.is_some()
    }
}

/// The tokens a sequence holds when its next token is chosen: the prompt's
/// (memory included) and those generated so far. Penalties look at them.
#[derive(Debug, Clone, Copy, Default)]
pub struct History<'a> {
    pub prompt: &'a [u32],
    pub output: &'a [u32],
}

/// Applies `params`' penalties to `logits` for the tokens in `seen`: the
/// repetition penalty as HF's `RepetitionPenaltyLogitsProcessor` (each
/// distinct token of prompt and output once), then OpenAI's presence and
/// frequency penalties over the output.
pub fn penalize(logits: &mut [f32], params: &SamplingParams, seen: History<'_>) {
    if params.repetition_penalty != 1.0 {
        let mut ids: Vec<u32> = seen.prompt.iter().chain(seen.output).copied().collect();
        ids.sort_unstable();
        ids.dedup();
        let p = params.repetition_penalty;
        for &id in &ids {
            if let Some(l) = logits.get_mut(id as usize) {
                *l = if *l > 0.0 { *l / p } else { *l * p };
            }
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        let mut ids = seen.output.to_vec();
        ids.sort_unstable();
        for run in ids.chunk_by(|a, b| a == b) {
            if let Some(l) = logits.get_mut(run[0] as usize) {
                *l -= params.presence_penalty + params.frequency_penalty * run.len() as f32;
            }
        }
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

/// How far the first-token distribution of `logits` is from that of
/// `reference` (logits over the same vocabulary): KL(reference ‖ logits),
/// and whether the two greedy tokens agree. What kv mode's answer-quality
/// audit reports against prompt mode.
pub fn divergence(reference: &[f32], logits: &[f32]) -> (f64, bool) {
    let (lp, lq) = (log_softmax(reference), log_softmax(logits));
    let kl = lp.iter().zip(&lq).map(|(&p, &q)| p.exp() * (p - q)).sum::<f64>().max(0.0);
    (kl, argmax(reference) == argmax(logits))
}

/// Picks the next token from `logits` under `params`, `seen` being what the
/// penalties look at: penalties first, then greedy or — at a temperature —
/// the top-k cut, the softmax, the min-p and top-p cuts, and a draw.
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut Rng, seen: History<'_>) -> u32 {
    let penalized;
    let logits = match params.penalizes() {
        true => {
            let mut l = logits.to_vec();
            penalize(&mut l, params, seen);
            penalized = l;
            &penalized[..]
        }
        false => logits,
    };
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
    if params.min_p > 0.0 {
        // Sorted: the most likely first, so the kept ones are a prefix.
        let floor = params.min_p as f64 * probs[0];
        let keep = probs.iter().position(|&p| p < floor).unwrap_or(probs.len());
        probs.truncate(keep);
        order.truncate(keep);
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
    }
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

/// A chosen token's log-probability and the most likely alternatives'.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub chosen: (u32, f32),
    /// Most likely first (lowest id on ties).
    pub top: Vec<(u32, f32)>,
}

/// The log-probabilities of `chosen` and of the `n` most likely tokens under
/// the model's own distribution — before penalties, temperature or cuts,
/// as vLLM reports them by default.
pub fn logprobs(logits: &[f32], chosen: u32, n: usize) -> TokenLogprobs {
    let lp = log_softmax(logits);
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(order.len());
    if n > 0 {
        order.select_nth_unstable_by(n - 1, |&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
    }
    order.truncate(n);
    order.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
    TokenLogprobs {
        chosen: (chosen, lp.get(chosen as usize).copied().unwrap_or(f64::NEG_INFINITY) as f32),
        top: order.into_iter().map(|i| (i, lp[i as usize] as f32)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divergence_is_zero_for_the_same_distribution_and_kl_otherwise() {
        let a = [1.0, 3.0, 0.5, -2.0];
        assert_eq!(divergence(&a, &a), (0.0, true));
        // Shifting every logit keeps the distribution.
        let shifted: Vec<f32> = a.iter().map(|x| x + 7.0).collect();
        let (kl, agree) = divergence(&a, &shifted);
        assert!(kl < 1e-12 && agree, "{kl}");
        // p = (0.5, 0.5), q = (0.8, 0.2): KL = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.2231.
        let (p, q) = ([0.0, 0.0], [4f32.ln(), 0.0]);
        let (kl, agree) = divergence(&p, &q);
        assert!((kl - 0.223_143_551).abs() < 1e-6, "{kl}");
        assert!(agree, "a tie goes to the lowest id on both sides");
        let (_, agree) = divergence(&q, &[0.0, 1.0]);
        assert!(!agree);
    }

    #[test]
    fn greedy_takes_lowest_index_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        let p = SamplingParams::greedy(1);
        assert_eq!(sample(&[0.0, 2.0, 1.0], &p, &mut Rng::new(1), History::default()), 1);
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
            let a = sample(&logits, &p, &mut r1, History::default());
            assert_eq!(a, sample(&logits, &p, &mut r2, History::default()));
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
            assert_eq!(sample(&logits, &p, &mut rng, History::default()), 0);
        }
    }

    #[test]
    fn top_k_of_one_is_greedy_at_any_temperature() {
        let logits: Vec<f32> = (0..40).map(|i| ((i * 7) % 13) as f32 * 0.3).collect();
        let p = SamplingParams { temperature: 1.5, top_k: 1, ..Default::default() };
        let mut rng = Rng::new(5);
        for _ in 0..50 {
            assert_eq!(sample(&logits, &p, &mut rng, History::default()), argmax(&logits));
        }
    }

    #[test]
    fn penalties_follow_hf_and_openai_formulas() {
        // HF: score = score < 0 ? score * p : score / p, once per distinct
        // token of prompt and output, whatever its count.
        let mut l = vec![2.0f32, -1.0, 0.5, 3.0];
        let p = SamplingParams { repetition_penalty: 2.0, ..Default::default() };
        penalize(&mut l, &p, History { prompt: &[0, 1, 1], output: &[1] });
        assert_eq!(l, vec![1.0, -2.0, 0.5, 3.0]);
        // OpenAI: logit -= count × frequency + (count > 0) × presence, over the output only.
        let mut l = vec![2.0f32, -1.0, 0.5, 3.0];
        let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
        penalize(&mut l, &p, History { prompt: &[2, 2], output: &[3, 3, 3, 0] });
        assert_eq!(l, vec![2.0 - 0.75, -1.0, 0.5, 3.0 - 1.25]);
        // Greedy sampling sees the penalized logits: token 3 loses its lead.
        let p = SamplingParams { frequency_penalty: 1.0, ..Default::default() };
        assert!(p.needs_logits());
        let seen = History { prompt: &[], output: &[3, 3] };
        assert_eq!(sample(&[2.0, -1.0, 0.5, 3.0], &p, &mut Rng::new(1), seen), 0);
    }

    #[test]
    fn min_p_keeps_tokens_near_the_most_likely() {
        // Probabilities ≈ [0.47, 0.29, 0.17, 0.06]: min_p 0.5 keeps the
        // tokens at ≥ 0.235, the first two.
        let logits = [2.0f32, 1.5, 1.0, 0.0];
        let p = SamplingParams { temperature: 1.0, min_p: 0.5, ..Default::default() };
        let mut rng = Rng::new(11);
        let seen: std::collections::HashSet<u32> =
            (0..300).map(|_| sample(&logits, &p, &mut rng, History::default())).collect();
        assert_eq!(seen, [0, 1].into_iter().collect());
    }

    #[test]
    fn logprobs_are_the_models_log_softmax_most_likely_first() {
        let logits = [1.0f32, 3.0, 3.0, -2.0];
        let lp = log_softmax(&logits);
        let got = logprobs(&logits, 3, 2);
        assert_eq!(got.chosen, (3, lp[3] as f32));
        assert_eq!(got.top, vec![(1, lp[1] as f32), (2, lp[2] as f32)]);
        assert!(logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(logprobs(&logits, 0, 9).top.len(), 4);
        let total: f64 = lp.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
    }

    #[test]
    fn invalid_params_are_rejected() {
        let p = SamplingParams { top_p: 0.0, ..Default::default() };
        assert!(p.validate().is_err());
        let p = SamplingParams { temperature: f32::NAN, ..Default::default() };
        assert!(p.validate().is_err());
    }
}
