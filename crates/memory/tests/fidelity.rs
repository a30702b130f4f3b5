//! The stored-format gate (`inferscale_memory::fidelity`, what `inferscale
//! check --model` runs) on the CPU: on the Qwen2 tiny shape with planted
//! offset key channels — what Qwen2.5's layer-0 keys have — fp8 passes,
//! while the first fp8 layout (one scale per KV head, no key offsets: the
//! layout that wrecked Qwen2.5's answers) fails it by far; and on SmolLM2,
//! the real model CI has, every format passes.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

#[path = "../../engine/tests/common/mod.rs"]
mod common;

use inferscale_engine::fp8::first_layout_round_trip;
use inferscale_engine::{CpuBackend, Engine, EngineConfig, KvChunk};
use inferscale_memory::fidelity::{self, Case, Fidelity, Store};
use inferscale_memory::{KvFormat, KvHeader, MemoryError};
use inferscale_model::{HostTensor, ModelFiles};

fn header(files: &ModelFiles) -> KvHeader {
    let c = &files.config;
    let dtype = KvFormat::F32;
    KvHeader {
        fingerprint: "gate".into(),
        window: 0,
        dtype,
        layers: c.num_layers,
        kv_dim: c.kv_dim(),
        head_dim: c.head_dim,
        layout: KvHeader::layout_of(dtype),
    }
}

fn print(rows: &[Fidelity]) {
    for r in rows {
        eprintln!(
            "{:<22} {:<12} KL {:.2e}  greedy {}/{}  margin at divergence {:?}",
            r.case, r.store, r.kl, r.agreed, r.steps, r.margin_at_divergence
        );
    }
}

/// The first fp8 layout (what segments stored before key offsets): every
/// tensor scaled per KV head alone, then decoded.
fn first_fp8_layout(
    be: &CpuBackend,
    c: &KvChunk<CpuBackend>,
    head_dim: usize,
) -> Result<KvChunk<CpuBackend>, MemoryError> {
    let (k, v) = c.to_host(be)?;
    let q = |ts: &[HostTensor]| ts.iter().map(|t| first_layout_round_trip(t, head_dim)).collect::<Result<Vec<_>, _>>();
    Ok(KvChunk::from_host(be, c.tokens.clone(), &q(&k)?, &q(&v)?)?)
}

/// Deterministic token ids below the tiny models' vocabulary of 256.
fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(37).wrapping_add(seed * 101 + 11)) % 256).collect()
}

#[test]
fn fp8_keeps_planted_offset_key_channels_where_the_first_layout_lost_them() {
    let g = common::load_tiny("tiny_qwen2_bias");
    let dir = tempfile::tempdir().unwrap();
    // Qwen2.5's layer-0 keys hold channels near −355 that vary by about ±1
    // from token to token (the k_proj bias), which queries meet with large
    // values of their own (the q_proj bias): planted here in a slowly
    // rotating channel (7 of 16: RoPE barely turns it) of each KV head, and
    // of each query head, in both layers. The tiny model's logits are made
    // sharper (lm_head × 6) so that what attention reads shows in them.
    let head_dim =
        g.config["hidden_size"].as_u64().unwrap() as usize / g.config["num_attention_heads"].as_u64().unwrap() as usize;
    common::write_tiny_model_with(&g, dir.path(), |name, data| {
        if name.ends_with("k_proj.bias") {
            data[7] = -355.0;
            data[head_dim + 7] = 240.0;
        } else if name.ends_with("q_proj.bias") {
            (0..data.len() / head_dim).for_each(|h| data[h * head_dim + 7] = 4.0);
        } else if name == "lm_head.weight" {
            data.iter_mut().for_each(|x| *x *= 6.0);
        }
    });
    let files = ModelFiles::open(dir.path()).unwrap();
    let hd = files.config.head_dim;
    let mut e = Engine::new(CpuBackend, &files, EngineConfig { kv_blocks: 256, max_batch_tokens: 256 }).unwrap();
    let cases: Vec<Case> = (0..4)
        .map(|i| Case { name: format!("tokens-{i}"), tokens: tokens(i, 24 + 13 * i as usize), steps: 8 })
        .collect();
    let h = header(&files);
    let current =
        move |be: &CpuBackend, c: &KvChunk<CpuBackend>| fidelity::read_back(be, c, &h.with_format(KvFormat::Fp8));
    let first = move |be: &CpuBackend, c: &KvChunk<CpuBackend>| first_fp8_layout(be, c, hd);
    let stores: Vec<(String, Store<'_, CpuBackend>)> =
        vec![("fp8-e4m3".into(), &current), ("fp8 first layout".into(), &first)];
    let rows = fidelity::compare(&mut e, &cases, &stores).unwrap();
    print(&rows);
    let tol = fidelity::kl_tolerance(KvFormat::Fp8);
    let (now, before) = (fidelity::mean_kl(&rows, "fp8-e4m3"), fidelity::mean_kl(&rows, "fp8 first layout"));
    assert!(fidelity::passed(&rows, KvFormat::Fp8), "fp8 fails the gate on offset key channels: mean KL {now:.2e}");
    // The control: the layout this replaced fails the same gate by far.
    assert!(before > 10.0 * tol, "the first fp8 layout should fail the gate here: mean KL {before:.2e}");
    assert!(before > 100.0 * now, "offsets should cut the KL by far: {before:.2e} → {now:.2e}");
    // (bf16 is left out here: it rounds −355 in steps of 2, more than the
    // tiny model's keys vary there, and loses them as the first fp8 layout
    // did, if less; on a real model — SmolLM2 below, Qwen2.5 in
    // docs/design.md — it is what the GPU computes and passes.)
}

#[test]
fn every_format_passes_the_gate_on_smollm2() {
    let files = inferscale_model::open("smollm2").unwrap();
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(common::golden_dir().join("smollm2.json")).unwrap()).unwrap();
    let cases: Vec<Case> = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().into(),
            tokens: c["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
            steps: 8,
        })
        .collect();
    let mut e = Engine::new(CpuBackend, &files, EngineConfig { kv_blocks: 256, max_batch_tokens: 256 }).unwrap();
    let rows = fidelity::check_formats(&mut e, &header(&files), &cases).unwrap();
    print(&rows);
    assert_eq!(rows.len(), cases.len() * KvFormat::ALL.len());
    for f in KvFormat::ALL {
        assert!(fidelity::passed(&rows, f), "{f}: mean KL {:.2e}", fidelity::mean_kl(&rows, f.name()));
    }
    assert_eq!(fidelity::mean_kl(&rows, "f32"), 0.0, "f32 stores the CPU's KV exactly");
    assert!(
        fidelity::mean_kl(&rows, "bf16") > 0.0,
        "bf16 is lossy on the CPU's f32 KV: a KL of 0 means nothing was compared"
    );
}

