//! E1–E4 (docs/design.md §1): the exactness of KV injection, on four random-weight
//! shapes (MHA; GQA + tied embeddings + llama3 RoPE scaling; Qwen2 QKV bias;
//! explicit head_dim + linear scaling) and on SmolLM2, CPU backend.
//!
//! Tolerances, and why they are right for f32:
//! - E1 (re-rotation = forward at that position): layer 0's stored key is the
//!   very vector the forward computes, rotated by the same code, so it must be
//!   bit-identical; deeper layers see keys computed at another absolute
//!   position, where the f32 angles `p·θ` round differently (≤ ulp(p)/2), so
//!   a relative bound of 1e-5 per layer (docs/design.md §1). Measured: 1.9e-7
//!   (tiny), 7.0e-7 (SmolLM2).
//! - E2 (injecting exactly-computed prefix KV = prompt injection): the same
//!   operations on the same numbers except for GEMM blocking of different
//!   chunk shapes: logits within 1e-4 (tiny, |logits| ≲ 10) / 5e-4 (SmolLM2,
//!   30 layers, |logits| ≲ 30) absolute, greedy continuations identical.
//!   Measured: 5.4e-7 / 2.1e-5.
//! - E3 (independent chunks = block-diagonal mask): compared with the dense
//!   masked reference (tests/common/dense.rs), itself checked against the
//!   transformers golden logits below; same bounds as E2. Measured: 7.8e-7 /
//!   5.0e-5.
//! - E4 (stored tensors independent of the encoding offset): offset 0 vs 1000
//!   (505 for the tiny models' 512-token context), relative 1e-4 per layer —
//!   only the f32 angle rounding at large positions separates them.
//!   Measured: 6.3e-6 (SmolLM2).
//!
//! Every comparison is paired with a perturbed one (a position off by one,
//! facts in another order, plain causal attention) that must miss by far
//! more than the bound, so the checks can fail.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use common::dense::Dense;
use common::*;
use inferscale_engine::{CpuBackend, Engine, KvChunk, Sequence};
use inferscale_model::{Message, ModelFiles};

/// A prompt laid out as in docs/design.md §3.
struct Layout {
    header: Vec<u32>,
    facts: Vec<Vec<u32>>,
    question: Vec<u32>,
}

impl Layout {
    fn all(&self) -> Vec<u32> {
        let mut v = self.header.clone();
        self.facts.iter().for_each(|f| v.extend(f));
        v.extend(&self.question);
        v
    }

    fn prefix_len(&self) -> usize {
        self.header.len() + self.facts.iter().map(Vec::len).sum::<usize>()
    }
}

struct Tol {
    e1_rel: f32,
    logits_abs: f32,
    e4_rel: f32,
}

const TINY: Tol = Tol { e1_rel: 1e-5, logits_abs: 1e-4, e4_rel: 1e-4 };
/// Real models (SmolLM2-135M; Qwen2.5-Coder-1.5B, observed E1 2.5e-6, E3
/// 6.8e-5 absolute on its logits, E4 7.5e-6).
const REAL: Tol = Tol { e1_rel: 1e-5, logits_abs: 5e-4, e4_rel: 1e-4 };

fn tiny_layout() -> Layout {
    let t = |seed: u32, n: u32| (0..n).map(|i| 3 + (seed * 37 + i * 101) % 250).collect::<Vec<u32>>();
    Layout { header: t(1, 12), facts: vec![t(2, 5), t(3, 9), t(4, 7)], question: t(5, 6) }
}

/// A header, three facts and a question in the model's ChatML template.
fn chat_layout(files: &ModelFiles) -> Layout {
    let tok = files.tokenizer.as_ref().unwrap();
    let tmpl = files.chat_template.as_ref().unwrap();
    let text = tmpl
        .render(
            &[Message::new("system", "Answer using the facts the user has shared before."), Message::new("user", "")],
            false,
        )
        .unwrap();
    // The header is the rendered system turn plus the opening of the user turn.
    let header_text = &text[..text.rfind("<|im_end|>").unwrap()];
    let enc = |s: &str| tok.encode(s, false).unwrap();
    Layout {
        header: enc(header_text),
        facts: vec![
            enc(" Caroline adopted a grey cat named Miso in May 2023."),
            enc(" Melanie ran a charity race for mental health last Saturday."),
            enc(" Caroline is moving to Lisbon to study counselling."),
        ],
        question: enc("\nWhere is Caroline moving?<|im_end|>\n<|im_start|>assistant\n"),
    }
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    max_abs_diff(a, b) / scale
}

