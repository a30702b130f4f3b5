"""vLLM 0.26 with InferScale's KV connector on one GPU: time to first token
of kv mode (the connector injects the header and k facts; vLLM prefills the
question) against vLLM prefilling the same token ids itself (prompt mode),
side by side in one process.

Model: the Llama-3.1-8B shape, vLLM with dummy weights, our core with random
weights of the same shape (so outputs mean nothing; compute does not depend
on the values). vLLM's engine core and worker run in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so the connector's core — created by the
worker-side connector — is reachable here to ingest facts and compose.

Timing per request: vllm.LLM.generate of one request with max_tokens=1,
wall clock (composition — retrieval and the plan — happens before, untimed). Before each timed request vLLM's prefix cache is reset; prompt
mode then gets the header cached (a header-only request), as a deployment
with a shared system prompt would have it; kv mode needs nothing cached.
Medians of REPS after WARMUP. Usage: python3 gpu_vllm_ttft.py OUT_JSON [eager]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from inferscale_vllm import _core, connector
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

SHAPE = "llama3.1-8b"
KS = (5, 10, 20, 50)
WARMUP, REPS = 3, 10


def fact(i: int) -> dict[str, str]:
    """A fact of about 25 tokens (our random shape tokenizes bytes)."""
    return {
        "id": f"t{i}",
        "speaker": "U",
        "time": "",
        "text": f"Fact {i:02d}: pet is a cat.",
    }


def main():
    out_path = sys.argv[1]
    eager = len(sys.argv) > 2 and sys.argv[2] == "eager"
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        f.write(_core.shape_hf_config(SHAPE))
    extra = {
        "model": "unused",
        "random_shape": SHAPE,
        "memory_dir": tempfile.mkdtemp(),
        "embedder": "random",
        "window": 0,
        "kv_cache_mb": 2048,
        "backend": "cuda",
    }
    t0 = time.time()
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=8192,
        gpu_memory_utilization=0.55,
        enable_prefix_caching=True,
        enforce_eager=eager,
        kv_transfer_config=connector.kv_transfer_config(extra),
    )
    startup = time.time() - t0
    core = connector.core_for(extra, "cuda")
    core.ingest("u", [fact(i) for i in range(60)])
    one = SamplingParams(max_tokens=1, detokenize=False)

    def timed(prompt, params=None, salt=None):
        sp = SamplingParams(
            max_tokens=1,
            detokenize=False,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        p = TokensPrompt(prompt_token_ids=prompt)
        if salt:
            p["cache_salt"] = salt
        t = time.perf_counter()
        r = llm.generate([p], sp, use_tqdm=False)
        return (time.perf_counter() - t) * 1e3, r[0]

    question = "Which pet do I have, and what is its name?"
    rows = []
    for k in KS:
        prompt, params, _, _ = core.compose("u", question, k)
        params = json.loads(params)
        chunks = params["inferscale"]["chunks"]
        end = chunks[-1]["start"] + chunks[-1]["len"]
        header = prompt[: chunks[0]["len"]]
        for mode in ("kv", "prompt"):
            times, cached = [], None
            for rep in range(WARMUP + REPS):
                llm.reset_prefix_cache()
                if mode == "kv":
                    # A plan serves one request (the worker drops it when the
                    # request finishes): compose each time, untimed, as a
                    # server does before submitting.
                    p2, params, salt, _ = core.compose("u", question, k)
                    assert p2 == prompt
                    ms, r = timed(prompt, json.loads(params), salt)
                else:
                    llm.generate(
                        [TokensPrompt(prompt_token_ids=header)], one, use_tqdm=False
                    )
                    ms, r = timed(prompt)
                if rep >= WARMUP:
                    times.append(ms)
                    cached = getattr(r, "num_cached_tokens", None)
            row = {
                "k": k,
                "mode": mode,
                "prompt_tokens": len(prompt),
                "memory_tokens": end,
                "ttft_ms_median": statistics.median(times),
                "ttft_ms_min": min(times),
                "num_cached_tokens": cached,
            }
            rows.append(row)
            print(
                f"k={k:3d} {mode:6s} prompt {len(prompt):5d} memory {end:5d}  ttft {row['ttft_ms_median']:.2f} ms"
                f"  (min {row['ttft_ms_min']:.2f}; vLLM cached tokens {cached})",
                flush=True,
            )
    result = {
        "shape": SHAPE,
        "vllm_startup_s": startup,
        "eager": eager,
        "connector_stats": dict(connector.STATS),
        "results": rows,
    }
    print("connector loads:", connector.STATS)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
