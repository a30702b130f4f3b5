//! The stored-format gate (`inferscale_memory::fidelity`, what `inferscale
//! check --model` runs) on the CPU: on the Qwen2 tiny shape with planted
//! offset key channels — what Qwen2.5's layer-0 keys have — fp8 passes,
//! while the first fp8 layout (one scale per KV head, no key offsets: the
//! layout that wrecked Qwen2.5's answers) fails it by far; and on SmolLM2,
//! the real model CI has, every format passes, and so does the fp8 paged
//! cache (`--kv-cache-dtype fp8`).

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

#[path = "../../engine/tests/common/mod.rs"]
mod common;

use inferscale_engine::backend::KvCacheDtype;
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

/// The prompts of a real model's golden file (tests/golden/NAME.json), each
/// answered for `steps` tokens.
fn golden_cases(name: &str, steps: usize) -> Vec<Case> {
    let path = common::golden_dir().join(format!("{name}.json"));
    let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().into(),
            tokens: c["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
            steps,
        })
        .collect()
}

/// The fp8 paged cache (`--kv-cache-dtype fp8`) through the same gate: the
/// memory injected into an engine with an fp8 cache and one with the f32
/// cache, the question and answer computed in each; returns the rows and
/// the mean KL.
fn cache_gate(reference: &mut Engine<CpuBackend>, files: &ModelFiles, cases: &[Case]) -> (Vec<Fidelity>, f64) {
    let fp8 = Engine::with_cache(CpuBackend, files, GATE, KvCacheDtype::Fp8).unwrap();
    cache_rows(reference, fp8, cases)
}

/// The sizing of the cache gate's engines.
const GATE: EngineConfig = EngineConfig { kv_blocks: 256, max_batch_tokens: 256 };

/// The gate's rows (and mean KL) of the cache of `cached` against
/// `reference`'s f32 cache.
fn cache_rows(
    reference: &mut Engine<CpuBackend>,
    mut cached: Engine<CpuBackend>,
    cases: &[Case],
) -> (Vec<Fidelity>, f64) {
    let rows = fidelity::check_cache(reference, &mut cached, cases, "cache fp8").unwrap();
    print(&rows);
    let mean = fidelity::mean_kl(&rows, "cache fp8");
    (rows, mean)
}

#[test]
fn the_fp8_paged_cache_passes_the_gate_on_smollm2() {
    let files = inferscale_model::open("smollm2").unwrap();
    let mut reference = Engine::new(CpuBackend, &files, GATE).unwrap();
    let (rows, mean) = cache_gate(&mut reference, &files, &golden_cases("smollm2", 8));
    eprintln!("smollm2, fp8 paged cache: mean KL {mean:.2e}");
    assert!(fidelity::store_passed(&rows, "cache fp8", fidelity::kl_tolerance(KvFormat::Fp8)), "mean KL {mean:.2e}");
    assert!(mean > 0.0, "an fp8 cache is lossy: a KL of 0 means nothing was compared");
}

/// The fp8 paged cache on Qwen2.5-Coder-1.5B, whose keys have the offset
/// channels the cache's calibration is for (`-- --ignored`, as above), and
/// the same cache with zero offsets (keys rounded as they are) as the
/// control. Measured on the CPU: mean KL 5.1e-4 against 6.4e-3 — the
/// control passes the KL bound too on these short prompts, but its KL is
/// an order of magnitude higher (on LoCoMo, docs/design.md §2.2, plain fp8
/// kept 8–10 % of the answers, the calibrated cache 85–88 %).
#[test]
#[ignore = "needs Qwen2.5-Coder-1.5B (inferscale fetch qwen2.5-coder-1.5b)"]
fn qwen_fp8_paged_cache_passes_the_gate() {
    let files = inferscale_model::open("qwen2.5-coder-1.5b").unwrap();
    let cases = golden_cases("qwen2.5-coder-1.5b", 12);
    let mut reference = Engine::new(CpuBackend, &files, GATE).unwrap();
    let (rows, mean) = cache_gate(&mut reference, &files, &cases);
    let zeros = vec![vec![0.0; files.config.kv_dim()]; files.config.num_layers];
    let plain = Engine::with_fp8_offsets(CpuBackend, &files, GATE, &zeros).unwrap();
    let (_, without) = cache_rows(&mut reference, plain, &cases);
    eprintln!("qwen2.5-coder-1.5b, fp8 paged cache: mean KL {mean:.2e}, without offsets {without:.2e}");
    assert!(fidelity::store_passed(&rows, "cache fp8", fidelity::kl_tolerance(KvFormat::Fp8)), "mean KL {mean:.2e}");
    assert!(without > 5.0 * mean, "offsets should cut the KL by far: {without:.2e} → {mean:.2e}");
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
    // values of their own (the q_proj bias): planted in the tiny model.
    common::write_tiny_with_offset_channels(&g, dir.path(), &[(0, 7, -355.0), (1, 7, 240.0)]);
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
    let cases = golden_cases("smollm2", 8);
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
    let cases = golden_cases("qwen2.5-coder-1.5b", 12);
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
