//! kv+blend (crates/engine/src/blend.rs) against references, CPU backend:
//! - ratio 0 leaves the sequence exactly as kv mode does (bit-identical
//!   logits and cache);
//! - ratio 1 is prompt mode: logits within the E2/E3 bounds of a full
//!   prefill of the same tokens;
//! - in between, the tokens kept past the selection layer are the ones a
//!   dense forward ranks first there — by how far their values deviate, by
//!   the attention the question's queries pay their keys, or by how near
//!   they are to their fact's start — and the logits equal the dense
//!   reference's (`Dense::forward_blend`) with those tokens recomputed — in
//!   one pass and in chunks. A set off by one token must miss by far more
//!   than the bound, so the check can fail.
//!
//! The golden tiny models have 2 layers, where nothing follows the
//! selection layer; these tests rebuild them with 5 (layers 2–4 drawn from
//! the same generator under their own names).

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use common::dense::Dense;
use common::*;
use inferscale_engine::{BLEND_SELECT_LAYER, CpuBackend, Engine, KvChunk, Sequence, blend_keep_count};
use inferscale_model::ModelFiles;
use inferscale_types::{Blend, BlendSelect};

const TINY_TOL: f32 = 1e-4;
const D: BlendSelect = BlendSelect::Deviation;
const Q: BlendSelect = BlendSelect::Question;
const F: BlendSelect = BlendSelect::FactStarts;
const SMOL_TOL: f32 = 5e-4;

/// A golden tiny model with `layers` layers instead of 2.
fn open_deep(name: &str, layers: usize) -> (ModelFiles, tempfile::TempDir) {
    let mut g = load_tiny(name);
    g.config["num_hidden_layers"] = layers.into();
    let extra: Vec<TensorSpec> = (2..layers)
        .flat_map(|l| {
            g.tensors.iter().filter(|t| t.name.starts_with("model.layers.0.")).map(move |t| TensorSpec {
                name: t.name.replacen("model.layers.0.", &format!("model.layers.{l}."), 1),
                shape: t.shape.clone(),
                scale: t.scale,
                offset: t.offset,
            })
        })
        .collect();
    g.tensors.extend(extra);
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(&g, dir.path());
    (ModelFiles::open(dir.path()).unwrap(), dir)
}

/// docs/design.md §3: a header, facts, a question.
struct Layout {
    header: Vec<u32>,
    facts: Vec<Vec<u32>>,
    question: Vec<u32>,
}

impl Layout {
    fn tiny() -> Layout {
        let t = |seed: u32, n: u32| (0..n).map(|i| 3 + (seed * 37 + i * 101) % 250).collect::<Vec<u32>>();
        Layout { header: t(1, 12), facts: vec![t(2, 9), t(3, 12), t(4, 7), t(6, 11)], question: t(5, 6) }
    }

    fn chat(files: &ModelFiles) -> Layout {
        let tok = files.tokenizer.as_ref().unwrap();
        let enc = |s: &str| tok.encode(s, false).unwrap();
        Layout {
            header: enc("<|im_start|>system\nAnswer using the facts.<|im_end|>\n<|im_start|>user\n"),
            facts: vec![
                enc("Caroline adopted a grey cat named Miso in May 2023.\n"),
                enc("Melanie ran a charity race for mental health last Saturday.\n"),
                enc("Caroline is moving to Lisbon to study counselling.\n"),
            ],
            question: enc("Where is Caroline moving?<|im_end|>\n<|im_start|>assistant\n"),
        }
    }

    fn all(&self) -> Vec<u32> {
        let mut v = self.header.clone();
        self.facts.iter().for_each(|f| v.extend(f));
        v.extend(&self.question);
        v
    }

    fn injected(&self) -> std::ops::Range<usize> {
        let h = self.header.len();
        h..h + self.facts.iter().map(Vec::len).sum::<usize>()
    }

