//! Fuzzes the GGUF reader: `parse` on arbitrary bytes, then dequantization of
//! every tensor it accepts. Nothing may panic, and an accepted tensor's bytes
//! must lie inside the input.
#![no_main]

use std::path::Path;

use inferscale_model::{gguf, quant};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(parsed) = gguf::parse(data, Path::new("fuzz.gguf")) else {
        return;
    };
    for t in parsed.tensors.values() {
        let Some(end) = t.offset.checked_add(t.n_bytes) else {
            panic!("tensor `{}`: offset + n_bytes overflows", t.name);
        };
        let Some(bytes) =
            usize::try_from(t.offset).ok().zip(usize::try_from(end).ok()).and_then(|(start, end)| data.get(start..end))
        else {
            panic!("tensor `{}` [{}, {end}) is outside the {}-byte input", t.name, t.offset, data.len());
        };
        let _ = quant::dequantize(t.ty, bytes, t.n_elements() as usize);
    }
});
