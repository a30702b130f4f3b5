//! Property tests for the GGUF reader on corrupted input.
//!
//! A small valid GGUF image (strings, arrays, nested arrays, an explicit
//! alignment, F32/Q8_0/Q4_1 tensors) is mutated — random byte flips and
//! overwrites, truncation, extreme u64 values written over 8-byte windows —
//! and fed to [`parse`]. The reader must never panic; when it accepts the
//! bytes, every tensor must lie inside the buffer and dequantizing it must
//! return (Ok or Err) without panicking; when it rejects them, the message
//! must name the file. This is the CI counterpart of the cargo-fuzz target in
//! `fuzz/fuzz_targets/gguf_parse.rs`.

use std::path::Path;

use inferscale_model::gguf::write::{TensorOut, to_bytes};
use inferscale_model::gguf::{MetaValue, parse};
use inferscale_model::quant::{GgmlType, dequantize};
use proptest::prelude::*;

const CASES: u32 = 512;

/// f16 bit patterns, little-endian.
const F16_HALF: [u8; 2] = 0x3800u16.to_le_bytes(); // 0.5
const F16_NEG_QUARTER: [u8; 2] = 0xb400u16.to_le_bytes(); // -0.25

fn sample() -> Vec<u8> {
    let f32_data: Vec<u8> = (0..8).flat_map(|i| (i as f32 - 3.5).to_le_bytes()).collect();
    // Q8_0: two blocks of [d: f16][32 x i8].
    let mut q8 = Vec::new();
    for b in 0..2u8 {
        q8.extend_from_slice(&F16_HALF);
        q8.extend((0..32u8).map(|j| j.wrapping_mul(7).wrapping_add(b)));
    }
    // Q4_1: two blocks of [d: f16][m: f16][16 bytes of nibbles].
    let mut q41 = Vec::new();
    for b in 0..2u8 {
        q41.extend_from_slice(&F16_HALF);
        q41.extend_from_slice(&F16_NEG_QUARTER);
        q41.extend((0..16u8).map(|j| j.wrapping_mul(17).wrapping_add(b)));
    }
    to_bytes(
        &[
            ("general.architecture", MetaValue::String("llama".into())),
            ("general.alignment", MetaValue::U32(32)),
            ("general.name", MetaValue::String("mutant \u{e9}\u{4e2d}".into())),
            ("llama.block_count", MetaValue::U32(1)),
            ("llama.rope.freq_base", MetaValue::F32(10000.0)),
            ("llama.use_parallel_residual", MetaValue::Bool(false)),
            ("some.i64", MetaValue::I64(-5)),
            ("some.f64", MetaValue::F64(0.125)),
            (
                "tokenizer.ggml.tokens",
                MetaValue::Array(["<s>", "</s>", "a", "bc"].iter().map(|s| MetaValue::String((*s).into())).collect()),
            ),
            (
                "tokenizer.ggml.scores",
                MetaValue::Array([0.0f32, -1.0, -2.5, 3.0].iter().map(|&x| MetaValue::F32(x)).collect()),
            ),
            (
                "tokenizer.ggml.merges.nested",
                MetaValue::Array(vec![
                    MetaValue::Array(vec![MetaValue::U32(1), MetaValue::U32(2)]),
                    MetaValue::Array(vec![MetaValue::U32(3)]),
                ]),
            ),
        ],
        &[
            TensorOut { name: "w.f32", dims: vec![4, 2], ty: GgmlType::F32, data: &f32_data },
            TensorOut { name: "w.q8_0", dims: vec![32, 2], ty: GgmlType::Q8_0, data: &q8 },
            TensorOut { name: "w.q4_1", dims: vec![64], ty: GgmlType::Q4_1, data: &q41 },
        ],
    )
}

/// Parses `bytes` under `name` and checks the invariants above. A violated
/// invariant is returned as a test-case failure; a panic inside `parse` or
/// `dequantize` fails the test as well (proptest reports it with the input).
fn check(bytes: &[u8], name: &str) -> Result<(), TestCaseError> {
    match parse(bytes, Path::new(name)) {
        Ok(parsed) => {
            let len = bytes.len() as u64;
            for (key, t) in &parsed.tensors {
                prop_assert_eq!(key, &t.name);
                let end = t.offset.checked_add(t.n_bytes);
                prop_assert!(
                    end.is_some_and(|e| e <= len),
                    "tensor `{}` [{}, +{}) outside the {}-byte buffer",
                    t.name,
                    t.offset,
                    t.n_bytes,
                    len
                );
                prop_assert!(!t.dims.is_empty() && t.dims.len() <= 4);
                let n = t.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
                prop_assert!(n.is_some(), "dims {:?} overflow but parsed", t.dims);
                let n = t.n_elements();
                prop_assert_eq!(t.ty.n_bytes(n), Some(t.n_bytes));
                let data = &bytes[t.offset as usize..(t.offset + t.n_bytes) as usize];
                // Ok or Err are both fine (e.g. a type we cannot dequantize); a
                // panic is not. On Ok, the length must match.
                if let Ok(v) = dequantize(t.ty, data, n as usize) {
                    prop_assert_eq!(v.len() as u64, n);
                }
            }
        }
        Err(e) => {
            let msg = e.to_string();
            prop_assert!(msg.contains(name), "error does not name the file: {}", msg);
        }
    }
    Ok(())
}

