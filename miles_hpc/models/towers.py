"""Random-init multimodal towers for the presets of wrapper families (families.WRAPPERS): the tensors a multimodal
checkpoint holds beside its text model, named and shaped as transformers 5.24's save_pretrained writes them, so
`init-model` makes a checkpoint of the published kind (transformers loads it with no missing key) without
transformers installed. We never run a tower: hf_io.py carries its tensors through load and save unchanged.

Stage: shared (presets.py writes these; nothing reads them but transformers and SGLang).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def kimi_k25_tower(config: Mapping[str, Any], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Kimi-K2.5's MoonViT tower and projector (Kimi_K25ForConditionalGeneration) for the wrapper config.json
    `config`: N(0, 0.02) matrices, zero biases, unit norm weights."""
    v = config["vision_config"]
    dim, inter, patch = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["patch_size"])
    merged = dim * int(v["merge_kernel_size"][0]) * int(v["merge_kernel_size"][1])
    text_hidden, pre = int(config["text_config"]["hidden_size"]), int(config["projection_hidden_size"])
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, out: int, inp: int) -> None:
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (out, inp), (out,)

    def norm(name: str, width: int) -> None:
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (width,), (width,)

    for i in range(int(v["num_hidden_layers"])):
        block = f"vision_tower.encoder.blocks.{i}"
        linear(f"{block}.wqkv", 3 * dim, dim)
        linear(f"{block}.wo", dim, dim)
        linear(f"{block}.mlp.fc0", inter, dim)
        linear(f"{block}.mlp.fc1", dim, inter)
        norm(f"{block}.norm0", dim)
        norm(f"{block}.norm1", dim)
    norm("vision_tower.encoder.final_layernorm", dim)
    shapes["vision_tower.encoder.patch_embed.proj.weight"] = (dim, 3, patch, patch)
    shapes["vision_tower.encoder.patch_embed.proj.bias"] = (dim,)
    shapes["vision_tower.patch_embed.pos_emb.weight"] = (int(v["pos_emb_height"]), int(v["pos_emb_width"]), dim)
    norm("model.mm_projector.pre_norm", pre)
    linear("mm_projector.proj.0", merged, merged)
    linear("mm_projector.proj.2", text_hidden, merged)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("bias"):
            out[name] = torch.zeros(shape)
        elif "norm" in name:
            out[name] = torch.ones(shape)
        else:
            out[name] = torch.randn(shape, generator=generator) * 0.02
    return out


TOWERS = {"kimi_k25": kimi_k25_tower}
