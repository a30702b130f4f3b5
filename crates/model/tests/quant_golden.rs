//! Dequantization checked against golden vectors from an independent
//! implementation: `tests/golden/quant.json`, written by
//! `tests/golden/make_quant_golden.py` with the `gguf` PyPI package's numpy
//! dequantizers (`gguf.quants.dequantize`).
//!
//! Precision: gguf-py converts every f16 field to float32 and does each
//! multiply/add as a separate float32 numpy operation, in the same order as
//! ggml's reference C code and as `quant.rs` (e.g. Q4_K is `(d·sc)·q − dmin·m`,
//! Q6_K is `(d·sc)·q`, Q4_1 is `d·q + m`; Rust never fuses these into FMAs).
//! IEEE float32 rounding is then identical on both sides, so the comparison is
//! exact: every output must have the reference's f32 bit pattern (this also
//! tells 0.0 from -0.0).

mod common;

use inferscale_model::quant::{GgmlType, dequantize};
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    generator: String,
    versions: std::collections::BTreeMap<String, String>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    #[serde(rename = "type")]
    name: String,
    ggml_type_id: u32,
    n_elements: usize,
    bytes_hex: String,
    values: Vec<f64>,
    values_f32_bits: Vec<u32>,
}

fn hex_decode(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd-length hex string");
    let nibble = |c: u8| match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        b'A'..=b'F' => c - b'A' + 10,
        _ => panic!("bad hex digit {:?}", c as char),
    };
    s.as_bytes().chunks_exact(2).map(|p| (nibble(p[0]) << 4) | nibble(p[1])).collect()
}

fn load() -> Golden {
    let path = common::golden_path("quant.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn dequantize_matches_gguf_py_bit_for_bit() {
    let golden = load();
    assert!(golden.generator.contains("make_quant_golden.py"));
    assert!(golden.versions.contains_key("gguf"), "{:?}", golden.versions);

    let mut seen = Vec::new();
    for case in &golden.cases {
        let ty = GgmlType::from_u32(case.ggml_type_id)
            .unwrap_or_else(|| panic!("{}: unknown ggml type id {}", case.name, case.ggml_type_id));
        let bytes = hex_decode(&case.bytes_hex);
        let n = case.n_elements;
        assert_eq!(case.values.len(), n, "{}: values length", case.name);
        assert_eq!(case.values_f32_bits.len(), n, "{}: bits length", case.name);

        let got = dequantize(ty, &bytes, n).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(got.len(), n, "{}", case.name);

        let (block_elems, _) = ty.block();
        for (i, ((g, &want_bits), &want_f)) in got.iter().zip(&case.values_f32_bits).zip(&case.values).enumerate() {
            let want = f32::from_bits(want_bits);
            // The decimal list is for people; it must agree with the bits.
            assert_eq!((want_f as f32).to_bits(), want_bits, "{} element {i}: values vs bits", case.name);
            assert!(
                g.to_bits() == want_bits,
                "{} element {i} (block {}, index {} in block): got {g:e} ({:#010x}), gguf-py {want:e} ({want_bits:#010x})",
                case.name,
                i as u64 / block_elems,
                i as u64 % block_elems,
                g.to_bits(),
            );
        }
        seen.push(case.name.as_str());
    }

    for want in ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"] {
        assert!(seen.contains(&want), "quant.json has no {want} case (has {seen:?})");
    }
}

#[test]
fn golden_bytes_with_a_block_missing_are_an_error() {
    let golden = load();
    for case in &golden.cases {
        let Some(ty) = GgmlType::from_u32(case.ggml_type_id) else {
            continue;
        };
        let bytes = hex_decode(&case.bytes_hex);
        let (_, block_bytes) = ty.block();
        let short = &bytes[..bytes.len() - block_bytes as usize];
        assert!(dequantize(ty, short, case.n_elements).is_err(), "{}", case.name);
    }
}
