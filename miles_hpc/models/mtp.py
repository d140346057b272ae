"""Multi-token prediction (MTP, "next-n") layers of the MLA families: DeepSeek-V3, DeepSeek-V3.2, GLM-5.

Stage: shared model code. transformers leaves these layers out (it ignores `model.layers.{N}.*` on load); the
layout here is the released checkpoints' and SGLang's NextN draft model's:

- layer `N + j` (N = num_hidden_layers) is a full decoder layer (attention with its own DSA indexer in the DSA
  families, MoE block) plus `enorm`, `hnorm` (RMSNorm), `eh_proj` [hidden, 2 * hidden] and `shared_head.norm`;
  the output head is the model's `lm_head` (a release's `shared_head.head` / `embed_tokens` copies of the
  model's are accepted on load and not kept);
- depth j + 1 takes h_j (h_0 = the main model's final-normed hidden states) and the embedding of the token
  j + 1 places ahead: x = eh_proj([enorm(embed(t[i + j + 1])), hnorm(h_j[i])]), runs the layer at the same
  positions, h_{j+1} = shared_head.norm(layer(x)); its logits at row i predict token i + j + 2.

Within packed sequences the shift never crosses a boundary: rows with no token j + 1 ahead in their own sequence
read token 0 and their logits are meaningless (`mtp_targets` marks them -100, ignored by cross-entropy).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import AttentionBackend
from .config import ModelConfig
from .layers import RMSNorm
from .transformer import DecoderLayer


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


class MTPLayer(DecoderLayer):
    """One MTP depth: HF names `model.layers.{N + j}.{enorm,hnorm,eh_proj,shared_head.norm,self_attn,mlp,...}`."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(h, config.rms_norm_eps)

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """h_{j+1} [B, T, hidden] from h_j and the embeddings of the shifted tokens (module docstring). The whole
        depth is this module's forward, so FSDP's per-module hooks gather all of its parameters."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x, _, _ = DecoderLayer.forward(self, x, cos, sin, backend, cu_seqlens, None)
        return self.shared_head.norm(x)


def shift_within(ids: torch.Tensor, k: int, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids moved k places left inside each sequence, bool [B, T]: the row has a token k ahead in its sequence).
    ids [B, T]; with cu_seqlens (B == 1) per packed sequence, else per row."""
    b, t = ids.shape
    pos = torch.arange(t, device=ids.device)
    if cu_seqlens is None:
        end = torch.full((t,), t, device=ids.device)
    else:
        cu = cu_seqlens.to(device=ids.device, dtype=torch.long)
        end = torch.repeat_interleave(cu[1:], cu[1:] - cu[:-1], output_size=t)
    valid = (pos + k < end).expand(b, t)
    src = torch.where(valid[0], pos + k, pos)
    shifted = torch.where(valid, ids[:, src], torch.zeros_like(ids))
    return shifted, valid


def mtp_targets(ids: torch.Tensor, depth: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Targets [B, T] of MTP depth `depth` (1-based): token i + depth + 1 of the row's sequence, -100 where none."""
    target, valid = shift_within(ids, depth + 1, cu_seqlens)
    return torch.where(valid, target, torch.full_like(target, -100))


__all__ = ["MTPLayer", "mtp_targets", "shift_within"]
