//! The fp8 paged cache (`--kv-cache-dtype fp8`, docs/design.md §2.2)
//! through the engine, against the f32 cache: a model's next-token
//! distributions stay within the fp8 gate's tolerance (mean KL ≤ 0.01, as
//! for fp8 segments, §2.1) on the Qwen2 tiny shape with planted offset key
//! channels and on SmolLM2, and E2 — injecting a prefix's exact KV equals
//! prefilling it — holds on an fp8 cache within a stated bound. Each check
//! is paired with a control that must miss by far more (the same cache
//! without its key offsets, another prompt, facts in another order).

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use common::*;
use inferscale_engine::backend::KvCacheDtype;
use inferscale_engine::sampling::argmax;
use inferscale_engine::{CpuBackend, Engine, EngineConfig, KvChunk};
use inferscale_model::ModelFiles;

/// The gate's tolerance on the mean first-token KL (fp8 segments use the same).
const KL_TOL: f64 = 0.01;

/// E2 on an fp8 cache, max |Δlogit| (SmolLM2, |logits| ≲ 30). A key
/// injected and the same key written by the forward pass round to the same
/// codes (the same arithmetic: measured Δ 0); where the prefix's KV was
/// computed in other chunk shapes, an f32 difference may still flip a code
/// here and there, which moves logits far less than this. (A build that
/// rounded the two paths differently — every key — missed by 0.16.)
const E2_ABS: f32 = 0.05;

fn engine(files: &ModelFiles, dtype: KvCacheDtype) -> Engine<CpuBackend> {
    Engine::with_cache(CpuBackend, files, EngineConfig { kv_blocks: 256, max_batch_tokens: 64 }, dtype).unwrap()
}

/// KL(p ‖ q) of the distributions two logit rows give.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

/// The last logits of a prefill of `tokens`, then after each of `steps`
/// tokens — greedy, or taken from `forced` (the reference's greedy tokens,
/// so that both caches see the same text) — and the tokens taken.
fn logits(
    e: &mut Engine<CpuBackend>,
    tokens: &[u32],
    steps: usize,
    forced: Option<&[u32]>,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut seq = e.new_sequence(tokens.to_vec()).unwrap();
    let (mut out, mut taken) = (vec![e.prefill(&mut seq).unwrap()], Vec::with_capacity(steps));
    for i in 0..steps {
        let t = forced.map_or_else(|| argmax(&out[i]), |f| f[i]);
        taken.push(t);
        seq.push(t);
        out.push(e.prefill(&mut seq).unwrap());
    }
    (out, taken)
}

/// Mean KL of the fp8 cache's distributions from the f32 cache's over
/// every prompt and forced step, and the same for a control: the f32
/// reference against the fp8 cache's logits of the *next* prompt.
fn compare(files: &ModelFiles, fp8: &mut Engine<CpuBackend>, prompts: &[Vec<u32>], steps: usize) -> (f64, f64) {
    let mut reference = engine(files, KvCacheDtype::Native);
    let mut runs = Vec::new();
    for p in prompts {
        let (want, forced) = logits(&mut reference, p, steps, None);
        runs.push((want, logits(fp8, p, steps, Some(&forced)).0));
    }
    let (mut sum, mut control, mut n) = (0.0, 0.0, 0);
    for (i, (want, got)) in runs.iter().enumerate() {
        let other = &runs[(i + 1) % runs.len()].1;
        for (j, (w, g)) in want.iter().zip(got).enumerate() {
            sum += kl(w, g);
            control += kl(w, &other[j]);
            n += 1;
        }
    }
    (sum / n as f64, control / n as f64)
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(37).wrapping_add(seed * 101 + 11)) % 256).collect()
}

/// Qwen2.5's keys hold channels far from zero in every token — in layer 0
/// −355 and +318 in one head — met by large query values: planted in the
/// tiny Qwen2 shape, two such channels in each KV head. The fp8 cache with
/// its calibrated offsets keeps the distributions; the same cache with zero
/// offsets (keys rounded as they are, a scale per token and head) loses
/// them: the largest channel of a row is exact, the second is rounded in
/// steps of 16, far more than it varies.
#[test]
fn an_fp8_cache_keeps_the_distributions_where_keys_sit_far_from_zero() {
    let g = load_tiny("tiny_qwen2_bias");
    let dir = tempfile::tempdir().unwrap();
    let keys = [(0, 7, -355.0), (0, 6, 300.0), (1, 7, -355.0), (1, 6, 300.0)];
    write_tiny_with_offset_channels(&g, dir.path(), &keys);
    let files = ModelFiles::open(dir.path()).unwrap();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| tokens(i, 24 + 13 * i as usize)).collect();
    let (mean, control) = compare(&files, &mut engine(&files, KvCacheDtype::Fp8), &prompts, 8);
    let zeros = vec![vec![0.0; files.config.kv_dim()]; files.config.num_layers];
    let cfg = EngineConfig { kv_blocks: 256, max_batch_tokens: 64 };
    let mut plain = Engine::with_fp8_offsets(CpuBackend, &files, cfg, &zeros).unwrap();
    let (without, _) = compare(&files, &mut plain, &prompts, 8);
    eprintln!("tiny_qwen2_bias, two offset channels a head: mean KL {mean:.2e}, without offsets {without:.2e}");
    assert!(mean < KL_TOL, "fp8 cache: mean KL {mean:.2e} from the f32 cache");
    assert!(without > 10.0 * KL_TOL, "without offsets the fp8 cache should fail: mean KL {without:.2e}");
    assert!(control > 10.0 * KL_TOL, "control: another prompt's logits, mean KL {control:.2e}");
}

