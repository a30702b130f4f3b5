"""Contract tests: InferScaleConnector driven by vLLM 0.26's own scheduler,
requests and config objects, on CPU, with the real SmolLM2 in the core.

What they pin down:
- the scheduler side reports a plan's memory tokens (header + facts, a
  prefix of the prompt) as externally computed, minus what vLLM's prefix
  cache already holds, and vLLM then schedules only the rest;
- any mismatch (model shape, salt, tokens, unknown plan, cache layout or
  block size) loads nothing and, on the worker side, reports the blocks so
  vLLM recomputes them; injected blocks never serve another user or a
  prompt-mode request;
- the worker side's writes into CPU caches of each layout (and a permuted,
  non-contiguous one; f32 and bf16) equal the KV a prompt prefill leaves:
  E2 for the header (exactly computed prefix KV) and, for the facts (each
  encoded alone after the header, window 0: E3's block-diagonal mask), a
  prefill of header + fact that puts the fact at its prompt positions.

Tolerances (f32, SmolLM2's 30 layers): max |Δ| / max |reference| per layer
≤ 1e-4. The header's KV is the prefill's own computation; a fact's stored
KV was computed right after the header and rotated to its position, where
the reference computed it at that position, so only the f32 angle rounding
of deeper layers separates them (E4's bound in crates/engine/tests/
equivalence.rs). Each comparison is paired with a perturbed one (a position
off by one) that must miss by far more. bf16 caches: within one bf16 unit
(2^-8 relative) of the reference rounded to bf16.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from inferscale_vllm import connector as isc
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
NUM_BLOCKS = 64
TOL = 1e-4
EOS = 2

TURNS = [
    {"id": "D1:1", "speaker": "Ana", "time": "1 May 2023", "text": "I adopted a grey cat called Pixel last spring."},
    {"id": "D1:2", "speaker": "Ana", "time": "1 May 2023", "text": "My sister Lena lives in Porto and teaches piano."},
    {
        "id": "D1:3",
        "speaker": "Ana",
        "time": "2 May 2023",
        "text": "I am training for the Lisbon half marathon in October.",
    },
    {"id": "D1:4", "speaker": "Ana", "time": "2 May 2023", "text": "Coffee makes me jittery, so I drink green tea."},
]


@pytest.fixture(scope="module")
def extra(tmp_path_factory):
    return {
        "model": os.environ.get("INFERSCALE_TEST_MODEL", "smollm2"),
        "memory_dir": str(tmp_path_factory.mktemp("memory")),
        "embedder": "random",
        "window": 0,
        "kv_cache_mb": 64,
        "max_batch_tokens": 256,
    }


@pytest.fixture(scope="module")
def core(extra):
    c = isc.core_for(extra)
    assert c.ingest("ana", TURNS) == len(TURNS)
    assert c.ingest("bob", TURNS[:2]) == 2
    return c


@pytest.fixture(scope="module")
def model_dir(core, tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(core.hf_config())
    return d


def vllm_config(model_dir, extra, **hf_overrides) -> VllmConfig:
    mc = ModelConfig(
        model=str(model_dir), dtype="float32", seed=0, skip_tokenizer_init=True, hf_overrides=hf_overrides or {}
    )
    return VllmConfig(
        model_config=mc,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        kv_transfer_config=isc.kv_transfer_config(extra),
        device_config=DeviceConfig("cpu"),
    )


def scheduler(vc: VllmConfig) -> Scheduler:
    kv = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
            )
        ],
    )
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kv,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK,
    )


_hash_ready = False
_ids = iter(range(1, 1_000_000))


def request(prompt, params=None, salt=None) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params else None)
    sp.update_from_generation_config({}, EOS)
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=sp,
        pooling_params=None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def compose(core, user="ana", question="Where does my sister live?", k=3):
    prompt, params, salt, facts = core.compose(user, question, k)
    return prompt, json.loads(params), salt, facts


def finish(s: Scheduler, out, reqs):
    """Feeds back one EOS per request so it finishes and frees its blocks."""
    ids = [r.request_id for r in reqs]
    s.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[EOS] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
        ),
    )


def end_of(params):
    return params["inferscale"]["chunks"][-1]["start"] + params["inferscale"]["chunks"][-1]["len"]


# ---- scheduler side ----


def test_fingerprints_agree_and_a_different_shape_differs(core, model_dir, extra):
    assert isc.engine_fingerprint(vllm_config(model_dir, extra)) == core.fingerprint()
    other = vllm_config(model_dir, extra, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert isc.engine_fingerprint(other) != core.fingerprint()


def test_memory_tokens_are_external_and_only_the_question_is_scheduled(core, model_dir, extra):
    s = scheduler(vllm_config(model_dir, extra))
    prompt, params, salt, facts = compose(core)
    assert len(facts) == 3
    end = end_of(params)
    assert 0 < end < len(prompt)
    r = request(prompt, params, salt)
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens[r.request_id] == len(prompt) - end
    meta = out.kv_connector_metadata
    assert isinstance(meta, isc.InferScaleMetadata) and len(meta.loads) == 1
    load = meta.loads[0]
    assert (load.req_id, load.from_position, load.end) == (r.request_id, 0, end)
    assert len(load.block_ids) == -(-len(prompt) // BLOCK)
    finish(s, out, [r])

    # The same composition again: vLLM's prefix cache now holds the full
    # blocks (under this plan's salt); the connector supplies only the rest
    # of the memory, and vLLM still computes the question.
    r2 = request(prompt, params, salt)
    s.add_request(r2)
    out2 = s.schedule()
    cached = (len(prompt) - 1) // BLOCK * BLOCK
    external = max(0, end - cached)
    assert out2.num_scheduled_tokens[r2.request_id] == len(prompt) - max(cached, end)
    loads = out2.kv_connector_metadata.loads
    if external:
        assert [(x.from_position, x.end) for x in loads] == [(cached, end)]
    else:
        assert loads == []
    finish(s, out2, [r2])


def test_injected_blocks_never_serve_prompt_mode_or_another_salt(core, model_dir, extra):
    s = scheduler(vllm_config(model_dir, extra))
    prompt, params, salt, _ = compose(core, question="What cat do I have?")
    r = request(prompt, params, salt)
    s.add_request(r)
    finish(s, s.schedule(), [r])
    # Same token ids as a prompt-mode request (no params, no salt): no hit.
    plain = request(prompt)
    s.add_request(plain)
    out = s.schedule()
    assert out.num_scheduled_tokens[plain.request_id] == len(prompt)
    assert out.kv_connector_metadata.loads == []
    finish(s, out, [plain])


@pytest.mark.parametrize("tamper", ["salt", "tokens", "fingerprint", "no-question"])
def test_mismatches_load_nothing(core, model_dir, extra, tamper):
    s = scheduler(vllm_config(model_dir, extra))
    prompt, params, salt, _ = compose(core, question=f"Which drink do I prefer? ({tamper})")
    end = end_of(params)
    if tamper == "salt":
        salt = "inferscale-0000000000000000"
    elif tamper == "tokens":
        prompt = list(prompt)
        prompt[end - 1] = (prompt[end - 1] + 1) % 49152
    elif tamper == "fingerprint":
        params["inferscale"]["fingerprint"] = "LlamaForCausalLM:L31"
    else:
        prompt = prompt[:end]
    r = request(prompt, params, salt)
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens[r.request_id] == len(prompt)
    assert out.kv_connector_metadata.loads == []
    finish(s, out, [r])


def test_a_shape_mismatch_at_the_scheduler_loads_nothing(core, model_dir, extra):
    vc = vllm_config(model_dir, extra, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    s = scheduler(vc)
    prompt, params, salt, _ = compose(core)
    r = request(prompt, params, salt)
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens[r.request_id] == len(prompt)


# ---- worker side ----

LAYERS = 30
HEADS, DIM = 3, 64


def caches(layout: str, dtype=torch.float32, block=BLOCK):
    """Per layer vLLM-named cache tensors of `layout`, filled with NaN so
    any slot the connector should not write stays recognisable."""
    out = {}
    for layer in range(LAYERS):
        if layout == "kv_first":
            t = torch.full((2, NUM_BLOCKS, block, HEADS, DIM), float("nan"), dtype=dtype)
        elif layout == "block_first":
            t = torch.full((NUM_BLOCKS, 2, block, HEADS, DIM), float("nan"), dtype=dtype)
        elif layout == "packed":
            t = torch.full((NUM_BLOCKS, HEADS, block, 2 * DIM), float("nan"), dtype=dtype)
        elif layout == "packed_nhd":
            # vLLM's NHD order: logical (B, H, N, 2D) over storage (B, N, H, 2D).
            t = torch.full((NUM_BLOCKS, block, HEADS, 2 * DIM), float("nan"), dtype=dtype).permute(0, 2, 1, 3)
        else:
            raise ValueError(layout)
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def read_kv(t: torch.Tensor, layout: str, slot: int):
    """(K, V) of one slot, `[HEADS * DIM]` each, by plain tensor indexing."""
    b, n = divmod(slot, t.shape[-2] if layout.startswith("packed") else t.shape[2])
    if layout == "kv_first":
        k, v = t[0, b, n], t[1, b, n]
    elif layout == "block_first":
        k, v = t[b, 0, n], t[b, 1, n]
    else:
        k, v = t[b, :, n, :DIM], t[b, :, n, DIM:]
    return k.reshape(-1).float(), v.reshape(-1).float()


def worker(vc, kv):
    w = isc.InferScaleConnector(vc, KVConnectorRole.WORKER, None)
    w.register_kv_caches(kv)
    return w


def plan_and_load(core, model_dir, extra, kv):
    """Schedules one composed request and runs the worker's load into `kv`."""
    vc = vllm_config(model_dir, extra)
    s = scheduler(vc)
    prompt, params, salt, _ = compose(core, question="How do I keep fit?")
    r = request(prompt, params, salt)
    s.add_request(r)
    out = s.schedule()
    w = worker(vc, kv)
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)
    failed = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    finish(s, out, [r])
    return prompt, params, out.kv_connector_metadata.loads[0], failed


