#!/usr/bin/env python3
"""Regenerate tests/golden/quant.json: golden vectors for GGML dequantization.

What
----
For each GGML type in TYPES below, a few blocks of pseudo-random bytes (numpy
PCG64 seeded with SEED) are dequantized to float32 by the `gguf` PyPI
package's numpy implementation (`gguf.quants.dequantize`, the code
transformers uses to read GGUF files). quant.json stores, per case, the raw
bytes as hex, the element count, and the reference output both as floats
(for people) and as the float32 bit patterns (what the Rust test compares).

Every f16 scale/min field in a quantized block is overwritten with a finite
f16 value (mostly small random floats of either sign, plus a subnormal and a
zero in the first block of the 32-element types), so no case contains NaN or
infinity. F16 and BF16 cases are finite random values plus a few edge values
(signed zeros, subnormals, the largest finite f16).

How to run
----------
    /path/to/venv/bin/python tests/golden/make_quant_golden.py

from the repository root, with the `gguf` and `numpy` versions pinned in
tests/golden/requirements.txt. The output is deterministic for a given seed
and package versions.

Why
---
crates/model/src/quant.rs hand-decodes ggml's block layouts (nibble order,
fifth-bit packing, 6-bit K-quant scales, ...). A layout slip gives plausible
but wrong weights rather than an error, so crates/model/tests/quant_golden.rs
checks our dequantizers against this independent implementation bit for bit.
gguf-py computes every step in float32 with the same operation order as
ggml's reference C code (and ours), so exact equality is expected.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

SEED = 20240611
OUT = Path(__file__).resolve().parent / "quant.json"

# (type, number of blocks). F16/BF16 have one element per "block".
TYPES: list[tuple[T, int]] = [
    (T.F16, 64),
    (T.BF16, 64),
    (T.Q4_0, 4),
    (T.Q4_1, 4),
    (T.Q5_0, 4),
    (T.Q5_1, 4),
    (T.Q8_0, 4),
    (T.Q4_K, 2),
    (T.Q6_K, 2),
]

# Byte offsets of the f16 fields inside one block (ggml-common.h):
# d, and m / dmin where the type has one.
F16_FIELDS: dict[T, list[int]] = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q4_K: [0, 2],
    T.Q6_K: [208],
}


def f16_bytes(x: float) -> bytes:
    v = np.float16(x)
    assert np.isfinite(v), x
    return v.tobytes()


def make_f16(rng: np.random.Generator, n: int) -> bytes:
    edge = np.array([0.0, -0.0, 6e-8, -3e-5, 65504.0, -1.0, 1.0 / 3.0, 2.0**-14], dtype=np.float16)
    vals = (rng.standard_normal(n - len(edge)) * 4.0).astype(np.float16)
    out = np.concatenate([edge, vals])
    assert np.all(np.isfinite(out))
    return out.tobytes()


def make_bf16(rng: np.random.Generator, n: int) -> bytes:
    # Truncate random float32 values to their top 16 bits: finite bf16.
    base = np.array([0.0, -0.0, 1e-40, -3.0e38, 1.0, -2.5], dtype=np.float32)
    vals = (rng.standard_normal(n - len(base)) * 100.0).astype(np.float32)
    bits = (np.concatenate([base, vals]).view(np.uint32) >> 16).astype(np.uint16)
    out = bits.tobytes()
    check = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.all(np.isfinite(check))
    return out


def make_quant(rng: np.random.Generator, qtype: T, n_blocks: int) -> bytes:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = bytearray(rng.integers(0, 256, size=n_blocks * type_size, dtype=np.uint8).tobytes())
    for b in range(n_blocks):
        for k, off in enumerate(F16_FIELDS[qtype]):
            if block_size == 32 and b == 0:
                # Edge scales: a subnormal d and a zero min.
                x = 3.0e-6 if k == 0 else 0.0
            else:
                x = float(rng.uniform(-0.05, 0.05))
            at = b * type_size + off
            raw[at : at + 2] = f16_bytes(x)
    return bytes(raw)


def main() -> int:
    rng = np.random.default_rng(SEED)
    cases = []
    for qtype, n_blocks in TYPES:
        block_size, _ = GGML_QUANT_SIZES[qtype]
        n = block_size * n_blocks
        if qtype == T.F16:
            raw = make_f16(rng, n)
        elif qtype == T.BF16:
            raw = make_bf16(rng, n)
        else:
            raw = make_quant(rng, qtype, n_blocks)
        data = np.frombuffer(raw, dtype=np.uint8).copy()
        values = np.asarray(dequantize(data, qtype), dtype=np.float32).reshape(-1)
        assert values.dtype == np.float32 and values.size == n, (qtype, values.dtype, values.shape)
        assert np.all(np.isfinite(values)), qtype
        cases.append(
            {
                "type": qtype.name,
                "ggml_type_id": int(qtype),
                "n_elements": n,
                "bytes_hex": raw.hex(),
                # float() of a float32 is exact, and repr() round-trips it.
                "values": [float(v) for v in values],
                "values_f32_bits": [int(v) for v in values.view(np.uint32)],
            }
        )

    header = {
        "generator": "tests/golden/make_quant_golden.py (gguf.quants.dequantize, numpy float32)",
        "seed": SEED,
        "versions": {"gguf": version("gguf"), "numpy": np.__version__},
    }
    # One case per line keeps the file small and its diffs readable.
    lines = ["{"]
    for k, v in header.items():
        lines.append(f" {json.dumps(k)}: {json.dumps(v)},")
    lines.append(' "cases": [')
    lines.append(",\n".join("  " + json.dumps(c) for c in cases))
    lines.append(" ]")
    lines.append("}")
    OUT.write_text("\n".join(lines) + "\n")
    json.loads(OUT.read_text())  # sanity: valid JSON
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(cases)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