    /// What the injected KV was computed with: each fact after the header
    /// at the offset it is served at (E3 with header).
    fn kv_mask(&self) -> impl Fn(usize, usize) -> bool + '_ {
        move |i, j| {
            if j > i {
                return false;
            }
            let mut at = self.header.len();
            for f in &self.facts {
                if (at..at + f.len()).contains(&i) {
                    return j < self.header.len() || (at..at + f.len()).contains(&j);
                }
                at += f.len();
            }
            true
        }
    }

    fn chunks(&self, e: &mut Engine<CpuBackend>) -> Vec<KvChunk<CpuBackend>> {
        let mut at = self.header.len() as u32;
        self.facts
            .iter()
            .map(|f| {
                let c = e.encode(&self.header, f, at).unwrap();
                at += f.len() as u32;
                c
            })
            .collect()
    }
}

/// Header prefilled, facts injected, question pending, blended as `blend`
/// says if given; returns the logits after the question and the sequence.
fn ask(e: &mut Engine<CpuBackend>, l: &Layout, blend: Option<Blend>) -> (Vec<f32>, Sequence) {
    let chunks = l.chunks(e);
    let mut seq = e.new_sequence(l.header.clone()).unwrap();
    e.prefill(&mut seq).unwrap();
    e.inject(&mut seq, &chunks.iter().collect::<Vec<_>>()).unwrap();
    seq.extend(&l.question);
    if let Some(blend) = blend {
        e.blend(&mut seq, l.injected().len(), blend).unwrap();
    }
    (e.prefill(&mut seq).unwrap(), seq)
}

fn blend(ratio: f32, focus: f32, select: BlendSelect) -> Blend {
    Blend { ratio, focus, select }
}

/// The tokens kept past the selection layer: the last `focus` share of
/// the `ratio` share of all injected tokens, whatever their rank; and per
/// chunk of `max_batch` candidates, up to its `ratio` share
/// (`blend_keep_count`, or its forced tokens if more), those `rank` puts
/// first (given the chunk and the question rows that share its pass).
fn selection(
    l: &Layout,
    rank: impl Fn(&[usize], std::ops::Range<usize>) -> Vec<f32>,
    ratio: f32,
    focus: f32,
    max_batch: usize,
) -> Vec<usize> {
    let mut kept = Vec::new();
    let inj: Vec<usize> = l.injected().collect();
    let tail = (focus as f64 * blend_keep_count(ratio, inj.len()) as f64).round() as usize;
    let forced = |j: usize| j >= l.injected().end - tail;
    for chunk in inj.chunks(max_batch) {
        // The question's rows in this chunk's pass: those after the last
        // candidate, as many as the pass has room for.
        let q0 = l.injected().end;
        let question =
            if chunk.last() == inj.last() { q0..q0 + l.question.len().min(max_batch - chunk.len()) } else { q0..q0 };
        let score = rank(chunk, question);
        let n_forced = chunk.iter().filter(|&&j| forced(j)).count();
        let keep = blend_keep_count(ratio, chunk.len()).max(n_forced);
        let key = |i: usize| if forced(chunk[i]) { f32::INFINITY } else { score[i] };
        let mut order: Vec<usize> = (0..chunk.len()).collect();
        order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
        kept.extend(order[..keep].iter().map(|&i| chunk[i]));
    }
    kept.sort();
    kept
}

/// One case of [`check_against_dense`]: (ratio, max_batch, focus, selection).
type Case = (f32, usize, f32, BlendSelect);

