//! all-MiniLM-L6-v2 through our BERT forward on the CPU backend against
//! sentence-transformers (tests/golden/make_minilm_golden.py).
//!
//! Tolerance: embeddings are unit vectors with components of ~0.05; both
//! sides compute six f32 layers with different summation orders, so a
//! component differs by O(1e-7). We allow 2e-6 absolute per component
//! and 1e-5 in cosine similarities; rankings must be identical (the golden's
//! smallest gap between neighbours in a ranking is 2.8e-3).

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use inferscale_engine::CpuBackend;
use inferscale_engine::bert::Bert;
use serde::Deserialize;

#[derive(Deserialize)]
struct Case {
    text: String,
    input_ids: Vec<u32>,
    embedding: Vec<f32>,
}

#[derive(Deserialize)]
struct Query {
    query: String,
    cosine: Vec<f32>,
    order_desc: Vec<usize>,
}

#[derive(Deserialize)]
struct Similarity {
    candidates: Vec<String>,
    queries: Vec<Query>,
}

#[derive(Deserialize)]
struct Golden {
    max_seq_length: usize,
    cases: Vec<Case>,
    similarity_checks: Similarity,
}

fn golden() -> Golden {
    let path = common::golden_dir().join("minilm.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn encoder() -> Bert<CpuBackend> {
    let files = inferscale_model::encoder::open(inferscale_model::fetch::DEFAULT_EMBEDDER).unwrap();
    Bert::load(&CpuBackend, files).unwrap()
}

#[test]
fn minilm_embeddings_match_sentence_transformers() {
    let g = golden();
    let bert = encoder();
    assert_eq!(bert.dim(), 384);
    let texts: Vec<&str> = g.cases.iter().map(|c| c.text.as_str()).collect();
    // All texts in one forward pass (spans of different lengths), and one at a time.
    let batched = bert.embed(&CpuBackend, &texts).unwrap();
    let mut worst = 0f32;
    for (c, got) in g.cases.iter().zip(&batched) {
        let ids = bert.tokenize(&c.text).unwrap();
        assert_eq!(ids, c.input_ids, "token ids of {:?}", c.text);
        assert!(ids.len() <= g.max_seq_length);
        let single = &bert.embed(&CpuBackend, &[c.text.as_str()]).unwrap()[0];
        for (a, b) in got.iter().zip(single) {
            assert!((a - b).abs() < 1e-6, "batched vs single differ for {:?}", c.text);
        }
        let d = common::max_abs_diff(got, &c.embedding);
        worst = worst.max(d);
        assert!(d < 2e-6, "{:?}: max |Δ| {d:e}", c.text);
    }
    eprintln!("minilm: worst component difference {worst:.2e}");
}

#[test]
fn minilm_rankings_match_sentence_transformers() {
    let s = golden().similarity_checks;
    let bert = encoder();
    let cands: Vec<&str> = s.candidates.iter().map(String::as_str).collect();
    let cand = bert.embed(&CpuBackend, &cands).unwrap();
    for q in &s.queries {
        let qe = &bert.embed(&CpuBackend, &[q.query.as_str()]).unwrap()[0];
        let cos: Vec<f32> = cand.iter().map(|c| c.iter().zip(qe).map(|(a, b)| a * b).sum()).collect();
        for (a, b) in cos.iter().zip(&q.cosine) {
            assert!((a - b).abs() < 1e-5, "{:?}: cosine {a} vs {b}", q.query);
        }
        let mut order: Vec<usize> = (0..cos.len()).collect();
        order.sort_by(|&a, &b| cos[b].total_cmp(&cos[a]));
        assert_eq!(order, q.order_desc, "{:?}", q.query);
    }
}
