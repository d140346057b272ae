"""The decoder-only causal LM for every supported family (dense layers; sparse MoE layers for qwen3_moe,
deepseek_v3, whose attention is MLA, mla.py, and glm4_moe, which shares DeepSeek-V3's router; deepseek_v32 and
glm_moe_dsa, DeepSeek-V3 with DeepSeek sparse attention, dsa.py). A `families.FAMILY_MODULES` family (DeepSeek-V4,
Inkling) brings its own backbone, whose `run` this class calls; the head, routing records and logits rows are
shared.

Stage: shared model code: the trainer calls it on packed sequences, the engine with its own attention backend.

Invariants:
- `state_dict()` keys are transformers 5's in-memory names (`model.layers.{i}.self_attn.q_proj.weight`, ...,
  `lm_head.weight`); with tied embeddings `lm_head.weight` is the same Parameter as `model.embed_tokens.weight`.
- `forward` is a pure function of (weights, inputs): no KV cache or RoPE state survives a call.
- Multi-token-prediction layers (MLA families, `num_nextn_predict_layers`) are `model.layers[num_hidden_layers:]`
  (HF's names); `forward` runs only the decoder layers before them, `mtp.py` the rest.
- `forward(input_ids)` returns logits [B, T, vocab] in the parameter dtype ([B, n, vocab] for the n rows named by
  `logits_indices`). With `return_routed_experts=True`
  it returns (logits, routed) where routed is int32 [B, T, num_moe_layers, top_k] (dense layers excluded,
  MoE layers in layer order); a dense model returns an empty [B, T, 0, 0] tensor there.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .attention import AttentionBackend, check_cu_seqlens, sdpa_attention
from .config import ModelConfig
from .dsa import Selection
from .families import family_module
from .hybrid import linear_dims
from .layers import Attention, OffsetRMSNorm, SwiGLUMLP, make_norm
from .linear_attn import GatedDeltaNet, run_packed
from .mamba2 import Mamba2Mixer
from .mixer_blocks import NemotronBackbone
from .mla import MLAttention
from .moe import DeepseekMoeBlock, SharedExpertMoeBlock, SparseMoeBlock
from .rope import RotaryEmbedding


class Backbone(Protocol):
    """`CausalLM.model`: ours (DecoderModel), Nemotron-H's, or a FAMILY_MODULES family's (which adds `run`)."""

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module


class LinearBackend(Protocol):
    """Runs one linear-attention layer: ``(layer_idx, module, h [1, T, H], cu_seqlens or None) -> [1, T, H]``."""

    def __call__(
        self, layer_idx: int, module: nn.Module, h: torch.Tensor, cu_seqlens: torch.Tensor | None
    ) -> torch.Tensor: ...


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = config.is_moe_layer(layer_idx)
        # A hybrid family's linear-attention layer mixes tokens with Gated DeltaNet (HF name `linear_attn`).
        self.is_linear = config.is_linear_layer(layer_idx)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(linear_dims(config))
        else:
            self.self_attn: nn.Module = (
                MLAttention(config, layer_idx) if config.is_mla else Attention(config, layer_idx)
            )
        self.mlp: nn.Module
        if self.is_moe:
            if config.group_router:
                self.mlp = DeepseekMoeBlock(config)
            else:
                self.mlp = SharedExpertMoeBlock(config) if config.is_hybrid else SparseMoeBlock(config)
        else:
            self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)

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
        linear: LinearBackend | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Selection | None]:
        """(hidden, routed expert ids of an MoE layer or None, DSA selection of an MLA layer or None)."""
        selection = None
        if self.is_linear:
            h = self.input_layernorm(x)
            a = (
                run_packed(self.linear_attn, h, cu_seqlens)
                if linear is None
                else linear(self.layer_idx, self.linear_attn, h, cu_seqlens)
            )
        elif isinstance(self.self_attn, MLAttention):
            h = self.input_layernorm(x)
            a, selection = self.self_attn(h, cos, sin, backend, cu_seqlens, shared, index_replay)
        else:
            a = self.self_attn(self.input_layernorm(x), cos, sin, backend, cu_seqlens)
        x = x + a
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            out, ids = self.mlp(h, replay, compare)
            return x + out, ids, selection
        return x + self.mlp(h), None, selection

    @property
    def recurrent(self) -> nn.Module | None:
        """The layer's recurrent mixer (its state lives per sequence in the engine), or None."""
        return self.linear_attn if self.is_linear else None