fn check_against_dense(name: &str, files: &ModelFiles, l: &Layout, tol: f32, cases: &[Case]) {
    let dense = Dense::load(files);
    let all = l.all();
    let positions: Vec<u32> = (0..all.len() as u32).collect();
    let s = BLEND_SELECT_LAYER;
    let inj = l.injected();
    let is_fact = |j: usize| inj.contains(&j);
    // Every injected token recomputed through the selection layer: the
    // ranks there, as the engine computes them.
    let at_select = dense.forward_blend(&all, &positions, l.kv_mask(), |li, j| !is_fact(j) || li <= s);
    let mut fact_starts = vec![inj.start];
    for f in &l.facts[..l.facts.len() - 1] {
        fact_starts.push(fact_starts.last().unwrap() + f.len());
    }
    for &(ratio, max_batch, focus, select) in cases {
        let rank = |chunk: &[usize], question: std::ops::Range<usize>| -> Vec<f32> {
            match select {
                BlendSelect::Question if !question.is_empty() => {
                    dense.attention_mass(&at_select.q[s], &at_select.k[s], &question.collect::<Vec<_>>(), chunk)
                }
                BlendSelect::Deviation | BlendSelect::Question => {
                    chunk.iter().map(|&j| at_select.deviation[s][j]).collect()
                }
                BlendSelect::FactStarts => chunk
                    .iter()
                    .map(|&j| -((j - fact_starts.iter().rev().find(|&&f| f <= j).unwrap()) as f32))
                    .collect(),
            }
        };
        let label = format!("{name} r {ratio} batch {max_batch} focus {focus} {select}");
        let mut e = cpu_engine(files, max_batch);
        let (got, seq) = ask(&mut e, l, Some(blend(ratio, focus, select)));
        let kept = selection(l, rank, ratio, focus, max_batch);
        assert_eq!(seq.recomputed(), kept.len(), "{label}: tokens recomputed");
        let reference = |kept: &[usize]| {
            let r =
                dense.forward_blend(&all, &positions, l.kv_mask(), |li, j| !is_fact(j) || li <= s || kept.contains(&j));
            r.logits.last().unwrap().clone()
        };
        let d = max_abs_diff(&got, &reference(&kept));
        assert!(d < tol, "{label}: max |Δlogit| {d:.2e}");
        // The same count of tokens, one of them another: must be told apart.
        let mut other = kept.clone();
        let swap = inj.clone().find(|j| !kept.contains(j)).unwrap();
        other[kept.len() / 2] = swap;
        let miss = max_abs_diff(&got, &reference(&other));
        assert!(miss > 10.0 * tol, "{label}: a different selection not detected ({miss:.2e})");
        eprintln!("{label}: {} of {} recomputed {kept:?}, max |Δlogit| {d:.2e}", kept.len(), inj.len());
    }
}

#[test]
fn blend_matches_the_dense_reference_on_tiny_shapes() {
    for name in TINY_SHAPES {
        let (files, _dir) = open_deep(name, 5);
        // One pass; and chunks of 16 rows, which cut the candidates (each
        // chunk keeps its own share) and put the question in a later pass;
        // half and all of the recomputed tokens the memory's last ones.
        // Each selection in one pass and in chunks (where the question rank
        // falls back to deviation in the chunks before the question's).
        let mut cases =
            vec![(0.3, 64, 0.0, D), (0.15, 64, 0.0, D), (0.3, 16, 0.0, D), (0.3, 64, 0.5, D), (0.3, 16, 1.0, D)];
        cases.extend([(0.3, 64, 0.0, Q), (0.15, 64, 0.0, Q), (0.3, 16, 0.0, Q), (0.3, 64, 0.5, Q)]);
        cases.extend([(0.3, 64, 0.0, F), (0.15, 64, 0.0, F), (0.3, 16, 0.0, F)]);
        check_against_dense(name, &files, &Layout::tiny(), TINY_TOL, &cases);
    }
}

#[test]
fn blend_matches_the_dense_reference_on_smollm2() {
    let files = open_smollm2();
    let cases = [(0.2, 256, 0.0, D), (0.2, 256, 0.5, D), (0.2, 256, 0.0, Q), (0.2, 256, 0.0, F)];
    check_against_dense("smollm2", &files, &Layout::chat(&files), SMOL_TOL, &cases);
}

