"""On a GPU node, without vLLM: the vLLM connector core's device loads.

1. Correctness. A core on the CUDA backend and one on the CPU backend, with
   the same random weights (SmolLM2-135M shape) and the same fact, load the
   same layout (header and fact): the device core into torch-allocated bf16 caches of each of
   vLLM's layouts (and NHD storage) on torch's current stream, the host core
   into an f32 host cache. Per layer the memory slots must agree within the
   parity checks' model tolerance (bf16 encoding through 30 layers vs f32:
   relative L2 ≤ 5e-2, crates/cuda/src/parity.rs MODEL_TOL), positions off by
   one must miss it, and no other slot may be written.
2. Speed. Llama-3.1-8B shape: the time of one load of the header and k facts
   (CUDA events on torch's stream, median of 20 after 3 warm-ups) and the
   bytes it moves, beside a device-to-device copy of the same bytes.

Usage: python3 scripts/gpu_connector_check.py OUT_JSON  (with the
inferscale_vllm wheel built with `--features python,cuda` on PYTHONPATH).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

import torch
from inferscale_vllm import _core

BLOCK = 16
TURNS = [
    {
        "id": f"D1:{i}",
        "speaker": "Ana",
        "time": "1 May 2023",
        "text": f"Fact number {i}: I visited city {i} and liked it.",
    }
    for i in range(60)
]


def make_cache(layout, blocks, heads, dim, dtype, device):
    if layout == "kv_first":
        return torch.full((2, blocks, BLOCK, heads, dim), float("nan"), dtype=dtype, device=device)
    if layout == "block_first":
        return torch.full((blocks, 2, BLOCK, heads, dim), float("nan"), dtype=dtype, device=device)
    if layout == "packed":
        return torch.full((blocks, heads, BLOCK, 2 * dim), float("nan"), dtype=dtype, device=device)
    if layout == "packed_nhd":
        t = torch.full((blocks, BLOCK, heads, 2 * dim), float("nan"), dtype=dtype, device=device)
        return t.permute(0, 2, 1, 3)
    raise ValueError(layout)


def register(core, caches, on_device):
    layers = []
    for t in caches:
        size = t.element_size()
        elems = (t.untyped_storage().nbytes() - t.storage_offset() * size) // size
        layers.append((t.data_ptr(), list(t.shape), list(t.stride()), elems, str(t.dtype)))
    return core.register_caches(layers, BLOCK, on_device)


def slot_kv(t, layout, slot, dim):
    b, n = divmod(slot, BLOCK)
    if layout == "kv_first":
        return t[0, b, n].reshape(-1), t[1, b, n].reshape(-1)
    if layout == "block_first":
        return t[b, 0, n].reshape(-1), t[b, 1, n].reshape(-1)
    return t[b, :, n, :dim].reshape(-1), t[b, :, n, dim:].reshape(-1)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def correctness(out):
    shape = "smollm2-135m"
    layers, heads, dim, blocks = 30, 3, 64, 64
    gpu = _core.Core("unused", tempfile.mkdtemp(), embedder="random", window=0, backend="cuda", random_shape=shape)
    cpu = _core.Core("unused", tempfile.mkdtemp(), embedder="random", window=0, backend="cpu", random_shape=shape)
    # One fact: retrieval on the two backends (bf16 vs f32 embeddings) could
    # order several differently; several chunks are external::check's part.
    for c in (gpu, cpu):
        c.ingest("ana", TURNS[:1])
    prompt, params, _, facts = gpu.compose("ana", "Which city did I like?", 1)
    prompt_c, params_c, _, facts_c = cpu.compose("ana", "Which city did I like?", 1)
    chunks = json.loads(params)["inferscale"]["chunks"]
    same_layout = prompt == prompt_c and chunks == json.loads(params_c)["inferscale"]["chunks"]
    out["same_composition"] = same_layout
    if not same_layout:
        print("compositions differ:", facts, facts_c)
        return False
    end = chunks[-1]["start"] + chunks[-1]["len"]
    # Scattered blocks, in no order.
    block_ids = [(7 + 29 * i) % blocks for i in range(-(-len(prompt) // BLOCK))]
    assert len(set(block_ids)) == len(block_ids) and len(block_ids) <= blocks
    host = [make_cache("packed", blocks, heads, dim, torch.float32, "cpu") for _ in range(layers)]
    register(cpu, host, False)
    cpu.load(params_c, block_ids, 0, 0)
    ok = True
    for layout in ("kv_first", "block_first", "packed", "packed_nhd"):
        dev = [make_cache(layout, blocks, heads, dim, torch.bfloat16, "cuda") for _ in range(layers)]
        out.setdefault("layouts", {})[layout] = register(gpu, dev, True)
        gpu.load(params, block_ids, 0, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        worst, worst_off, stray = 0.0, float("inf"), 0
        for layer in range(layers):
            gk, gv, hk, hv, hk_off = [], [], [], [], []
            for p in range(end):
                s = block_ids[p // BLOCK] * BLOCK + p % BLOCK
                k, v = slot_kv(dev[layer], layout, s, dim)
                a, b = slot_kv(host[layer], "packed", s, dim)
                gk.append(k.cpu())
                gv.append(v.cpu())
                hk.append(a)
                hv.append(b)
                # Keys one position later: the control.
                s2 = block_ids[(p + 1) // BLOCK] * BLOCK + (p + 1) % BLOCK if p + 1 < end else s
                hk_off.append(slot_kv(host[layer], "packed", s2, dim)[0])
            gk, gv, hk, hv, hk_off = map(torch.stack, (gk, gv, hk, hv, hk_off))
            worst = max(worst, rel(gk, hk), rel(gv, hv))
            worst_off = min(worst_off, rel(gk, hk_off))
            written = ~torch.isnan(dev[layer].float().cpu())
            # Element count of memory slots: end tokens × 2 × heads × dim.
            stray += int(written.sum()) - end * 2 * heads * dim
        passed = worst <= 5e-2 and worst_off > 5e-2 and stray == 0
        ok &= passed
        out.setdefault("correctness", {})[layout] = {
            "worst_rel_l2": worst,
            "control_off_by_one_min": worst_off,
            "stray_elements": stray,
            "passed": passed,
        }
        print(
            f"{layout:12s} worst rel {worst:.2e}  control {worst_off:.2e}  stray {stray}  {'ok' if passed else 'FAILED'}"
        )
    return ok


def speed(out, k_values=(5, 10, 20, 50)):
    shape = "llama3.1-8b"
    layers, heads, dim, blocks = 32, 8, 128, 1024
    t0 = time.time()
    gpu = _core.Core(
        "unused", tempfile.mkdtemp(), embedder="random", window=0, backend="cuda", random_shape=shape, kv_cache_mb=2048
    )
    gpu.ingest("ana", TURNS)
    out["speed_setup_s"] = time.time() - t0
    dev = [make_cache("packed_nhd", blocks, heads, dim, torch.bfloat16, "cuda") for _ in range(layers)]
    register(gpu, dev, True)
    stream = torch.cuda.current_stream()
    rows = []
    for k in k_values:
        prompt, params, _, _ = gpu.compose("ana", "Which city did I like?", k)
        chunks = json.loads(params)["inferscale"]["chunks"]
        end = chunks[-1]["start"] + chunks[-1]["len"]
        block_ids = list(range(-(-len(prompt) // BLOCK)))
        times = []
        for rep in range(23):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            gpu.load(params, block_ids, 0, stream.cuda_stream)
            b.record(stream)
            b.synchronize()
            if rep >= 3:
                times.append(a.elapsed_time(b))
        ms = statistics.median(times)
        moved = end * layers * 2 * heads * dim * 2 * 2  # read stored + write cache, K and V, bf16
        src = torch.empty(moved // 4, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        copies = []
        for rep in range(23):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            dst.copy_(src)
            b.record(stream)
            b.synchronize()
            if rep >= 3:
                copies.append(a.elapsed_time(b))
        cms = statistics.median(copies)
        row = {
            "k": k,
            "memory_tokens": end,
            "load_ms": ms,
            "bytes": moved,
            "gb_per_s": moved / ms / 1e6,
            "copy_ms": cms,
            "of_copy": cms / ms,
        }
        rows.append(row)
        print(
            f"k={k:3d} tokens {end:5d}  load {ms:.3f} ms  {row['gb_per_s']:.0f} GB/s  copy {cms:.3f} ms  {row['of_copy']:.0%}"
        )
    out["speed"] = rows


def main():
    out = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d")}
    ok = correctness(out)
    speed(out)
    out["passed"] = ok
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
