"""InferScale's memory inside vLLM.

``inferscale_vllm.connector.InferScaleConnector`` is a vLLM V1 KV connector;
``inferscale_vllm._core`` is its Rust core (the memory shard, the plans,
the loads into vLLM's cache). See docs/vllm.md.
"""

from inferscale_vllm._core import Core, external_tokens, shape_fingerprint

__all__ = ["Core", "external_tokens", "shape_fingerprint"]
