#!/usr/bin/env python3
"""Regenerate tests/golden/chat_templates.json.

Why: our chat templates are rendered by minijinja (Rust); the reference is
transformers' own renderer (Jinja2 with trim_blocks/lstrip_blocks and its
extensions), so prompts are byte-identical to `apply_chat_template`.

What: for each built-in template of crates/model/src/chat.rs (the Rust test
checks the sources below equal the built-ins) and several conversations,
the rendered text with and without the generation prompt.

Run (venv of requirements.txt):  python tests/golden/make_chat_golden.py
"""
import json
import pathlib

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

CHATML_SMOLLM2 = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
CHATML_QWEN2 = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
LLAMA3 = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"

TEMPLATES = {
    "smollm2": (CHATML_SMOLLM2, "<|im_start|>", "<|im_end|>"),
    "qwen2": (CHATML_QWEN2, "<|endoftext|>", "<|im_end|>"),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "  Colour of the sky?\n"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Tell me a joke about \"quotes\" & {braces}."},
    ],
]


def main():
    cases = []
    for name, (tmpl, bos, eos) in TEMPLATES.items():
        for messages in CONVERSATIONS:
            for gen in (True, False):
                rendered, _ = render_jinja_template(
                    conversations=[messages], chat_template=tmpl, add_generation_prompt=gen,
                    bos_token=bos, eos_token=eos)
                cases.append({"template": name, "source": tmpl, "bos_token": bos, "eos_token": eos,
                              "messages": messages, "add_generation_prompt": gen, "rendered": rendered[0]})
    out = {"generator": "tests/golden/make_chat_golden.py",
           "versions": {"transformers": transformers.__version__}, "cases": cases}
    path = pathlib.Path(__file__).with_name("chat_templates.json")
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
