"""DeepSeek-V3 / Kimi-K2 multi-latent attention in the megatron-core backend (stage: train; used by
`train/mcore_model.py`): `MLATransformerConfig` fields for our config, and megatron's local MLA layer spec made to
build and to train right under tensor parallelism; the same for the DSA families (their core attention:
`train/mcore_dsa.py`), and the multi-token-prediction layers of all three held in megatron's MTP modules. Each piece
names the megatron-core behaviour it works around (0.16 and 0.19); docs/megatron.md lists them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from miles_hpc.models import ModelConfig
from miles_hpc.models.mla import LATENT_NORM_EPS

__all__ = [
    "FixedEpsNorm",
    "KVDownGather",
    "held_mtp_block",
    "local_mla_spec",
    "mla_kwargs",
    "without_sequence_parallel",
]

# The core attention spec of a layer (global index); None: the plain MLA one (`_MLACoreAttention`).
CoreAttention = Callable[[ModelConfig, int], Any] | None


def mla_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """`MLATransformerConfig` fields for DeepSeek-V3's attention (see `local_mla_spec` for the layer spec).
    Megatron's MLA scores with softmax scale mscale(factor, mscale_all_dim)^2 / sqrt(nope + rope) and scales
    cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) under yarn, as our `models/mla.py`; its yarn
    frequencies are transformers' (`models/rope.py`). Raises, naming the field, where they would differ."""
    rope: dict[str, Any] = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    rs = cfg.rope_scaling
    if rs is not None:
        if rs.rope_type != "yarn":
            raise NotImplementedError(
                f"megatron backend: rope_scaling {rs.rope_type!r} with MLA (megatron's MLA has plain and yarn RoPE)"
            )
        unmapped = {
            "rope_scaling.factor (derived from the lengths)": rs.factor is None,
            "rope_scaling.attention_factor": rs.attention_factor is not None,
            "rope_scaling.truncate=False (megatron's MLA rounds the yarn range)": rs.truncate is False,
            "rope_scaling.mscale_all_dim without mscale": bool(rs.mscale_all_dim) and not rs.mscale,
        }
        for field, bad in unmapped.items():
            if bad:
                raise NotImplementedError(f"megatron backend: {field} is not mapped yet")
        rope = dict(
            rope_type="yarn",
            rotary_scaling_factor=rs.factor,
            original_max_position_embeddings=rs.original_max_position_embeddings,
            beta_fast=rs.beta_fast or 32,
            beta_slow=rs.beta_slow or 1,
            # without mscale_all_dim the model scales cos/sin by mscale(factor, 1) and leaves the softmax alone
            mscale=rs.mscale if rs.mscale_all_dim else 1.0,
            mscale_all_dim=rs.mscale_all_dim or 0.0,
        )
    return dict(
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.head_dim,
        v_head_dim=cfg.v_head_dim,
        rotary_base=cfg.rope_theta,
        **rope,
        # every head has its own key (from the shared latent); the local attention's output width is
        # heads x kv_channels, i.e. the value heads
        num_query_groups=cfg.num_attention_heads,
        kv_channels=cfg.v_head_dim,
        add_qkv_bias=False,
        # the latent norms come from the spec (`local_mla_spec`); qk_layernorm would make finalize_model_grads
        # sum the q_layernorm gradients over TP, which every rank already has whole (the q up projection
        # all-reduces its input gradient)
        qk_layernorm=False,
    )


