#!/usr/bin/env python3
"""How far bf16 moves a model's logits from f32 in the reference
implementation: HF transformers runs the golden prompts (teacher-forced on
the golden greedy tokens) once in float32 and once in bfloat16 on the GPU,
and reports per prompt the worst relative L2 error of the bf16 logits and
the leading steps where both pick the same token. This is the yardstick for
`inferscale check --model … --golden …`: our bf16 CUDA backend against our
f32 CPU backend should stay within the same order.

Usage: hf_bf16_floor.py MODEL.gguf tests/golden/smollm2.json [--json out.json]
"""
import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("golden")
    ap.add_argument("--json")
    a = ap.parse_args()
    golden = json.load(open(a.golden))
    d, f = os.path.split(os.path.abspath(a.gguf))
    m32 = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).cuda().eval()
    m16 = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).to(torch.bfloat16).cuda().eval()
    rows = []
    for c in golden["cases"]:
        ids = c["input_ids"] + [s["token"] for s in c["steps"]]
        n = len(c["steps"])
        x = torch.tensor([ids], device="cuda")
        with torch.inference_mode():
            l32 = m32(input_ids=x).logits[0, -n - 1 : -1].double()
            l16 = m16(input_ids=x).logits[0, -n - 1 : -1].double()
        err = ((l16 - l32).norm(dim=-1) / l32.norm(dim=-1)).max().item()
        same = (l16.argmax(-1) == l32.argmax(-1)).tolist()
        agreed = next((i for i, s in enumerate(same) if not s), n)
        rows.append(dict(name=c["name"], steps=n, agreed=agreed, worst_logits_rel=err))
        print(f"{c['name']:<24} {n:>6} {agreed:>8} {err:>14.2e}", flush=True)
    if a.json:
        json.dump(dict(peer="transformers", dtype="bfloat16 vs float32", device=torch.cuda.get_device_name(),
                       cases=rows), open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
