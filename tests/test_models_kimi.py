"""Kimi-K2.5 / K2.6 (`kimi_k25`, families.WRAPPERS): a vision-language checkpoint whose text model is DeepSeek-V3's
(`kimi_k2`). We train the text model: its logits equal transformers' on text input in each stored layout (the Hub's
`language_model.model.*`, transformers' in-memory `model.language_model.*`, and what transformers' save_pretrained
writes), and the checkpoint we write back holds every tensor read, in the Hub's layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_models_support import VOCAB, input_ids, max_diff, randomize_

from miles_hpc.models import ModelConfig, load_pretrained, read_config, save_pretrained

TEXT: dict[str, Any] = dict(
    model_type="kimi_k2",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=8,
    qk_nope_head_dim=8,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.827,
    max_position_embeddings=128,
)
VISION: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, patch_size=4
)


def _hf(tmp_path: Path, **top: Any) -> tuple[Any, Path]:
    """A tiny Kimi-K2.5 with random weights, saved by transformers (its save_pretrained layout)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("kimi_k25", text_config=TEXT, vision_config=VISION, projection_hidden_size=32, **top)
    hf = randomize_(AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager", dtype=torch.float32))
    hf.eval().save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


def _rewrite(src: Path, dst: Path, rename: Any) -> Path:
    dst.mkdir()
    save_file({rename(n): t.contiguous() for n, t in _tensors(src).items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def _hub_name(n: str) -> str:
    """The Hub's text names (`language_model.model.layers.*`): transformers' save writes `blocks` for `layers`."""
    return n.replace("language_model.model.blocks.", "language_model.model.layers.")


def _memory_name(n: str) -> str:
    n = _hub_name(n)
    if n.startswith("language_model.model."):
        return "model.language_model." + n.removeprefix("language_model.model.")
    return "lm_head.weight" if n == "language_model.lm_head.weight" else n


@pytest.mark.parametrize("layout", ["transformers-save", "hub", "in-memory"])
def test_kimi_k25_text_model_matches_transformers_in_every_layout(layout: str, tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    hf, saved = _hf(tmp_path, tie_word_embeddings=False)
    rename = {"transformers-save": None, "hub": _hub_name, "in-memory": _memory_name}[layout]
    path = saved if rename is None else _rewrite(saved, tmp_path / layout, rename)
    ours = load_pretrained(path)
    assert ours.config.model_type == "deepseek_v3" == read_config(path).model_type
    assert ours.config.routed_scaling_factor == 2.827 and not ours.config.tie_word_embeddings
    assert ours.hf_extra and all(
        n.startswith(("vision_tower.", "mm_projector.", "model.mm_projector.")) for n in ours.hf_extra
    )
    ids = input_ids(seq=24)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        assert max_diff(ours(ids), ref) < 1e-4
    save_pretrained(ours, tmp_path / "ours")
    written, read = _tensors(tmp_path / "ours"), _tensors(saved)
    assert sorted(written) == sorted(_hub_name(n) for n in read)  # the Hub's layout, nothing lost
    assert all(torch.equal(written[_hub_name(n)], t) for n, t in read.items())
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["model_type"] == "kimi_k25" and config["text_config"]["model_type"] == "deepseek_v3"
    assert read_config(tmp_path / "ours") == ours.config.replace(dtype="float32")
    back, info = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "ours", attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        assert max_diff(back.eval()(input_ids=ids).logits, ref) == 0.0


def test_the_wrappers_tie_default_decides_as_in_transformers(tmp_path: Path) -> None:
    """Kimi_K25Config ties by default whatever its text_config says; a checkpoint without the key is tied."""
    hf, saved = _hf(tmp_path)
    assert hf.lm_head.weight is hf.model.language_model.embed_tokens.weight
    raw = json.loads((saved / "config.json").read_text())
    raw.pop("tie_word_embeddings")
    assert ModelConfig.from_hf_dict(
        {**raw, "text_config": {**raw["text_config"], "tie_word_embeddings": False}}
    ).tie_word_embeddings
    ours = load_pretrained(saved)
    assert ours.config.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = input_ids(seq=16)
    with torch.no_grad():
        assert max_diff(ours(ids), hf(input_ids=ids).logits) < 1e-4


def test_the_int4_release_is_refused_by_name(tmp_path: Path) -> None:
    """Kimi-K2.5 ships its experts INT4 (compressed-tensors): refused naming the key, not loaded as garbage."""
    _, saved = _hf(tmp_path, tie_word_embeddings=False)
    raw = json.loads((saved / "config.json").read_text())
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (saved / "config.json").write_text(json.dumps({**raw, "quantization_config": quant}))
    with pytest.raises(ValueError, match="quant_method"):
        load_pretrained(saved)


def test_tiny_preset_is_a_kimi_k25_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    from miles_hpc.models.presets import init_model

    path = init_model("kimi_k25", "tiny", tmp_path / "k", seed=3)
    ours = load_pretrained(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "kimi_k25"
    assert ours.config.model_type == "deepseek_v3" and ours.num_moe_layers >= 1 and ours.hf_extra
    back = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    ids = input_ids(seq=12) % ours.config.vocab_size
    with torch.no_grad():
        assert max_diff(back.eval()(input_ids=ids).logits, ours(ids)) < 1e-5