def local_mla_spec(spec: Any, cfg: ModelConfig, first_layer: int = 0, core_attention: CoreAttention = None) -> Any:
    """megatron's local MLA layer spec (one layer's `ModuleSpec`, global index `first_layer`, or a block's, whose
    layers start at `first_layer`), made to build: its attention takes the spec's modules as given
    (`_MLASelfAttention`), with the latent RMSNorms (q's only with q LoRA; transformers' eps, `_LatentNorm`) and a
    local core attention that accepts MLA's arguments (`_MLACoreAttention`), or `core_attention(cfg, layer)`'s
    (DSA: `train/mcore_dsa.py`)."""

    def mla_layer(layer: ModuleSpec, index: int) -> ModuleSpec:
        attention = layer.submodules.self_attention
        parts = dataclasses.replace(
            attention.submodules,
            core_attention=_MLACoreAttention if core_attention is None else core_attention(cfg, index),
            kv_layernorm=_LatentNorm,
            q_layernorm=_LatentNorm if cfg.q_lora_rank is not None else IdentityOp,
        )
        attention = dataclasses.replace(attention, module=_MLASelfAttention, submodules=parts)
        return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))

    if isinstance(spec, ModuleSpec):
        return mla_layer(spec, first_layer)
    return dataclasses.replace(
        spec, layer_specs=[mla_layer(layer, first_layer + k) for k, layer in enumerate(spec.layer_specs)]
    )


def held_mtp_block(
    cfg: ModelConfig,
    tcfg: Any,
    core_attention: CoreAttention = None,
    transform: Callable[[ModuleSpec], ModuleSpec] = lambda spec: spec,
    vp_stage: int | None = None,
) -> MultiTokenPredictionBlock:
    """The multi-token-prediction layers as megatron's `MultiTokenPredictionBlock` (enorm, hnorm, the column-parallel
    eh_proj, the decoder layer of index N + j, final_layernorm), held to be loaded, saved and synced, never run:
    `build_gpt` attaches it as `model.mtp` without megatron's `mtp_process`, whose forward computes its own MTP loss
    from labels (our loss takes the logits; MTP training is `train.mtp_loss_coef`, FSDP only). `transform`: the
    decoder's substitutions for each layer's spec (sequence-parallel norms, the CP core attention). `vp_stage`: the
    virtual pipeline chunk that holds it (the last), under virtual stages."""
    layers = []
    for j in range(cfg.num_nextn_predict_layers):
        i = cfg.num_hidden_layers + j
        layer = get_gpt_layer_local_spec(
            num_experts=tcfg.num_moe_experts if cfg.is_moe_layer(i) else None,
            moe_grouped_gemm=False,
            multi_latent_attention=True,
            normalization="RMSNorm",
        )
        parts = MultiTokenPredictionLayerSubmodules(
            enorm=WrappedTorchNorm,  # RMSNorm (config.normalization) with rms_norm_eps, as ours
            hnorm=WrappedTorchNorm,
            eh_proj=ColumnParallelLinear,
            transformer_layer=local_mla_spec(layer, cfg, i, core_attention),
            layer_norm=WrappedTorchNorm,
        )
        layers.append(transform(ModuleSpec(module=MultiTokenPredictionLayer, submodules=parts)))
    mtp_cfg = copy.copy(tcfg)  # the model's own config keeps mtp_num_layers=None: GPTModel runs no MTP
    mtp_cfg.mtp_num_layers = cfg.num_nextn_predict_layers
    spec = MultiTokenPredictionBlockSubmodules(layer_specs=layers)
    return MultiTokenPredictionBlock(config=mtp_cfg, spec=spec, vp_stage=vp_stage)


def without_sequence_parallel(config: Any) -> Any:
    """A copy of megatron's `config` with sequence_parallel off, for a torch norm (which refuses SP); copied, not
    rebuilt: `dataclasses.replace` would rerun megatron's checks, which refuse what `mcore_model.transformer_config`
    set after them (context parallelism with DSA)."""
    out = copy.copy(config)
    out.sequence_parallel = False
    return out