fn engine(files: &ModelFiles) -> Engine<CpuBackend> {
    cpu_engine(files, 64)
}

/// Prefills the header, injects `chunks` after it, prefills the question;
/// returns the logits after the question and the sequence.
fn inject_then_ask(e: &mut Engine<CpuBackend>, l: &Layout, chunks: &[&KvChunk<CpuBackend>]) -> (Vec<f32>, Sequence) {
    let mut seq = e.new_sequence(l.header.clone()).unwrap();
    e.prefill(&mut seq).unwrap();
    e.inject(&mut seq, chunks).unwrap();
    seq.extend(&l.question);
    (e.prefill(&mut seq).unwrap(), seq)
}

fn e1(name: &str, files: &ModelFiles, l: &Layout, tol: &Tol) {
    let mut e = engine(files);
    let fact = &l.facts[1];
    let chunk = e.encode(&[], fact, 0).unwrap();
    let h = l.header.len();
    // Injection after the header puts the fact at positions h..
    let mut injected = e.new_sequence(l.header.clone()).unwrap();
    e.prefill(&mut injected).unwrap();
    e.inject(&mut injected, &[&chunk]).unwrap();
    // The same tokens computed by a forward pass at those positions.
    let mut fwd = e.new_sequence_at(fact.clone(), h as u32).unwrap();
    e.prefill(&mut fwd).unwrap();
    // And one position off, which must not match.
    let mut off = e.new_sequence_at(fact.clone(), h as u32 + 1).unwrap();
    e.prefill(&mut off).unwrap();
    let mut worst = 0f32;
    for layer in 0..files.config.num_layers {
        let (ki, vi) = e.cached_kv(&injected, layer).unwrap();
        let (kf, vf) = e.cached_kv(&fwd, layer).unwrap();
        let (ko, _) = e.cached_kv(&off, layer).unwrap();
        let w = ki.data.len() / injected.len();
        let ki = &ki.data[h * w..];
        let vi = &vi.data[h * w..];
        let rk = rel(ki, &kf.data);
        if layer == 0 {
            assert_eq!(ki, &kf.data[..], "{name}: layer 0 keys must be bit-identical");
        }
        assert!(rk < tol.e1_rel, "{name} E1 layer {layer}: relative |ΔK| {rk:.2e}");
        assert!(rel(vi, &vf.data) < tol.e1_rel, "{name} E1 layer {layer}: V differs");
        assert!(rel(ki, &ko.data) > 100.0 * tol.e1_rel, "{name} E1 layer {layer}: off-by-one position not detected");
        worst = worst.max(rk);
    }
    eprintln!("{name}: E1 worst relative |ΔK| over layers {worst:.2e}");
}

fn e2(name: &str, files: &ModelFiles, l: &Layout, tol: &Tol) {
    let mut e = engine(files);
    let all = l.all();
    let p = l.prefix_len();
    let mut full = e.new_sequence(all.clone()).unwrap();
    let want = e.prefill(&mut full).unwrap();
    // Each fact's KV computed exactly: with everything before it in context.
    let mut chunks = Vec::new();
    let mut start = l.header.len();
    for f in &l.facts {
        let mut s = e.new_sequence(all[..p].to_vec()).unwrap();
        chunks.push(e.prefill_and_capture(&mut s, start..start + f.len()).unwrap().1);
        start += f.len();
    }
    let refs: Vec<&KvChunk<CpuBackend>> = chunks.iter().collect();
    let (got, mut seq) = inject_then_ask(&mut e, l, &refs);
    let d = max_abs_diff(&got, &want);
    assert!(d < tol.logits_abs, "{name} E2: max |Δlogit| {d:.2e}");
    assert_eq!(seq.tokens(), &all[..], "{name} E2: the injected sequence holds the prompt's tokens");
    // Greedy continuations agree for a few steps.
    assert_same_continuations(&mut e, (&mut seq, &got), (&mut full, &want), 4, &format!("{name} E2"));
    // Injecting the facts in another order must change the answer's logits.
    let swapped: Vec<&KvChunk<CpuBackend>> = vec![refs[1], refs[0], refs[2]];
    let (bad, _) = inject_then_ask(&mut e, l, &swapped);
    assert!(max_abs_diff(&bad, &want) > 10.0 * tol.logits_abs, "{name} E2: wrong order not detected");
    eprintln!("{name}: E2 max |Δlogit| {d:.2e}");
}

