"""Multimodal checkpoints of a supported text family (models/hf_io.py, families.WRAPPERS): Qwen3.5-MoE as Qwen
publishes it (`Qwen3_5MoeForConditionalGeneration`: the text model under `model.language_model.`, a vision tower,
the wrapper's config with the text model's under `text_config`). We train the text model: its logits equal
transformers' on text input, and the checkpoint written back holds every tensor of the one read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from test_models_support import VOCAB, input_ids, max_diff, randomize_

from miles_hpc.models import load_pretrained, read_config, save_pretrained

TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)
VISION: dict[str, Any] = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4, spatial_merge_size=2
)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


def test_qwen35_moe_multimodal_checkpoint_round_trips(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_5_moe", text_config=TEXT, vision_config=VISION)
    hf = randomize_(AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager", dtype=torch.float32))
    hf.eval().save_pretrained(tmp_path / "hf")
    read = _tensors(tmp_path / "hf")
    assert any(n.startswith("model.visual.") for n in read)
    ours = load_pretrained(tmp_path / "hf")
    assert ours.config.model_type == "qwen3_5_moe_text" == read_config(tmp_path / "hf").model_type
    assert ours.hf_extra and all(not n.startswith("model.language_model.") for n in ours.hf_extra)
    ids = input_ids(seq=30)
    with torch.no_grad():
        assert max_diff(ours(ids), hf(input_ids=ids).logits) < 4e-4  # the fp32 noise of test_models_hybrid.py
    save_pretrained(ours, tmp_path / "ours")
    written = _tensors(tmp_path / "ours")
    assert sorted(written) == sorted(read) and all(torch.equal(written[n], read[n]) for n in read)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["vision_config"] == original["vision_config"]
    assert read_config(tmp_path / "ours") == ours.config.replace(dtype="float32")
    back, info = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "ours", attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        assert max_diff(back.eval()(input_ids=ids).logits, hf(input_ids=ids).logits) == 0.0


def test_an_fp8_multimodal_checkpoint_is_refused(tmp_path: Path) -> None:
    """Its vision tower would be written back in fp8 under a config without the quantization: refused by name."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    cfg = AutoConfig.for_model("qwen3_5_moe", text_config=TEXT, vision_config=VISION)
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(ValueError, match="config.json: an FP8 multimodal checkpoint is not supported"):
        load_pretrained(tmp_path / "hf")