/// Ratio 0 is kv mode to the bit; ratio 1 is prompt mode's prefill.
fn anchors(name: &str, files: &ModelFiles, l: &Layout, tol: f32) {
    let layers = files.config.num_layers;
    let mut e = cpu_engine(files, 64);
    let (kv, kv_seq) = ask(&mut e, l, None);
    for select in BlendSelect::ALL {
        let (zero, zero_seq) = ask(&mut e, l, Some(blend(0.0, 0.0, select)));
        assert_eq!(zero, kv, "{name} {select}: ratio 0 logits");
        assert_eq!(zero_seq.recomputed(), 0);
        for layer in 0..layers {
            let same = e.cached_kv(&zero_seq, layer).unwrap() == e.cached_kv(&kv_seq, layer).unwrap();
            assert!(same, "{name} {select} layer {layer}");
        }
    }
    // Ratio 1 keeps every token whatever ranks them.
    for select in [BlendSelect::Question, BlendSelect::FactStarts] {
        let (one, _) = ask(&mut e, l, Some(blend(1.0, 0.0, select)));
        let (dev, _) = ask(&mut e, l, Some(blend(1.0, 0.0, BlendSelect::Deviation)));
        assert_eq!(one, dev, "{name} {select}: ratio 1");
    }
    let (one, one_seq) = ask(&mut e, l, Some(blend(1.0, 0.0, BlendSelect::Deviation)));
    assert_eq!(one_seq.recomputed(), l.injected().len());
    let mut prompt = e.new_sequence(l.all()).unwrap();
    let want = e.prefill(&mut prompt).unwrap();
    let d = max_abs_diff(&one, &want);
    assert!(d < tol, "{name}: ratio 1 vs prompt mode: max |Δlogit| {d:.2e}");
    assert!(max_abs_diff(&kv, &want) > 10.0 * tol, "{name}: kv and prompt mode agree: the check cannot fail");
    // The facts' cache entries are prompt mode's too, in the last layer.
    let (k1, v1) = e.cached_kv(&one_seq, layers - 1).unwrap();
    let (kp, vp) = e.cached_kv(&prompt, layers - 1).unwrap();
    let rows = l.injected();
    let w = k1.shape[1];
    let part = |t: &[f32]| t[rows.start * w..rows.end * w].to_vec();
    let dk = max_abs_diff(&part(&k1.data), &part(&kp.data));
    let dv = max_abs_diff(&part(&v1.data), &part(&vp.data));
    assert!(dk < tol && dv < tol, "{name}: ratio 1 cache vs prompt mode: |ΔK| {dk:.2e}, |ΔV| {dv:.2e}");
    eprintln!("{name}: ratio 1 vs prompt mode max |Δlogit| {d:.2e}");
}

#[test]
fn ratio_zero_is_kv_mode_and_ratio_one_is_prompt_mode() {
    for name in TINY_SHAPES {
        let (files, _dir) = open_deep(name, 5);
        anchors(name, &files, &Layout::tiny(), TINY_TOL);
    }
    let files = open_smollm2();
    anchors("smollm2", &files, &Layout::chat(&files), SMOL_TOL);
}

#[test]
fn blend_refuses_what_it_cannot_do() {
    let (files, _dir) = open_deep(TINY_SHAPES[0], 3);
    let mut e = cpu_engine(&files, 64);
    let l = Layout::tiny();
    let mut seq = e.new_sequence(l.header.clone()).unwrap();
    e.prefill(&mut seq).unwrap();
    // Nothing pending: nothing would see the blended cache.
    let b = |ratio, focus| blend(ratio, focus, BlendSelect::Question);
    assert!(e.blend(&mut seq, 4, b(0.5, 0.0)).is_err());
    seq.extend(&l.question);
    assert!(e.blend(&mut seq, 4, b(1.5, 0.0)).is_err());
    assert!(e.blend(&mut seq, 4, b(f32::NAN, 0.0)).is_err());
    assert!(e.blend(&mut seq, 4, b(0.5, 1.5)).is_err());
    assert!(e.blend(&mut seq, l.header.len() + 1, b(0.5, 0.0)).is_err(), "more tokens than are computed");
    e.blend(&mut seq, 4, b(0.5, 0.0)).unwrap();
    assert!(e.blend(&mut seq, 4, b(0.5, 0.0)).is_err(), "a second plan");
    assert_eq!(seq.pending(), 4 + l.question.len());
    e.prefill(&mut seq).unwrap();
    assert_eq!((seq.pending(), seq.recomputed()), (0, 2));
}