/// Row i may see row j: causal, and a fact token sees only its own fact
/// (plus the header when `with_header`).
fn block_mask(l: &Layout, with_header: bool) -> impl Fn(usize, usize) -> bool {
    let h = l.header.len();
    let mut bounds = Vec::new();
    let mut s = h;
    for f in &l.facts {
        bounds.push(s..s + f.len());
        s += f.len();
    }
    move |i, j| {
        if j > i {
            return false;
        }
        match bounds.iter().find(|r| r.contains(&i)) {
            Some(r) => r.contains(&j) || (with_header && j < h),
            None => true,
        }
    }
}

fn e3(name: &str, files: &ModelFiles, l: &Layout, tol: &Tol) {
    let mut e = engine(files);
    let dense = Dense::load(files);
    let all = l.all();
    let positions: Vec<u32> = (0..all.len() as u32).collect();
    // Isolated encodings (w = 0): each fact alone, at offset 0.
    let chunks: Vec<_> = l.facts.iter().map(|f| e.encode(&[], f, 0).unwrap()).collect();
    let refs: Vec<&KvChunk<CpuBackend>> = chunks.iter().collect();
    let (got, _) = inject_then_ask(&mut e, l, &refs);
    let want = dense.forward(&all, &positions, block_mask(l, false));
    let d = max_abs_diff(&got, want.last().unwrap());
    assert!(d < tol.logits_abs, "{name} E3 isolated: max |Δlogit| {d:.2e}");
    // Plain causal attention is a different model of the prompt: the check must tell them apart.
    let causal = dense.forward(&all, &positions, |i, j| j <= i);
    assert!(max_abs_diff(&got, causal.last().unwrap()) > 10.0 * tol.logits_abs, "{name} E3: mask not detected");

    // Header in each encoding, each fact encoded at the offset it is served at.
    let mut at = l.header.len() as u32;
    let chunks: Vec<_> = l
        .facts
        .iter()
        .map(|f| {
            let c = e.encode(&l.header, f, at).unwrap();
            at += f.len() as u32;
            c
        })
        .collect();
    let refs: Vec<&KvChunk<CpuBackend>> = chunks.iter().collect();
    let (got, _) = inject_then_ask(&mut e, l, &refs);
    let want = dense.forward(&all, &positions, block_mask(l, true));
    let d2 = max_abs_diff(&got, want.last().unwrap());
    assert!(d2 < tol.logits_abs, "{name} E3 with header: max |Δlogit| {d2:.2e}");
    eprintln!("{name}: E3 max |Δlogit| isolated {d:.2e}, with header {d2:.2e}");
}