def reference(core, header, prompt, chunk, shift=0):
    """Per layer (K, V) `[len, kv_dim]` of `chunk` as a prompt prefill
    computes them. The header: the prompt's first tokens. A fact: the
    memory encodes it right after the header (docs/design.md §2), so the
    reference is a prefill of header + fact placed to put the fact at its
    prompt positions (attention depends on relative positions only)."""
    start, n = chunk["start"], chunk["len"]
    tokens = prompt[start : start + n]
    if chunk["fact"] is None:
        kv = core.reference_kv(tokens, start + shift)
    else:
        kv = core.reference_kv(header + tokens, start - len(header) + shift)
    return [
        (torch.tensor(k).reshape(-1, HEADS * DIM)[-n:], torch.tensor(v).reshape(-1, HEADS * DIM)[-n:]) for k, v in kv
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("layout", ["kv_first", "block_first", "packed", "packed_nhd"])
def test_injection_equals_prompt_prefill_in_every_layout(core, model_dir, extra, layout):
    kv = caches(layout)
    prompt, params, load, failed = plan_and_load(core, model_dir, extra, kv)
    assert failed == set()
    tensors = [kv[n] for n in isc._layer_order(list(kv))]
    chunks = params["inferscale"]["chunks"]
    assert chunks[0]["fact"] is None and len(chunks) == 4
    header = prompt[: chunks[0]["len"]]
    for c in chunks:
        start, n = c["start"], c["len"]
        ref, off = reference(core, header, prompt, c), reference(core, header, prompt, c, shift=1)
        for layer, t in enumerate(tensors):
            got = [read_kv(t, layout, load.block_ids[p // BLOCK] * BLOCK + p % BLOCK) for p in range(start, start + n)]
            gk = torch.stack([g[0] for g in got])
            gv = torch.stack([g[1] for g in got])
            rk, rv = ref[layer]
            what = f"{layout} {'header' if c['fact'] is None else c['fact']} layer {layer}"
            assert rel(gk, rk) <= TOL, f"{what}: K {rel(gk, rk):.2e}"
            assert rel(gv, rv) <= TOL, f"{what}: V {rel(gv, rv):.2e}"
            if layer == 0:
                # The check can fail: keys at a position off by one miss by far.
                ok = off[layer][0]
                assert rel(gk, ok) > 100 * TOL, f"{what}: off-by-one keys within {rel(gk, ok):.2e}"
    # The question's slots are vLLM's: untouched.
    end = end_of(params)
    for p in range(end, len(prompt)):
        k, v = read_kv(tensors[0], layout, load.block_ids[p // BLOCK] * BLOCK + p % BLOCK)
        assert torch.isnan(k).all() and torch.isnan(v).all()


def test_bf16_cache_holds_the_rounded_reference(core, model_dir, extra):
    kv = caches("packed", torch.bfloat16)
    prompt, params, load, failed = plan_and_load(core, model_dir, extra, kv)
    assert failed == set()
    c = params["inferscale"]["chunks"][1]
    start, n = c["start"], c["len"]
    header = prompt[: params["inferscale"]["chunks"][0]["len"]]
    ref = reference(core, header, prompt, c)
    t = kv["model.layers.7.self_attn.attn"]
    got = torch.stack(
        [read_kv(t, "packed", load.block_ids[p // BLOCK] * BLOCK + p % BLOCK)[0] for p in range(start, start + n)]
    )
    want = ref[7][0].to(torch.bfloat16).float()
    assert float(((got - want).abs() / want.abs().clamp_min(1e-3)).max()) <= 2**-8


def test_worker_fails_closed_on_a_forged_plan(core, model_dir, extra):
    vc = vllm_config(model_dir, extra)
    s = scheduler(vc)
    prompt, params, salt, _ = compose(core, question="Where will I run?")
    params["inferscale"]["id"] = "0" * 32
    r = request(prompt, params, salt)
    s.add_request(r)
    out = s.schedule()
    load = out.kv_connector_metadata.loads[0]
    kv = caches("packed")
    w = worker(vc, kv)
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)
    failed = w.get_block_ids_with_load_errors()
    assert failed == set(load.block_ids[: (load.end - 1) // BLOCK + 1])
    assert all(torch.isnan(t).all() for t in kv.values())
    finish(s, out, [r])


@pytest.mark.parametrize("bad", ["block_size", "heads", "fp8"])
def test_worker_fails_closed_on_a_cache_it_cannot_address(core, model_dir, extra, bad):
    vc = vllm_config(model_dir, extra)
    s = scheduler(vc)
    prompt, params, salt, _ = compose(core, question=f"Who teaches piano? ({bad})")
    r = request(prompt, params, salt)
    s.add_request(r)
    out = s.schedule()
    if bad == "block_size":
        kv = caches("packed", block=32)
    elif bad == "heads":
        kv = {n: torch.full((NUM_BLOCKS, 4, BLOCK, 2 * DIM), float("nan")) for n in caches("packed")}
    else:
        kv = {n: t.to(torch.float8_e4m3fn) for n, t in caches("packed").items()}
    w = worker(vc, kv)
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)
    load = out.kv_connector_metadata.loads[0]
    assert w.get_block_ids_with_load_errors() == set(load.block_ids[: (load.end - 1) // BLOCK + 1])
    finish(s, out, [r])


def test_layer_names_are_ordered_by_index():
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0, 1)]
    assert isc._layer_order(names) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10)]
    with pytest.raises(ValueError, match="no layer index"):
        isc._layer_order(["lm_head"])
    assert re.search(r"layers", names[0])


def test_the_worker_api_starts_once_per_core_when_configured(core, model_dir, extra):
    import socket

    served = dict(extra, grpc_listen="127.0.0.1:0", vllm_url="http://127.0.0.1:8000")
    vc = vllm_config(model_dir, served)
    w = isc.InferScaleConnector(vc, KVConnectorRole.WORKER, None)
    assert w._core is core, "the same process core serves the API"
    bound = isc.serve_front(core, served, vc)
    host, port = bound.rsplit(":", 1)
    assert int(port) > 0
    socket.create_connection((host, int(port)), timeout=5).close()
    # A second connector of this process reuses the running API.
    isc.InferScaleConnector(vc, KVConnectorRole.WORKER, None)
    assert isc.serve_front(core, served, vc) == bound
    with pytest.raises(RuntimeError, match="already serves"):
        core.serve("127.0.0.1:0", "http://127.0.0.1:8000", "m")
    with pytest.raises(ValueError, match="vllm_url"):
        isc.serve_front(core, dict(extra, grpc_listen="127.0.0.1:0"), vc)
    assert isc.serve_front(core, extra, vc) is None, "not configured: nothing served"


def test_a_bad_retriever_in_the_extra_config_is_refused(extra, tmp_path):
    bad = dict(extra, memory_dir=str(tmp_path / "memory"), retriever="bm25")
    with pytest.raises(ValueError, match="`bm25` is not one of dense, lexical, hybrid"):
        isc.core_for(bad)
