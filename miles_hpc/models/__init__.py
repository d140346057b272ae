"""One torch implementation per architecture family, shared by engine and trainer (SUPPORTED_MODEL_TYPES lists them).

Stage: shared. Public API (a contract): `load_pretrained`, `save_pretrained`, `build_model`, `ModelConfig`,
`CausalLM.forward(input_ids, position_ids=None, cu_seqlens=None, return_routed_experts=False,
routing_replay=None, attn_backend=None)`. HF tensor names are the interface to checkpoints and weight sync
(`iter_hf_tensors`, `hf_target`). Nothing here imports transformers.
"""

from .attention import AttentionBackend, sdpa_attention
from .config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling
from .hf_io import (
    build_model,
    expected_hf_shapes,
    hf_target,
    iter_hf_tensors,
    load_hf_checkpoint,
    load_pretrained,
    read_config,
    save_pretrained,
)
from .transformer import CausalLM

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "AttentionBackend",
    "CausalLM",
    "ModelConfig",
    "RopeScaling",
    "build_model",
    "expected_hf_shapes",
    "hf_target",
    "iter_hf_tensors",
    "load_hf_checkpoint",
    "load_pretrained",
    "read_config",
    "save_pretrained",
    "sdpa_attention",
]