#[test]
fn a_prompt_too_short_to_split_is_refused() {
    let files = inferscale_model::open("smollm2").unwrap();
    let mut e = Engine::new(CpuBackend, &files, EngineConfig { kv_blocks: 64, max_batch_tokens: 64 }).unwrap();
    let cases = [Case { name: "one".into(), tokens: vec![5], steps: 1 }];
    let err = fidelity::check_formats(&mut e, &header(&files), &cases).unwrap_err().to_string();
    assert!(err.contains("at least 2"), "{err}");
}

/// The gate on the answer-quality yardstick, Qwen2.5-Coder-1.5B (a 1.1 GB
/// download, so not in CI: `cargo test -p inferscale-memory --test fidelity
/// -- --ignored`): fp8 passes, and the first fp8 layout — the one that took
/// its LoCoMo F1 from 0.37 to 0.10 — fails (measured on the CPU: mean KL
/// 1.6e-4 against 4.4e-2, and a greedy divergence at a margin of 3.5).
#[test]
#[ignore = "needs Qwen2.5-Coder-1.5B (inferscale fetch qwen2.5-coder-1.5b)"]
fn qwen_fp8_passes_the_gate_and_the_first_layout_fails_it() {
    let files = inferscale_model::open("qwen2.5-coder-1.5b").unwrap();
    let path = common::golden_dir().join("qwen2.5-coder-1.5b.json");
    let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases: Vec<Case> = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().into(),
            tokens: c["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
            steps: 12,
        })
        .collect();
    let mut e = Engine::new(CpuBackend, &files, EngineConfig { kv_blocks: 256, max_batch_tokens: 256 }).unwrap();
    let (h, hd) = (header(&files), files.config.head_dim);
    let current =
        move |be: &CpuBackend, c: &KvChunk<CpuBackend>| fidelity::read_back(be, c, &h.with_format(KvFormat::Fp8));
    let first = move |be: &CpuBackend, c: &KvChunk<CpuBackend>| first_fp8_layout(be, c, hd);
    let stores: Vec<(String, Store<'_, CpuBackend>)> =
        vec![("fp8-e4m3".into(), &current), ("fp8 first layout".into(), &first)];
    let rows = fidelity::compare(&mut e, &cases, &stores).unwrap();
    print(&rows);
    let (now, before) = (fidelity::mean_kl(&rows, "fp8-e4m3"), fidelity::mean_kl(&rows, "fp8 first layout"));
    eprintln!("mean KL: fp8 {now:.2e}, first layout {before:.2e}");
    assert!(fidelity::passed(&rows, KvFormat::Fp8), "mean KL {now:.2e}");
    let tol = fidelity::kl_tolerance(KvFormat::Fp8);
    assert!(
        !fidelity::store_passed(&rows, "fp8 first layout", tol),
        "the first layout should fail: mean KL {before:.2e}"
    );
    assert!(before > 100.0 * now, "offsets should cut the KL by far: {before:.2e} → {now:.2e}");
}