fn e4(name: &str, files: &ModelFiles, l: &Layout, tol: &Tol) {
    let mut e = engine(files);
    let fact = &l.facts[2];
    let (k0, v0) = e.encode(&[], fact, 0).unwrap().to_host(&CpuBackend).unwrap();
    let far = 1000.min(files.config.max_position_embeddings - fact.len()) as u32;
    let (k1, v1) = e.encode(&[], fact, far).unwrap().to_host(&CpuBackend).unwrap();
    let mut worst = 0f32;
    for layer in 0..k0.len() {
        let (rk, rv) = (rel(&k1[layer].data, &k0[layer].data), rel(&v1[layer].data, &v0[layer].data));
        assert!(rk < tol.e4_rel && rv < tol.e4_rel, "{name} E4 layer {layer}: relative |ΔK| {rk:.2e}, |ΔV| {rv:.2e}");
        worst = worst.max(rk).max(rv);
    }
    // Encoding with context does change the stored tensors (beyond layer 0).
    let (kc, _) = e.encode(&l.facts[0], fact, l.facts[0].len() as u32).unwrap().to_host(&CpuBackend).unwrap();
    let last = k0.len() - 1;
    assert!(rel(&kc[last].data, &k0[last].data) > 100.0 * tol.e4_rel, "{name} E4: context had no effect");
    eprintln!("{name}: E4 worst relative difference offset 0 vs {far}: {worst:.2e}");
}

fn all_properties(name: &str, files: &ModelFiles, l: &Layout, tol: &Tol) {
    e1(name, files, l, tol);
    e2(name, files, l, tol);
    e3(name, files, l, tol);
    e4(name, files, l, tol);
}

#[test]
fn dense_reference_reproduces_transformers() {
    for name in TINY_SHAPES {
        let (g, files, _dir) = open_tiny(name);
        let dense = Dense::load(&files);
        let positions: Vec<u32> = (0..g.input_ids.len() as u32).collect();
        let got = dense.forward(&g.input_ids, &positions, |i, j| j <= i);
        for (p, (a, b)) in got.iter().zip(&g.logits).enumerate() {
            assert!(max_abs_diff(a, b) < 1e-4, "{name} position {p}");
        }
    }
}

#[test]
fn e1_to_e4_on_tiny_shapes() {
    for name in TINY_SHAPES {
        let (_, files, _dir) = open_tiny(name);
        all_properties(name, &files, &tiny_layout(), &TINY);
    }
}

#[test]
fn e1_to_e4_on_smollm2() {
    let files = open_smollm2();
    let l = chat_layout(&files);
    all_properties("smollm2", &files, &l, &REAL);
}

/// The real model of the answer-quality measurements: 28 layers, 2 KV heads
/// of 128 dims, QKV bias, RoPE base 1e6.
#[test]
#[ignore = "needs Qwen2.5-Coder-1.5B (1.1 GB): inferscale fetch qwen2.5-coder-1.5b"]
fn e1_to_e4_on_qwen() {
    let files = open_qwen();
    let l = chat_layout(&files);
    all_properties("qwen2.5-coder-1.5b", &files, &l, &REAL);
}

/// Encoding several facts in shared forward passes gives the same stored
/// tensors as encoding each alone (different GEMM shapes only reorder sums).
#[test]
fn batched_encoding_matches_single_encodings() {
    let (_, files, _dir) = open_tiny("tiny_qwen2_bias");
    let l = tiny_layout();
    let mut e = cpu_engine(&files, 24); // small budget: encodings span several passes
    let items: Vec<inferscale_engine::EncodeItem<'_>> = l
        .facts
        .iter()
        .enumerate()
        .map(|(i, f)| inferscale_engine::EncodeItem {
            context: if i == 1 { &l.header[..] } else { &[] },
            fact: f,
            fact_position: if i == 1 { l.header.len() as u32 + 3 } else { 7 * i as u32 },
        })
        .collect();
    let batched = e.encode_batch(&items).unwrap();
    for (it, got) in items.iter().zip(&batched) {
        let want = e.encode(it.context, it.fact, it.fact_position).unwrap();
        assert_eq!(got.tokens, want.tokens);
        let (gk, gv) = got.to_host(&CpuBackend).unwrap();
        let (wk, wv) = want.to_host(&CpuBackend).unwrap();
        for (a, b) in gk.iter().chain(&gv).zip(wk.iter().chain(&wv)) {
            assert!(rel(&a.data, &b.data) < 1e-5, "batched vs single: {:e}", rel(&a.data, &b.data));
        }
    }
    assert_eq!(e.pool().free_blocks(), e.pool().total_blocks(), "temporary sequences freed");
}