#[test]
fn sample_is_valid() {
    let bytes = sample();
    let p = parse(&bytes, Path::new("sample.gguf")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.tensors.len(), 3);
    assert_eq!(p.metadata["tokenizer.ggml.tokens"].as_array().map(<[_]>::len), Some(4));
    for t in p.tensors.values() {
        let data = &bytes[t.offset as usize..(t.offset + t.n_bytes) as usize];
        let v = dequantize(t.ty, data, t.n_elements() as usize).unwrap_or_else(|e| panic!("{e}"));
        assert!(v.iter().all(|x| x.is_finite()), "{}", t.name);
    }
    let w = &p.tensors["w.f32"];
    let data = &bytes[w.offset as usize..(w.offset + w.n_bytes) as usize];
    assert_eq!(dequantize(w.ty, data, 8).ok(), Some((0..8).map(|i| i as f32 - 3.5).collect()));
}

/// The values strategy (c) writes: zero, all ones, a large "plausible" size,
/// and the buffer length minus one.
fn extreme_u64s(len: usize) -> [u64; 4] {
    [0, u64::MAX, 1 << 40, len as u64 - 1]
}

/// Every 8-byte window of the sample, every extreme value: exhaustive, so
/// each count, length, dim and offset field is hit at least once.
#[test]
fn every_window_with_every_extreme_value() {
    let base = sample();
    for at in 0..=base.len() - 8 {
        for v in extreme_u64s(base.len()) {
            let mut bytes = base.clone();
            bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
            if let Err(e) = check(&bytes, "window.gguf") {
                panic!("window at {at} = {v:#x}: {e}");
            }
        }
    }
}

/// Every single byte overwritten with a few telling values, exhaustively.
#[test]
fn every_byte_with_telling_values() {
    let base = sample();
    for at in 0..base.len() {
        for v in [0x00u8, 0x01, 0x7f, 0x80, 0xff, base[at] ^ 0x01, base[at] ^ 0x80] {
            let mut bytes = base.clone();
            bytes[at] = v;
            if let Err(e) = check(&bytes, "byte.gguf") {
                panic!("byte {at} = {v:#04x}: {e}");
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Mutation {
    /// XOR the byte with a non-zero mask (flips 1..=8 bits).
    Flip(usize, u8),
    Overwrite(usize, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(i, m)| Mutation::Flip(i, m)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Mutation::Overwrite(i, v)),
    ]
}

fn apply(bytes: &mut [u8], mutations: &[Mutation]) {
    let len = bytes.len();
    for m in mutations {
        match *m {
            Mutation::Flip(i, mask) => bytes[i % len] ^= mask,
            Mutation::Overwrite(i, v) => bytes[i % len] = v,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, failure_persistence: None, ..ProptestConfig::default() })]

    /// (a) 1–8 random byte flips / overwrites anywhere in the file.
    #[test]
    fn random_byte_mutations(mutations in prop::collection::vec(mutation(), 1..=8)) {
        let mut bytes = sample();
        apply(&mut bytes, &mutations);
        check(&bytes, "mutated.gguf")?;
    }

    /// (b) Truncation at any length, including 0 and the full length.
    #[test]
    fn truncation(frac in 0.0f64..=1.0) {
        let bytes = sample();
        let cut = ((bytes.len() as f64) * frac) as usize;
        check(&bytes[..cut.min(bytes.len())], "truncated.gguf")?;
    }

    /// (c) An 8-byte window at a random position overwritten with an extreme
    /// u64, optionally on top of a few random byte mutations.
    #[test]
    fn extreme_u64_window(
        pos in any::<usize>(),
        which in 0usize..4,
        extra in prop::collection::vec(mutation(), 0..=3),
    ) {
        let mut bytes = sample();
        let at = pos % (bytes.len() - 7);
        let v = extreme_u64s(bytes.len())[which];
        bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
        apply(&mut bytes, &extra);
        check(&bytes, "extreme.gguf")?;
    }

    /// Every error names the file it was given, whatever the file is called
    /// and however the bytes were damaged.
    #[test]
    fn every_error_names_the_file(
        stem in "[a-zA-Z0-9_ .-]{1,16}",
        cut_frac in 0.0f64..=1.0,
        mutations in prop::collection::vec(mutation(), 0..=8),
    ) {
        let name = format!("models/{stem}.gguf");
        let mut bytes = sample();
        apply(&mut bytes, &mutations);
        let cut = ((bytes.len() as f64) * cut_frac) as usize;
        let bytes = &bytes[..cut.min(bytes.len())];
        if let Err(e) = parse(bytes, Path::new(&name)) {
            let msg = e.to_string();
            prop_assert!(msg.contains(&name), "error does not name `{}`: {}", name, msg);
        }
    }
}
