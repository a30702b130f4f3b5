"""InferScale's KV connector for vLLM's V1 engine (vLLM 0.26).

Configure vLLM with::

    --kv-transfer-config '{"kv_connector": "InferScaleConnector",
        "kv_connector_module_path": "inferscale_vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"model": "...", "memory_dir": "..."}}'

A request that carries a memory plan (``kv_transfer_params["inferscale"]``,
issued by ``Core.compose``) has its memory tokens — the prompt's header and
retrieved facts, a prefix of the prompt — reported as externally computed;
the worker side rotates the stored pre-RoPE keys to their positions and
writes K and V into the request's blocks before the forward pass, so vLLM
prefills only the question. Everything that does not match exactly (model
shape, cache layout, dtype, block size, salt, tokens, an unknown plan) loads
nothing: the scheduler reports 0 tokens, or the worker reports the blocks as
failed and vLLM recomputes them. Never is unverified KV left in a block.

The thin part lives here (vLLM's objects in, plain values out); decisions
and writes are in the Rust core, ``inferscale_vllm._core``.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from inferscale_vllm import _core

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's logger tree, so our lines go where and how vLLM's go (its
# INFO level included: the detected cache layout is logged at start).
logger = init_logger(f"vllm.{__name__}")

_CORES: dict[tuple, _core.Core] = {}

#: Worker-side loads in this process: requests loaded, and requests whose
#: memory was refused (their blocks recomputed by vLLM).
STATS = {"loads": 0, "failed": 0}
_CORES_LOCK = threading.Lock()


def core_for(extra: dict[str, Any], device_type: str = "cpu") -> _core.Core:
    """The process's core for a connector's ``kv_connector_extra_config``
    (opened on first use: it loads the model and the memory shard). The
    core runs on the GPU (``backend: cuda``, the default when vLLM runs on
    one) so that stored KV stays in device memory."""
    try:
        model, memory_dir = str(extra["model"]), str(extra["memory_dir"])
    except KeyError as e:
        raise ValueError(
            f"kv_connector_extra_config needs {e.args[0]!r} (our model files and the memory directory)"
        ) from None
    key = (
        model,
        memory_dir,
        str(extra.get("embedder", "minilm")),
        int(extra.get("window", 20)),
        int(extra.get("kv_cache_mb", 256)),
        int(extra.get("max_batch_tokens", 512)),
        str(extra.get("backend", "cuda" if device_type == "cuda" else "cpu")),
        _device_index() if device_type == "cuda" else 0,
        extra.get("random_shape"),
        str(extra.get("retriever", "hybrid")),
        extra.get("system_prompt"),
        extra.get("instruction"),
        extra.get("memory_turn"),
    )
    with _CORES_LOCK:
        core = _CORES.get(key)
        if core is None:
            core = _core.Core(*key)
            _CORES[key] = core
        return core


_FRONTS: dict[int, str] = {}


def serve_front(core: _core.Core, extra: dict[str, Any], vllm_config: VllmConfig) -> str | None:
    """Starts the worker gRPC API of ``core`` (once per core) when the
    extra config names ``grpc_listen``: memory calls on this process's
    shard, Generate relayed to the vLLM server at ``vllm_url``. Returns the
    bound address, or None when not configured."""
    listen = extra.get("grpc_listen")
    if not listen:
        return None
    url = extra.get("vllm_url")
    if not url:
        raise ValueError("kv_connector_extra_config: grpc_listen needs vllm_url (this vLLM server's http://host:port)")
    with _CORES_LOCK:
        bound = _FRONTS.get(id(core))
        if bound is None:
            names = vllm_config.model_config.served_model_name
            served = names[0] if isinstance(names, (list, tuple)) else names
            bound = core.serve(
                str(listen),
                str(url),
                str(served or vllm_config.model_config.model),
                int(extra.get("max_k", 200)),
                int(extra.get("max_in_flight", 256)),
                int(extra.get("max_ingest_units", 2000)),
                tls_cert=extra.get("tls_cert"),
                tls_key=extra.get("tls_key"),
                tls_ca=extra.get("tls_ca"),
            )
            _FRONTS[id(core)] = bound
            logger.info("inferscale: worker API on %s (Generate through %s)", bound, url)
        return bound


def kv_transfer_config(extra: dict[str, Any]):
    """vLLM's ``KVTransferConfig`` that loads this connector with
    ``kv_connector_extra_config=extra`` — for ``vllm.LLM(...,
    kv_transfer_config=...)``; the CLI takes the same as JSON."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="InferScaleConnector",
        kv_connector_module_path="inferscale_vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )


def _device_index() -> int:
    import torch

    return torch.cuda.current_device()


def engine_fingerprint(vllm_config: VllmConfig) -> str:
    """The shape fingerprint of the model vLLM runs, read off its HF config
    the way the core reads its own model (``plan::shape_fingerprint``)."""
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    params = getattr(hf, "rope_parameters", None) or {}
    scaling = getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    head = mc.get_head_size()
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    return _core.shape_fingerprint(
        architecture=(mc.architectures or ["?"])[0],
        num_layers=hf.num_hidden_layers,
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_dim=head,
        hidden_size=hf.hidden_size,
        vocab_size=hf.vocab_size,
        rope_type=rope_type,
        rope_theta=float(theta) if theta is not None else float("nan"),
        rotary_dim=int(head * partial),
    )


def _plan_json(request: Request) -> str | None:
    params = request.kv_transfer_params
    if not params or _core.PARAMS_KEY not in params:
        return None
    return json.dumps({_core.PARAMS_KEY: params[_core.PARAMS_KEY]})


