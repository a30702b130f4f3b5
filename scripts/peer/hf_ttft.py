#!/usr/bin/env python3
"""Peer column for `inferscale bench ttft`: the same prompt layout through HF
transformers (SDPA attention, bf16, one GPU), plus the machine's two ceilings
(device-to-device copy bandwidth, bf16 GEMM rate) measured in the same run.

Prompt mode as in our engine: the header's KV is computed once and cached;
each timed run prefills the k facts and the question on top of a copy of it
and takes the argmax of the last logits. Timed with CUDA events, median of
--reps runs after warm-up. Weights are random (the shape is what matters for
speed); token ids are random, as in `--shape … --random-weights`.

Usage: hf_ttft.py --shape llama3.1-8b --k 5,10,20,50,100,200 --json out.json
"""
import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

# The architectures of crates/model/src/shapes.rs, as HF configs.
SHAPES = {
    "llama3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                       rope_theta=1e6, max_position_embeddings=32768, sliding_window=None,
                       tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
                       rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=False,
                       use_sliding_window=False),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
}


def ceilings(dev):
    n = 1 << 30  # 2 GiB of bf16 each way
    a = torch.randn(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    times = []
    for i in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e))
    copy_gbs = 2 * a.numel() * 2 / (statistics.median(times) * 1e-3) / 1e9
    del a, b
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    times = []
    for i in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.matmul(x, y)
        e.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e))
    tflops = 2 * m ** 3 / (statistics.median(times) * 1e-3) / 1e12
    return copy_gbs, tflops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--k", default="5,10,20,50,100,200")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--header-tokens", type=int, default=50)
    ap.add_argument("--fact-tokens", type=int, default=25)
    ap.add_argument("--question-tokens", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    copy_gbs, tflops = ceilings(dev)

    spec = dict(SHAPES[a.shape])
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    cfg._attn_implementation = "sdpa"
    t0 = time.time()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    load_s = time.time() - t0
    ks = [int(x) for x in a.k.split(",")]
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda n: torch.randint(1000, cfg.vocab_size, (1, n), generator=g).to(dev)
    header = rand(a.header_tokens)
    facts = rand(max(ks) * a.fact_tokens)
    question = rand(a.question_tokens)

    rows = []
    with torch.inference_mode():
        cache = DynamicCache(config=cfg)
        model(input_ids=header, past_key_values=cache, use_cache=True)
        header_kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]

        def fresh_cache():
            c = DynamicCache(config=cfg)
            for i, (k, v) in enumerate(header_kv):
                c.update(k.clone(), v.clone(), i)
            return c

        for k in ks:
            rest = torch.cat([facts[:, : k * a.fact_tokens], question], dim=1)
            pos = torch.arange(a.header_tokens, a.header_tokens + rest.shape[1], device=dev).unsqueeze(0)
            times = []
            for i in range(a.reps + 3):
                c = fresh_cache()
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = model(input_ids=rest, past_key_values=c, position_ids=pos, use_cache=True,
                            logits_to_keep=1)
                tok = out.logits[0, -1].argmax()
                e.record()
                torch.cuda.synchronize()
                int(tok)
                if i >= 3:
                    times.append(s.elapsed_time(e))
            rows.append(dict(k=k, mode="prompt", prefilled_tokens=rest.shape[1],
                             prompt_tokens=a.header_tokens + rest.shape[1],
                             ttft_ms_median=statistics.median(times), ttft_ms_min=min(times)))
            print(f"hf prompt k={k}: {rows[-1]['ttft_ms_median']:.2f} ms ({rest.shape[1]} tokens prefilled)",
                  flush=True)
    report = dict(peer="transformers", transformers=transformers.__version__, torch=torch.__version__,
                  device=torch.cuda.get_device_name(dev), shape=a.shape, attention="sdpa", dtype="bfloat16",
                  load_s=load_s, copy_gbs=copy_gbs, gemm_bf16_tflops=tflops, reps=a.reps, results=rows)
    print(f"device {report['device']}: D2D copy {copy_gbs:.0f} GB/s (read+write), bf16 GEMM 8192³ {tflops:.0f} TFLOP/s")
    print(f"{'k':>5} {'prefilled':>10} {'HF prompt TTFT ms':>18}")
    for r in rows:
        print(f"{r['k']:>5} {r['prefilled_tokens']:>10} {r['ttft_ms_median']:>18.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
