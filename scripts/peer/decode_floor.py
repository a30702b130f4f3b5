"""Decode steps beside their floor, from scripts/gpu_decode_floor.sh's JSON.

A decode step must read every weight once (bf16; the embedding table only
one row a sequence, the LM head all of it) and every sequence's cached KV;
its floor is those bytes over the device's measured copy bandwidth
(copy-bandwidth.json: read + write bytes per second of a large copy).

    python3 decode_floor.py DIR   # DIR holds copy-bandwidth.json, engine-*.json
"""
import json
import pathlib
import sys

# (hidden, q_dim, kv_dim, intermediate, layers, vocab) of the shapes run.
SHAPES = {
    "llama3.1-8b": (4096, 4096, 1024, 14336, 32, 128256),
    "qwen2.5-1.5b": (1536, 1536, 256, 8960, 28, 151936),
}


def weight_bytes(shape):
    h, q, kv, inter, layers, vocab = SHAPES[shape]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    return 2 * (layers * per_layer + vocab * h)


HEAD_DIM = 128


def kv_bytes_per_token(shape, dtype="auto"):
    """bf16 K and V; fp8: a byte a value, an f32 scale per head row, and the
    slot's position (crates/engine/src/backend.rs, KvCacheDtype)."""
    h, q, kv, inter, layers, vocab = SHAPES[shape]
    if dtype == "fp8":
        return 2 * layers * (kv + 4 * kv // HEAD_DIM) + 4
    return layers * 2 * kv * 2


def main(d):
    d = pathlib.Path(d)
    bw = json.loads((d / "copy-bandwidth.json").read_text())["gb_per_s"] * 1e9
    print(f"device copy bandwidth {bw / 1e9:.0f} GB/s (read + write)\n")
    print("| shape | cache | batch | context | ms/step | floor ms | × floor | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for f in sorted(d.glob("engine-*.json")):
        r = json.loads(f.read_text())
        shape = r["model"].removeprefix("random:")
        dtype = r.get("kv_cache_dtype", "auto")
        # engine-SHAPE-DTYPE-BUILD.json: another build's run of the same cache.
        build = f.stem.partition(f"-{dtype}-")[2]
        label = f"{dtype} ({build})" if build else dtype
        for s in r["decode"]:
            # Mean context over the measured steps.
            ctx = s["prompt_tokens"] + s["new_tokens"] / 2
            floor = (weight_bytes(shape) + s["batch"] * ctx * kv_bytes_per_token(shape, dtype)) / bw * 1e3
            rows.append({"shape": shape, "kv_cache_dtype": dtype, "build": build or None, "batch": s["batch"], "context": ctx, "ms_per_step": s["ms_per_step"],
                         "floor_ms": floor, "times_floor": s["ms_per_step"] / floor, "tokens_per_s": s["tokens_per_s"]})
            print(f"| {shape} | {label} | {s['batch']} | {ctx:.0f} | {s['ms_per_step']:.2f} | {floor:.2f} | "
                  f"{s['ms_per_step'] / floor:.2f} | {s['tokens_per_s']:.0f} |")
    (d / "decode-floor.json").write_text(json.dumps({"copy_gb_per_s": bw / 1e9, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
