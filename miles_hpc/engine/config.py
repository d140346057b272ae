"""Engine configuration: KV-cache geometry, batch budgets, context limit, prefix caching, sampling seed.

Stage: engine. One frozen dataclass, validated on construction; every error names the field. The server builds it
from its CLI flags (or the root config) and passes it to `Engine`; nothing else reads engine knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """Knobs of the embedded inference engine (see docs/design.md section 4)."""

    device: str = "cpu"
    """torch device of the weights and the KV cache ("cpu", "cuda", "cuda:1", ...)."""
    dtype: str | None = None
    """Weights and KV-cache dtype (float32, bfloat16, float16, float64); None = the checkpoint's."""
    block_size: int = 16
    """Tokens per KV-cache block; prefix caching reuses whole blocks."""
    num_blocks: int | None = None
    """KV-cache blocks; None: sized from `kv_cache_fraction` of free GPU memory, or `max_total_tokens` on CPU."""
    max_total_tokens: int = 65536
    """KV capacity in tokens on CPU when `num_blocks` is None."""
    kv_cache_fraction: float = 0.85
    """On GPU with `num_blocks` None: the fraction of the memory free after loading weights given to the cache."""
    max_running_requests: int = 256
    """Requests decoding at once; more wait in the queue."""
    max_prefill_tokens: int = 8192
    """Prompt tokens processed per step across requests (long prompts are chunked); decodes are extra."""
    max_context_len: int | None = None
    """Prompt + generated tokens per request; None = the model's max_position_embeddings."""
    enable_prefix_cache: bool = True
    """Reuse the KV of full blocks shared with earlier prompts (hash chain over token ids)."""
    seed: int = 0
    """Seeds the per-request sampling seeds of requests that bring none."""
    max_loras: int = 8
    """LoRA adapters held at once (`/load_lora_adapter`; a request picks one by name in `lora_path`)."""
    triton_kernels: bool = True
    """On CUDA with Triton installed: the paged-decode attention kernel and the fused decode step of dense models;
    False = the torch path (gathered keys + SDPA, the model's own forward)."""
    cuda_graphs: bool = True
    """On CUDA with `triton_kernels`: replay decode-only steps of dense models from CUDA graphs captured at start
    (one per padded batch size up to 256); False = run the same fused step eagerly."""
    tuned_attention_tiles: bool = False
    """With the fused decode step: the paged-attention kernel's tiles by batch size (measured on an H200: +8% attention
    bandwidth at batch 256, +4% at 64), which sum the softmax in another order, so bfloat16 outputs differ from the
    default tiles' by rounding; False keeps the fixed tiles (outputs as before)."""
    fused_moe: bool = False
    """With `triton_kernels` on CUDA: MoE layers' routed experts (SiLU) as two Triton grouped GEMMs
    (engine/triton_moe.py) instead of one launch group per expert with a host sync per layer. Off until measured
    on a GPU (checked against the torch path in Triton's interpreter only so far; docs/benchmarks.md)."""
    fused_extend_tokens: int = 32
    """With the fused decode step: a step whose prefill chunks are each at most this many tokens (a cached-prefix
    request's new suffix, a short follow-up turn) runs its tokens as rows of that step (each row attends the cache
    up to its own position), so a short prefill costs one graph replay instead of an eager forward; 0 = never."""
    batch_invariant: bool = False
    """Zero-KL mode: batch-invariant kernels (fixed-shape row tiles, per-sequence attention), so a token's logits and
    log-prob do not depend on the batch, the prefix cache or the step it is computed in, and equal the trainer's in
    zero-KL mode bit for bit. Always eager (no Triton decode, fused step or CUDA graphs); every family (dense, MoE, MLA)."""
    record_indexer_topk: bool = False
    """DSA models (deepseek_v32, glm_moe_dsa): keep each cached token's indexer selection (int32 key positions, per
    indexer layer, `index_topk` of them) beside its KV, so requests can ask for them (`return_indexer_topk`, indexer
    replay); costs num_indexer_layers * index_topk * 4 bytes per cached token. Other models refuse it at start-up."""

    tp_size: int = 1
    """Tensor parallelism: ranks (processes, one device each: device index + rank on GPUs) serving one model, its
    heads, FFN widths, experts' widths and vocabulary split (engine/tp.py); the HTTP front is rank 0's."""

    def __post_init__(self) -> None:
        if not self.device or not isinstance(self.device, str):
            raise ValueError(f"device must be a torch device string, got {self.device!r}")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device: {e}") from e
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {self.dtype!r}")
        positive = (
            "block_size",
            "max_total_tokens",
            "max_running_requests",
            "max_prefill_tokens",
            "max_loras",
            "tp_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("num_blocks", "max_context_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction!r}")
        for name in (
            "triton_kernels",
            "cuda_graphs",
            "batch_invariant",
            "record_indexer_topk",
            "tuned_attention_tiles",
            "fused_moe",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if (
            not isinstance(self.fused_extend_tokens, int)
            or isinstance(self.fused_extend_tokens, bool)
            or (self.fused_extend_tokens < 0)
        ):
            raise ValueError(f"fused_extend_tokens must be an int >= 0, got {self.fused_extend_tokens!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def torch_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else DTYPES[self.dtype]
