"""Inkling's released multimodal checkpoint (`inkling_mm_model`, class `InklingForConditionalGeneration`) read as its
text model (`inkling_text`, inkling.py) and written back in the release's layout (families.WRAPPERS' codec hook).

Stage: shared (hf_io.py loads and saves through it).

The release stores the text model under `model.llm.*` in its own names (transformers 5.24's conversion table for
`inkling_mm_model` renames them; the facts below are that table's): `embed` / `embed_norm` / `norm` / `unembed`
(the head, padded to `vocab_size`), and per layer `attn.wq_du|wk_dv|wv_dv|wr_du|wo_ud` (q, k, v, r, o
projections), `attn_norm` / `mlp_norm` (the two layer norms), short convolutions without the `conv1d.` level, a
dense MLP's gate and up projections fused in `mlp.w13_dn.weight` and a MoE layer's in `mlp.experts.w13_weight` and
`mlp.shared_experts.shared_w13_weight`, each with gate and up rows INTERLEAVED along the `2 * intermediate`
dimension (g0, u0, g1, u1, ...), and the router's correction bias as `mlp.gate.bias`. The towers (`model.visual.*`,
`model.audio.*`) and MTP layers (`model.mtp.*`) are not the text model: hf_io.py keeps them and writes them back.

Invariants:
- `sources` and `stored` are inverse: reading what `stored` wrote gives the same tensors bit for bit (the
  interleave is a permutation of rows).
- A stored name this module does not know is not the text model's: it is kept with the towers, and a text tensor
  our model expects but the checkpoint lacks is then reported missing by hf_io.py, by our name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

PREFIX = "model.llm."
HEAD = "model.llm.unembed.weight"
# (release name, ours) for the tensors outside the layers.
_TOP = {"embed.weight": "model.embed_tokens.weight", "embed_norm.weight": "model.embed_tokens.embed_norm.weight"}
_TOP |= {"norm.weight": "model.norm.weight"}
# (release suffix within a layer, ours) for the tensors stored one to one.
_LAYER = {
    "attn.wq_du.weight": "self_attn.q_proj.weight",
    "attn.wk_dv.weight": "self_attn.k_proj.weight",
    "attn.wv_dv.weight": "self_attn.v_proj.weight",
    "attn.wr_du.weight": "self_attn.r_proj.weight",
    "attn.wo_ud.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.k_sconv.weight": "self_attn.k_sconv.conv1d.weight",
    "attn.v_sconv.weight": "self_attn.v_sconv.conv1d.weight",
    "attn.rel_logits_proj.proj": "self_attn.rel_logits_proj.proj",
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn_sconv.weight": "attn_sconv.conv1d.weight",
    "mlp_sconv.weight": "mlp_sconv.conv1d.weight",
    "mlp.w2_md.weight": "mlp.down_proj.weight",
    "mlp.global_scale": "mlp.global_scale",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.bias": "mlp.gate.e_score_correction_bias",
    "mlp.gate.global_scale": "mlp.gate.global_scale",
    "mlp.experts.w2_weight": "mlp.experts.down_proj",
    "mlp.shared_experts.shared_w2_weight": "mlp.shared_experts.down_proj",
}
# Fused gate/up tensors: release suffix -> (the dimension gate and up rows interleave along, our names). One of ours
# is the two halves concatenated (gate rows first: the routed experts' `gate_up_proj`); two are gate and up apart.
_FUSED: dict[str, tuple[int, tuple[str, ...]]] = {
    "mlp.w13_dn.weight": (0, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.experts.w13_weight": (1, ("mlp.experts.gate_up_proj",)),
    "mlp.shared_experts.shared_w13_weight": (1, ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")),
}
_IN_LAYER = re.compile(r"^model\.llm\.layers\.(\d+)\.(.+)$")

Transform = Callable[[torch.Tensor], torch.Tensor]


def _deinterleave(dim: int, part: int | None) -> Transform:
    """Interleaved rows -> [all gate rows; all up rows] along `dim` (part None), or the gate (0) / up (1) rows."""

    def f(t: torch.Tensor) -> torch.Tensor:
        gate, up = t.unflatten(dim, (-1, 2)).unbind(dim + 1)
        return torch.cat([gate, up], dim) if part is None else (gate, up)[part]

    return f


def sources(names: Iterable[str]) -> dict[str, tuple[str, Transform | None]]:
    """Our name -> (the release tensor it comes from, what turns that tensor into ours), for each text tensor in
    `names` (a checkpoint's tensor names)."""
    out: dict[str, tuple[str, Transform | None]] = {}
    for name in names:
        if name == HEAD:
            out["lm_head.weight"] = (name, None)
        elif name.removeprefix(PREFIX) in _TOP and name.startswith(PREFIX):
            out[_TOP[name.removeprefix(PREFIX)]] = (name, None)
        elif (m := _IN_LAYER.match(name)) is not None:
            layer, rest = f"model.layers.{m.group(1)}.", m.group(2)
            if rest in _LAYER:
                out[layer + _LAYER[rest]] = (name, None)
            elif rest in _FUSED:
                dim, ours = _FUSED[rest]
                for part, our in enumerate(ours):
                    out[layer + our] = (name, _deinterleave(dim, part if len(ours) == 2 else None))
    return out


def _interleave(dim: int, parts: list[torch.Tensor]) -> torch.Tensor:
    gate, up = parts if len(parts) == 2 else parts[0].chunk(2, dim)
    return torch.stack([gate, up], dim + 1).flatten(dim, dim + 1)


def stored(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """(release name, tensor) for our text tensors (`iter_hf_tensors` names), fused ones joined again."""
    back = {ours: release for release, ours in _TOP.items()}
    back |= {ours: release for release, ours in _LAYER.items()}
    fused = {our: (release, dim, ours) for release, (dim, ours) in _FUSED.items() for our in ours}
    out: list[tuple[str, torch.Tensor]] = []
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        if name == "lm_head.weight":
            out.append((HEAD, t))
            continue
        if name in back:
            out.append((PREFIX + back[name], t))
            continue
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
        if m is None or (m.group(2) not in back and m.group(2) not in fused):
            raise ValueError(f"{name}: not a tensor of Inkling's text model (models/inkling_release.py)")
        layer, rest = f"{PREFIX}layers.{m.group(1)}.", m.group(2)
        if rest in back:
            out.append((layer + back[rest], t))
            continue
        release, dim, ours = fused[rest]
        group = pending.setdefault(layer + release, {})
        group[rest] = t
        if len(group) == len(ours):
            out.append((layer + release, _interleave(dim, [group[o] for o in ours])))
            del pending[layer + release]
    if pending:
        raise ValueError(f"{next(iter(pending))}: gate and up projections not both given")
    return out