class DecoderModel(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # As transformers: the pad token's row gets no gradient from the lookup (it still does via a tied head).
        pad = config.pad_token_id
        padding_idx = pad if pad is not None and 0 <= pad < config.vocab_size else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=padding_idx)
        from .mtp import MTPLayer  # mtp.py builds on DecoderLayer

        n = config.num_hidden_layers
        layers: list[nn.Module] = [DecoderLayer(config, i) for i in range(n)]
        layers += [MTPLayer(config, n + j) for j in range(config.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = make_norm(config, config.hidden_size)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        fam = family_module(config.model_type)
        self._trim = getattr(fam, "trim_logits", None)
        self.model: Backbone = (
            fam.backbone(config)
            if fam is not None
            else NemotronBackbone(config)
            if config.model_type == "nemotron_h"
            else DecoderModel(config)
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.moe_layer_ids: tuple[int, ...] = config.moe_layer_ids()
        self.num_moe_layers: int = len(self.moe_layer_ids)
        self.top_k: int = config.num_experts_per_tok if self.num_moe_layers else 0
        self.indexer_layer_ids: tuple[int, ...] = tuple(
            i for i in range(config.num_hidden_layers) if config.indexer_full(i)
        )
        # A multimodal checkpoint's wrapper config and its tensors that are not the text model's (hf_io.py).
        self.hf_wrapper: dict | None = None
        self.hf_extra: dict[str, torch.Tensor] = {}
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so (re-run after `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random init as transformers does it: N(0, initializer_range) matrices, zero biases, unit norms, zero
        pad-token embedding row."""
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("bias"):  # also DeepSeek's e_score_correction_bias
                p.zero_()
            elif p.dim() == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
        pad = self.model.embed_tokens.padding_idx
        if pad is not None:
            self.model.embed_tokens.weight[pad].zero_()
        for m in self.modules():  # zero-centred norms, the recurrent mixers' decay rates: their own initialisation
            if isinstance(m, (OffsetRMSNorm, GatedDeltaNet, Mamba2Mixer)) or getattr(m, "custom_init", False):
                m.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        return_routed_experts: bool = False,
        routing_replay: torch.Tensor | None = None,
        attn_backend: AttentionBackend | None = None,
        logits_indices: torch.Tensor | None = None,
        routing_compare: bool = False,
        mtp_out: list[torch.Tensor] | None = None,
        index_replay: torch.Tensor | None = None,
        linear_backend: LinearBackend | None = None,
        family_states: list | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, vocab] for input_ids [B, T].

        position_ids: [B, T] (or [T]); default arange(T) per row, or per packed sequence when cu_seqlens is given.
        cu_seqlens: int [n+1] boundaries of n sequences packed into the single row (B must be 1); attention is
            causal within each sequence and never crosses a boundary.
        return_routed_experts: also return the chosen expert ids, int32 [B, T, num_moe_layers, top_k].
        routing_replay: int [B, T, num_moe_layers, top_k]; MoE layers use these ids instead of their own top-k,
            with gate weights recomputed (differentiably) from the current router probabilities; a token's row of
            -1 (no record) uses the live choice. `replay_stats()` then says how much was replayed and agreed.
        routing_compare: with routing_replay, use the live choices everywhere and only compare (R3 off, measured).
        attn_backend: the attention kernel (default: `sdpa_attention`); see attention.py for the engine's use.
        logits_indices: int [n] token indices (along T) whose logits are wanted; the final norm and LM head run on
            those rows only and logits are [B, n, vocab] (an engine needs the last row of each sequence, not all).
        mtp_out: a list that receives the logits [B, T, vocab] of each multi-token-prediction depth (mtp.py; row i
            of depth d predicts token i + d + 1); needs num_nextn_predict_layers > 0.
        index_replay: DSA models, int [B, T, len(indexer_layer_ids), K]: per token and layer with an indexer, the
            key positions (within the token's sequence, -1 padding) to attend to instead of the indexer's choice; a
            row of only -1 keeps the live choice (models/dsa.py). `index_replay_stats()` then says how many agreed.
        linear_backend: hybrid models, what runs each linear-attention layer (`LinearBackend`; the engine's carries
            state across steps); default: every sequence (row, or packed one of cu_seqlens) from a zero state.
        family_states: a FAMILY_MODULES family whose backbone caches (`new_state`): one state per packed sequence;
            each sequence's tokens continue the `length` tokens its state has seen, which the call extends.
        Long: the contract of every argument above, and one pass that threads each through the layers.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        host_cu = None
        if cu_seqlens is not None:
            # One host read here; the layers get a host copy, so no attention call waits for the device.
            host_cu = torch.tensor(check_cu_seqlens(cu_seqlens, b, t), dtype=torch.int32)
        if position_ids is None:
            position_ids = self._default_positions(t, cu_seqlens, input_ids.device)
        cu_seqlens = host_cu
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        self._check_replays(b, t, routing_replay, index_replay)
        backend = attn_backend if attn_backend is not None else sdpa_attention

        routed: list[torch.Tensor] = []
        if family_states is not None and not hasattr(self.model, "new_state"):
            raise ValueError(f"family_states: {self.config.model_type} keeps no state between calls")
        if hasattr(self.model, "run"):  # a FAMILY_MODULES family's backbone runs its own layers
            if mtp_out is not None or index_replay is not None or linear_backend is not None:
                raise ValueError(f"{self.config.model_type}: mtp_out, index_replay and linear_backend are not built")
            extra = {} if family_states is None else {"states": family_states}
            x, routed = self.model.run(
                input_ids, position_ids, cu_seqlens, backend, routing_replay, routing_compare, **extra
            )
            return self._head(x, logits_indices, return_routed_experts, routed, b, t)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        selection: Selection | None = None
        for i, layer in enumerate(self.model.layers[: self.config.num_hidden_layers]):
            replay = None
            if routing_replay is not None and layer.is_moe:
                replay = routing_replay[:, :, len(routed)].reshape(b * t, self.top_k)
            rows = None
            if index_replay is not None and i in self.indexer_layer_ids:
                rows = index_replay[:, :, self.indexer_layer_ids.index(i)]
            x, ids, sel = layer(
                x, cos, sin, backend, cu_seqlens, replay, routing_compare, selection, rows, linear_backend
            )
            selection = sel if sel is not None else selection
            if ids is not None:
                routed.append(ids)
        if mtp_out is not None:  # the MTP layers read every row's final-normed hidden state
            x = self.model.norm(x)
            mtp_out.extend(self._mtp_logits(x, input_ids, cos, sin, backend, cu_seqlens))
            return self._head(x, logits_indices, return_routed_experts, routed, b, t, normed=True)
        return self._head(x, logits_indices, return_routed_experts, routed, b, t)

    def _head(
        self,
        x: torch.Tensor,
        keep: torch.Tensor | None,
        return_routed: bool,
        routed: list[torch.Tensor],
        b: int,
        t: int,
        normed: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final norm (unless `normed`) and LM head on the rows `keep` of x (all when None); with
        `return_routed`, also the routed ids [B, T, num_moe_layers, top_k] from each MoE layer's [B*T, top_k]."""
        if keep is not None:
            x = x[:, keep.to(device=x.device, dtype=torch.long)]
        x = x if normed else self.model.norm(x)
        logits = self.lm_head(x)
        if self._trim is not None:  # a padded vocabulary's columns are no tokens (Inkling's unpadded_vocab_size)
            logits = self._trim(self.config, logits)
        if not return_routed:
            return logits
        if routed:
            stacked = torch.stack(routed, dim=1).view(b, t, self.num_moe_layers, self.top_k)
        else:
            stacked = torch.empty(b, t, 0, 0, dtype=torch.long, device=logits.device)
        return logits, stacked.to(torch.int32)

    def _check_replays(
        self, b: int, t: int, routing_replay: torch.Tensor | None, index_replay: torch.Tensor | None
    ) -> None:
        if routing_replay is not None:
            expected = (b, t, self.num_moe_layers, self.top_k)
            if tuple(routing_replay.shape) != expected:
                raise ValueError(f"routing_replay must have shape {expected}, got {tuple(routing_replay.shape)}")
        if index_replay is not None:
            n_idx = len(self.indexer_layer_ids)
            if index_replay.dim() != 4 or tuple(index_replay.shape[:3]) != (b, t, n_idx) or not n_idx:
                raise ValueError(
                    f"index_replay must have shape ({b}, {t}, {n_idx}, K) (layers with an indexer: "
                    f"{self.indexer_layer_ids}), got {tuple(index_replay.shape)}"
                )

    def _mtp_logits(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        cu_seqlens: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        from .mtp import MTPLayer, shift_within

        layers = [m for m in self.model.layers[self.config.num_hidden_layers :] if isinstance(m, MTPLayer)]
        if not layers:
            raise ValueError("mtp_out: this model has no multi-token-prediction layers (num_nextn_predict_layers=0)")
        out = []
        for depth, layer in enumerate(layers, start=1):
            ahead, _ = shift_within(input_ids, depth, cu_seqlens)
            hidden = layer(hidden, self.model.embed_tokens(ahead), cos, sin, backend, cu_seqlens)
            out.append(self.lm_head(hidden))
        return out

    def set_indexer_loss(self, mode: str | None) -> None:
        """DSA models: training forwards (grad enabled, default attention path) compute the indexer loss of every
        layer with an indexer, "sparse" (over the selected keys) or "dense" (over all causal keys); None: off."""
        if mode not in (None, "sparse", "dense"):
            raise ValueError(f"indexer loss mode must be 'sparse', 'dense' or None, got {mode!r}")
        if mode is not None and not self.indexer_layer_ids:
            raise ValueError(f"the indexer loss needs a DSA model; {self.config.model_type} has no indexer")
        for i in self.indexer_layer_ids:
            self.model.layers[i].self_attn.indexer_loss = mode

    def take_indexer_kl(self) -> torch.Tensor | None:
        """The KL sum (over query rows and layers with an indexer) of the last training forward with the indexer
        loss on, or None (no such forward since the last call); each layer's value is handed out once."""
        parts = []
        for i in self.indexer_layer_ids:
            att = self.model.layers[i].self_attn
            if att.indexer_kl is not None:
                parts.append(att.indexer_kl)
                att.indexer_kl = None
        return torch.stack(parts).sum() if parts else None

    def index_replay_stats(self) -> torch.Tensor:
        """int64 [3] summed over the layers with an indexer, for the last forward with `index_replay`: (token-layers
        with a record, of those the ones whose live top-k equals the record, all token-layers)."""
        layers = [self.model.layers[i].self_attn for i in self.indexer_layer_ids]
        return torch.stack([att.replay_stats for att in layers]).sum(dim=0)

    def replay_stats(self) -> torch.Tensor:
        """int64 [3] summed over MoE layers for the last forward with `routing_replay`: (token-layers with a record,
        of those the ones whose live top-k set equals the record, all token-layers)."""
        decoder = self.model.layers[: self.config.num_hidden_layers]
        stats = [layer.mlp.gate.replay_stats for layer in decoder if layer.is_moe]
        return torch.stack(stats).sum(dim=0)

    @staticmethod
    def _default_positions(t: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        pos = torch.arange(t, device=device)
        if cu_seqlens is not None:
            # Restart at 0 at each packed sequence: position = index - start of its sequence.
            cu = cu_seqlens.to(device=device, dtype=torch.long)
            starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=t)
            pos = pos - starts
        return pos.unsqueeze(0)
