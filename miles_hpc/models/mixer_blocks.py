"""Nemotron-H's blocks (issue 29): each layer is one pre-norm and one mixer, a Mamba-2 scan ("M"), attention
without RoPE ("*"), a relu2 MLP ("-") or a MoE ("E"): the sigmoid group-limited router of DeepSeek-V3, non-gated
relu2 experts (optionally at a latent width between ``fc1_latent_proj`` and ``fc2_latent_proj``) and one shared
relu2 expert. Config keys and fixed traits: nemotron.py.

Stage: shared model code (transformer.CausalLM builds `NemotronBackbone` for the family).

Invariants:
- In-memory names are transformers 5.24's (``model.embeddings``, ``model.layers.{i}.norm``, ``.mixer.*``,
  ``model.norm_f``; experts fused as ``mixer.experts.up_proj`` [E, I, D] and ``down_proj`` [E, D, I], D the
  latent width or hidden_size); hf_io.py maps them to the Hub's ``backbone.*`` per-expert names.
- `MixerBlock.forward` has `transformer.DecoderLayer.forward`'s signature and results, so the CausalLM loop, R3
  (routes of the "E" blocks, in layer order), the engine's attention and recurrent-state backends drive both.
- The experts' combine is moe.grouped_mix (transformers' grouped_mm order: bitwise on CPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBackend
from .config import ModelConfig
from .dsa import Selection
from .layers import ACTIVATIONS, Attention, make_norm
from .linear_attn import run_packed
from .mamba2 import Mamba2Mixer
from .moe import GroupLimitedRouter, grouped_mix
from .nemotron import mamba_dims


class Relu2MLP(nn.Module):
    """``down(act(up(x)))``: HF names ``up_proj``, ``down_proj`` (Nemotron-H's MLP blocks and shared expert)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class PlainExperts(nn.Module):
    """Non-gated experts held fused: ``up_proj`` [E, I, D], ``down_proj`` [E, D, I]."""

    def __init__(self, width: int, intermediate: int, num_experts: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, width))
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, intermediate))
        self.act = ACTIVATIONS[act]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act(F.linear(x, self.up_proj[e])), self.down_proj[e])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return grouped_mix(x, ids, weights, self.num_experts, self.expert)


class LatentMoeBlock(nn.Module):
    """An "E" block's mixer: ``gate`` (router), ``experts``, ``shared_experts``, and when the config has
    ``moe_latent_size``, ``fc1_latent_proj`` / ``fc2_latent_proj`` around the routed experts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        latent = config.moe_latent_size
        self.gate = GroupLimitedRouter(config)
        self.experts = PlainExperts(
            latent or config.hidden_size, config.moe_intermediate_size, config.num_experts, config.hidden_act
        )
        self.shared_experts = Relu2MLP(
            config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act, config.mlp_bias
        )
        self.fc1_latent_proj = nn.Linear(config.hidden_size, latent, bias=config.mlp_bias) if latent else None
        self.fc2_latent_proj = nn.Linear(latent, config.hidden_size, bias=config.mlp_bias) if latent else None

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, compare: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H], replay [B*T, k] or None -> (out [B, T, H], routed ids [B*T, k])."""
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        weights, ids = self.gate(flat, replay, compare)
        routed = flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)
        routed = self.experts(routed, ids, weights)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed.view(b, t, h) + self.shared_experts(x), ids


class MixerBlock(nn.Module):
    """``norm`` then ``mixer`` (the kind `config.layer_types[layer_idx]` names), added to the residual."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = config.layer_types[layer_idx]
        self.is_moe = self.kind == "moe"
        self.is_linear = self.kind == "linear_attention"
        self.norm = make_norm(config, config.hidden_size)
        self.mixer: nn.Module
        if self.is_linear:
            self.mixer = Mamba2Mixer(mamba_dims(config))
        elif self.kind == "full_attention":
            self.mixer = Attention(config, layer_idx)
        elif self.is_moe:
            self.mixer = LatentMoeBlock(config)
        else:
            self.mixer = Relu2MLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)

    @property
    def recurrent(self) -> nn.Module | None:
        """The block's Mamba-2 mixer (its state lives per sequence in the engine), or None."""
        return self.mixer if self.is_linear else None

    @property
    def mlp(self) -> nn.Module:
        """An "E" block's MoE (what R3's statistics and the MoE tooling look up as ``layer.mlp``)."""
        if not self.is_moe:
            raise AttributeError(f"layer {self.layer_idx} is a {self.kind} block, not a MoE one")
        return self.mixer

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        cu_seqlens: torch.Tensor | None,
        replay: torch.Tensor | None,
        compare: bool = False,
        shared: Selection | None = None,
        index_replay: torch.Tensor | None = None,
        linear: Callable[..., torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Selection | None]:
        """As `transformer.DecoderLayer.forward`: (hidden, routed ids of an "E" block or None, None)."""
        h = self.norm(x)
        if self.is_moe:
            out, ids = self.mixer(h, replay, compare)
            return x + out, ids, None
        if self.is_linear:
            out = (
                run_packed(self.mixer, h, cu_seqlens)
                if linear is None
                else linear(self.layer_idx, self.mixer, h, cu_seqlens)
            )
        elif self.kind == "full_attention":
            out = self.mixer(h, cos, sin, backend, cu_seqlens)
        else:
            out = self.mixer(h)
        return x + out, None, None


class NemotronBackbone(nn.Module):
    """HF's ``model.`` of Nemotron-H: ``embeddings``, ``layers``, ``norm_f`` (``embed_tokens`` and ``norm`` are the
    names the rest of the code reads: aliases)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # No padding_idx (transformers' NemotronHModel has none): the pad token's row trains like any other.
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([MixerBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm_f = make_norm(config, config.hidden_size)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.embeddings

    @property
    def norm(self) -> nn.Module:
        return self.norm_f