/// SmolLM2: the fp8 cache's distributions against the f32 cache's, E2 on
/// the fp8 cache, and its capacity: four times the tokens a byte of f32
/// cache holds, less the scales and positions.
#[test]
fn on_smollm2_an_fp8_cache_keeps_the_distributions_and_e2() {
    let files = open_smollm2();
    let tok = files.tokenizer.as_ref().unwrap();
    let enc = |s: &str| tok.encode(s, false).unwrap();
    let header = enc("Answer using the facts the user has shared before.\n");
    let facts = [
        enc(" Caroline adopted a grey cat named Miso in May 2023."),
        enc(" Melanie ran a charity race for mental health last Saturday."),
        enc(" Caroline is moving to Lisbon to study counselling."),
    ];
    let question = enc("\nQuestion: where is Caroline moving? Answer:");
    let mut all = header.clone();
    facts.iter().for_each(|f| all.extend(f));
    let prefix = all.len();
    all.extend(&question);

    let prompts = vec![all.clone(), enc("The capital of France is Paris. The capital of Italy is")];
    let (mean, control) = compare(&files, &mut engine(&files, KvCacheDtype::Fp8), &prompts, 6);
    eprintln!("smollm2: mean KL {mean:.2e} (control {control:.2e})");
    assert!(mean < KL_TOL, "fp8 cache: mean KL {mean:.2e} from the f32 cache");
    assert!(control > 10.0 * KL_TOL, "control: another prompt's logits, mean KL {control:.2e}");

    // E2 on the fp8 cache: the header prefilled, each fact's exact KV (with
    // everything before it in context) injected, the question prefilled —
    // the same logits as prefilling it all, and the same greedy tokens; the
    // facts in another order miss by far more.
    let mut e = engine(&files, KvCacheDtype::Fp8);
    let mut full = e.new_sequence(all.clone()).unwrap();
    let want = e.prefill(&mut full).unwrap();
    let mut chunks = Vec::new();
    let mut start = header.len();
    for f in &facts {
        let mut s = e.new_sequence(all[..prefix].to_vec()).unwrap();
        chunks.push(e.prefill_and_capture(&mut s, start..start + f.len()).unwrap().1);
        start += f.len();
    }
    let ask = |e: &mut Engine<CpuBackend>, order: &[&KvChunk<CpuBackend>]| {
        let mut seq = e.new_sequence(header.clone()).unwrap();
        e.prefill(&mut seq).unwrap();
        e.inject(&mut seq, order).unwrap();
        seq.extend(&question);
        (e.prefill(&mut seq).unwrap(), seq)
    };
    let (got, mut seq) = ask(&mut e, &[&chunks[0], &chunks[1], &chunks[2]]);
    let d = max_abs_diff(&got, &want);
    let divergence = kl(&want, &got);
    eprintln!("smollm2 fp8 E2: max |Δlogit| {d:.2e}, KL {divergence:.2e}");
    assert!(d < E2_ABS && divergence < KL_TOL / 10.0, "fp8 E2: max |Δlogit| {d:.2e}, KL {divergence:.2e}");
    assert_same_continuations(&mut e, (&mut seq, &got), (&mut full, &want), 4, "fp8 E2");
    let (bad, _) = ask(&mut e, &[&chunks[1], &chunks[0], &chunks[2]]);
    let (wrong, wrong_kl) = (max_abs_diff(&bad, &want), kl(&want, &bad));
    eprintln!("smollm2 fp8 E2 control (facts reordered): max |Δlogit| {wrong:.2e}, KL {wrong_kl:.2e}");
    assert!(wrong > 10.0 * E2_ABS && wrong_kl > KL_TOL / 10.0, "fp8 E2: facts in another order not detected");

    let bytes = 256 << 20;
    let blocks = |dtype| EngineConfig::for_cache(&files, bytes, 64, dtype, 4).kv_blocks as f64;
    let ratio = blocks(KvCacheDtype::Fp8) / blocks(KvCacheDtype::Native);
    assert!((3.5..4.0).contains(&ratio), "an fp8 cache holds {ratio:.2}× the tokens of an f32 cache");
}
