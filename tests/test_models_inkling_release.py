"""Inkling as released (`inkling_mm_model`, InklingForConditionalGeneration; families.WRAPPERS, inkling_release.py):
the text model under `model.llm.*` in the release's names, gate and up rows interleaved in the fused MLP tensors,
beside a vision tower, an audio tower and MTP layers. We train the text model: on text input its logits equal
transformers' multimodal class's on the same checkpoint (the one transformers' save_pretrained writes, which is the
release layout), and what we write back is that checkpoint, every tensor bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_models_support import VOCAB, input_ids, max_diff, randomize_

from miles_hpc.models import inkling_release as release
from miles_hpc.models import load_pretrained, read_config, save_pretrained
from miles_hpc.models.inkling import tiny_config, trim_logits

# Towers as small as transformers 5.24 builds them (its vision tower's plan needs patch and temporal sizes of 2).
VISION: dict[str, Any] = dict(num_hidden_layers=2, patch_size=2, temporal_patch_size=2)
AUDIO: dict[str, Any] = dict(n_mel_bins=4, mel_vocab_size=8)


def make_release(tmp_path: Path, seed: int = 0, **text: Any) -> tuple[Any, Path]:
    """A tiny Inkling release with random weights everywhere, saved by transformers (the release's layout)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    base = {k: v for k, v in tiny_config().items() if k not in ("architectures", "torch_dtype", "dtype")}
    cfg = AutoConfig.for_model(
        "inkling_mm_model",
        text_config={**base, "vocab_size": VOCAB + 3, "unpadded_vocab_size": VOCAB, **text},
        vision_config=VISION,
        audio_config=AUDIO,
    )
    torch.manual_seed(seed)
    hf = randomize_(AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32), seed=seed)
    hf.eval().save_pretrained(tmp_path / "release")
    return hf, tmp_path / "release"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


@pytest.mark.parametrize(
    "case", [{}, {"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"], "n_shared_experts": 2}]
)
def test_logits_equal_transformers_multimodal_class_on_text(case: dict[str, Any], tmp_path: Path) -> None:
    hf, path = make_release(tmp_path, **case)
    names = set(_tensors(path))
    assert "model.llm.unembed.weight" in names and any(n.endswith(".mlp.experts.w13_weight") for n in names)
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.audio.") for n in names)
    ours = load_pretrained(path).eval()
    assert ours.config.model_type == "inkling_text" and ours.hf_wrapper["model_type"] == "inkling_mm_model"
    ids = input_ids()
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = trim_logits(ours.config, ours(ids))
    assert max_diff(got, want) < 1e-5


def test_written_back_as_the_release_bit_for_bit(tmp_path: Path) -> None:
    """Every tensor read (the towers' included) is written back under its name with its bits; transformers reloads
    the checkpoint with no key missing or unexpected."""
    from transformers import AutoModelForImageTextToText

    _, path = make_release(tmp_path, seed=3)
    ours = load_pretrained(path)
    save_pretrained(ours, tmp_path / "ours")
    before, after = _tensors(path), _tensors(tmp_path / "ours")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[n], after[n]) for n in before)
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["model_type"] == "inkling_mm_model" and "vision_config" in written and "audio_config" in written
    _, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_gate_and_up_rows_interleave_in_the_fused_tensors() -> None:
    """The release keeps gate row i at 2i and up row i at 2i + 1 (transformers' conversion table for this class)."""
    gate, up = torch.arange(6.0).view(3, 2), 100 + torch.arange(6.0).view(3, 2)
    ((name, fused),) = release.stored(
        [("model.layers.0.mlp.gate_proj.weight", gate), ("model.layers.0.mlp.up_proj.weight", up)]
    )
    assert name == "model.llm.layers.0.mlp.w13_dn.weight"
    assert torch.equal(fused[0::2], gate) and torch.equal(fused[1::2], up)
    experts = torch.randn(2, 6, 4)  # [experts, gate rows then up rows, hidden]: ours
    ((_, stored),) = release.stored([("model.layers.1.mlp.experts.gate_up_proj", experts)])
    assert torch.equal(stored[:, 0::2], experts[:, :3]) and torch.equal(stored[:, 1::2], experts[:, 3:])
    (source, transform) = release.sources([name])["model.layers.0.mlp.up_proj.weight"]
    assert source == name and transform is not None and torch.equal(transform(fused), up)
    with pytest.raises(ValueError, match="gate and up"):
        release.stored([("model.layers.0.mlp.gate_proj.weight", gate)])


def test_quantized_release_and_missing_text_tensors_are_named(tmp_path: Path) -> None:
    _, path = make_release(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "modelopt"}}))
    with pytest.raises(ValueError, match="quant_method"):
        read_config(path)
    (path / "config.json").write_text(json.dumps(config))
    tensors = _tensors(path)
    del tensors["model.llm.layers.2.attn.wq_du.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.2\.self_attn\.q_proj\.weight'"):
        load_pretrained(path)