def _current_stream() -> int:
    """Torch's current CUDA stream: vLLM's forward runs on it, so a load
    queued there precedes the attention that reads it."""
    import torch

    return torch.cuda.current_stream().cuda_stream


@dataclass
class Load:
    """One request's load this step: positions ``from_position..end`` of
    its plan into its blocks."""

    req_id: str
    params_json: str
    block_ids: list[int]
    from_position: int
    end: int


@dataclass
class InferScaleMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_order(names: list[str]) -> list[str]:
    def index(name: str) -> int:
        m = _LAYER_INDEX.search(name)
        if m is None:
            raise ValueError(f"kv cache layer name {name!r} has no layer index")
        return int(m.group(1))

    return sorted(names, key=index)


class InferScaleConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._fingerprint = engine_fingerprint(vllm_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning(
                "inferscale: kv_load_failure_policy is %r: a request whose memory cannot be loaded "
                "fails instead of being recomputed; set it to 'recompute'",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        # Scheduler side: loads decided this step, by request id; requests
        # already warned about (vLLM may ask again at every step).
        self._pending: dict[str, Load] = {}
        self._warned: set[str] = set()
        # Worker side.
        self._core: _core.Core | None = None
        self._unusable: str | None = None
        self._failed_blocks: set[int] = set()
        self._plans_by_req: dict[str, str] = {}
        self._on_device = False
        if role == KVConnectorRole.WORKER:
            self._core = core_for(extra, vllm_config.device_config.device_type)
            if self._core.fingerprint() != self._fingerprint:
                self._unusable = (
                    f"vLLM runs model shape {self._fingerprint}, the memory was made with {self._core.fingerprint()}"
                )
                logger.error("inferscale: %s; memory will be recomputed, never injected", self._unusable)
            serve_front(self._core, extra, vllm_config)

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = _plan_json(request)
        if params is None:
            return 0, False
        try:
            n, why = _core.external_tokens(
                params, list(request.prompt_token_ids or []), request.cache_salt, num_computed_tokens, self._fingerprint
            )
        except ValueError as e:
            self._warn_once(request.request_id, str(e))
            return 0, False
        if why is not None:
            self._warn_once(request.request_id, why)
        return n, False

    def _warn_once(self, req_id: str, why: str) -> None:
        if req_id not in self._warned:
            self._warned.add(req_id)
            logger.warning("inferscale: request %s: %s; its memory is recomputed", req_id, why)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if num_external_tokens <= 0:
            self._pending.pop(request.request_id, None)
            return
        params = _plan_json(request)
        if params is None:  # cannot happen: only planned requests report tokens
            return
        end = _core.plan_end(params)
        self._pending[request.request_id] = Load(
            req_id=request.request_id,
            params_json=params,
            block_ids=[],
            from_position=end - num_external_tokens,
            end=end,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = InferScaleMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            load = self._pending.pop(new.req_id, None)
            if load is not None:
                load.block_ids = list(new.block_ids[0])
                meta.loads.append(load)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            load = self._pending.pop(req_id, None)
            if load is None or req_id not in cached.resumed_req_ids:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                load.block_ids = list(new_blocks[0])
                meta.loads.append(load)
        # Anything left was allocated but not scheduled this step: vLLM asks
        # again (get_num_new_matched_tokens) when it schedules the request.
        self._pending.clear()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._warned.discard(request.request_id)
        self._pending.pop(request.request_id, None)
        return False, None

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        assert self._core is not None
        if self._unusable is not None:
            return
        try:
            names = _layer_order(list(kv_caches))
            layers = []
            devices = {kv_caches[n].device.type for n in names}
            if len(devices) != 1 or not devices <= {"cpu", "cuda"}:
                raise ValueError(f"kv caches on {sorted(devices)}: one of cpu or cuda expected")
            self._on_device = devices == {"cuda"}
            for name in names:
                t = kv_caches[name]
                size = t.element_size()
                elems = (t.untyped_storage().nbytes() - t.storage_offset() * size) // size
                layers.append((t.data_ptr(), list(t.shape), list(t.stride()), elems, str(t.dtype)))
            layout = self._core.register_caches(layers, self._block_size, self._on_device)
            logger.info("inferscale: %d kv cache layers, layout %s", len(layers), layout)
        except ValueError as e:
            self._unusable = str(e)
            logger.error("inferscale: %s; memory will be recomputed, never injected", e)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, InferScaleMetadata)
        for load in meta.loads:
            try:
                if self._unusable is not None:
                    raise ValueError(self._unusable)
                assert self._core is not None
                stream = _current_stream() if self._on_device else 0
                plan = self._core.load(load.params_json, load.block_ids, load.from_position, stream)
                self._plans_by_req[load.req_id] = plan
                STATS["loads"] += 1
            except ValueError as e:
                logger.warning("inferscale: request %s: %s; recomputing its memory", load.req_id, e)
                STATS["failed"] += 1
                bs = self._block_size
                self._failed_blocks.update(load.block_ids[load.from_position // bs : (load.end - 1) // bs + 1])

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads finish in start_load_kv, before the forward pass.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Memory KV is made by the core at ingest; nothing is saved from vLLM.
        return

    def wait_for_save(self):
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._core is not None:
            for req_id in finished_req_ids:
                plan = self._plans_by_req.pop(req_id, None)
                if plan is not None:
                    self._core.finish(plan)
        return None, None