class FixedEpsNorm:
    """A local (torch) norm of megatron's spec interface with a fixed eps instead of the `layernorm_epsilon`
    megatron passes: transformers builds MLA's latent norms and the DSA indexer's k_norm with 1e-6 whatever
    rms_norm_eps is (1e-5 in GLM-5). Subclasses set `eps`; the kind (RMSNorm, LayerNorm) is the config's. Its
    weights in `config.params_dtype`, as megatron's other parameters (torch builds them in float32: under bf16
    training LayerNorm then refuses the bf16 input). `sequence_sharded`: under sequence parallelism the norm sees
    its TP rank's chunk of the tokens, so its weights' gradients are summed over TP (megatron's
    `finalize_model_grads` does, for weights marked `sequence_parallel`; its torch norm refuses SP itself)."""

    eps: float
    sequence_sharded: bool = False

    def __new__(cls, config: Any, hidden_size: int, eps: float | None = None, **kwargs: Any) -> Any:
        sp = config.sequence_parallel
        config = without_sequence_parallel(config) if sp else config
        norm = WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=cls.eps, **kwargs)
        norm = norm.to(dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = sp and cls.sequence_sharded
        return norm


class _LatentNorm(FixedEpsNorm):
    """MLA's q_a_layernorm / kv_a_layernorm (megatron's q_layernorm / kv_layernorm): under sequence parallelism
    they norm the compressed q and kv of this rank's chunk of the tokens."""

    eps = LATENT_NORM_EPS
    sequence_sharded = True


class KVDownGather:
    """Forward hook on MLA's `linear_kv_down_proj` under TP > 1 (column-parallel in the local spec): gathers its
    output here, so that the rotary key's gradient is summed over TP ranks. Megatron gathers it itself and splits
    the gradient back (`gather_from_tensor_model_parallel_region`), which is right for the latent (the kv up
    projection all-reduces its input gradient) but not for the rotary key part, shared by all heads: each rank's
    gradient there comes from its own heads only, and the split keeps one rank's (megatron-core 0.16
    multi_latent_attention.py get_query_key_value_tensors, 0.19 the same; only its sequence-parallel path with a
    replicated down projection sums it). Given the whole width, megatron takes its non-gathering branch.

    Under sequence parallelism (MoE under TP) that branch expects what a replicated down projection gives, this
    rank's chunk of the tokens: the gathered output is split over the sequence here, and megatron's branch
    gathers the rotary key back over the sequence, whose backward (a reduce-scatter) sums its gradient over TP."""

    def __init__(self, kv_lora_rank: int, sequence_parallel: bool = False) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.sequence_parallel = sequence_parallel

    def __call__(
        self, module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, Any]
    ) -> tuple[torch.Tensor, Any]:
        local, bias = output
        full = gather_from_tensor_model_parallel_region(local)  # backward: this rank's columns of the gradient
        if self.sequence_parallel:  # backward: the chunks' gradients gathered back into the whole row
            return scatter_to_sequence_parallel_region(full), bias
        latent, rope = full.split([self.kv_lora_rank, full.shape[-1] - self.kv_lora_rank], dim=-1)
        return torch.cat([latent, _SumGradOverTP.apply(rope)], dim=-1), bias


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over the TP group. (megatron's
    `copy_to_tensor_model_parallel_region` does this, but 0.16 all-reduces a contiguous copy of a non-contiguous
    gradient and returns the original, unreduced: tensor_parallel/mappings.py `_reduce`; 0.19 returns the copy.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may hold the incoming one elsewhere
        torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        return grad


class _MLASelfAttention(MLASelfAttention):
    """megatron's MLA self-attention, built from its spec's modules. megatron-core 0.19 instead resolves the q/kv
    norms from `config.qk_layernorm` and the backend (`transformer/mla_qk_norm_config.py`): off, it drops the
    latent norms; on, without Transformer Engine it cannot build `linear_q_proj` (no q LoRA), and it makes
    finalize_model_grads sum the q_layernorm gradients over TP. 0.16 builds the spec's modules and never calls
    this hook."""

    def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
        names = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "q_layernorm", "kv_layernorm")
        return {name: getattr(submodules, name) for name in names}


class _MLACoreAttention(DotProductAttention):
    """megatron's local (unfused) attention for MLA. MLA passes its q/k and v head widths (`k_channels`,
    `v_channels`), which the local attention does not take (megatron-core 0.16 and 0.19: a TypeError); its forward
    already reads the q/k width from the tensors, and the v width is `config.kv_channels` (= v_head_dim,
    `mla_kwargs`). The softmax scale is MLA's (passed)."""

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if v_channels not in (None, self.hidden_size_per_attention_head):
            raise ValueError(
                f"MLA's v head width {v_channels} != config.kv_channels {self.hidden_size_per_attention_head}"
            )
