"""miles_hpc.models multi-token-prediction layers (models/mtp.py): what depth d computes, the in-sequence shift,
packing, checkpoints with the layer (transformers keeps none, so the layout is the releases' and SGLang's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_models_support import max_diff, randomize_

from miles_hpc.models import ModelConfig, build_model, load_pretrained, save_pretrained
from miles_hpc.models.mtp import mtp_targets, shift_within
from miles_hpc.models.presets import preset_config


def tiny(arch: str = "glm_moe_dsa", **overrides: object) -> torch.nn.Module:
    cfg = ModelConfig.from_hf_dict({**preset_config(arch, "tiny"), **overrides})
    torch.manual_seed(0)
    return randomize_(build_model(cfg), seed=3).eval()


def test_shift_and_targets_stay_inside_each_sequence() -> None:
    ids = torch.tensor([[10, 11, 12, 13, 20, 21, 22]])
    cu = torch.tensor([0, 4, 7])
    shifted, valid = shift_within(ids, 1, cu)
    assert shifted.tolist() == [[11, 12, 13, 0, 21, 22, 0]]
    assert valid.tolist() == [[True, True, True, False, True, True, False]]
    assert mtp_targets(ids, 1, cu).tolist() == [[12, 13, -100, -100, 22, -100, -100]]
    assert mtp_targets(ids, 1, None).tolist() == [[12, 13, 20, 21, 22, -100, -100]]


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32", "deepseek_v3"])
def test_depth_one_is_eh_proj_of_the_next_embedding_and_the_normed_hidden(arch: str) -> None:
    model = tiny(arch, num_nextn_predict_layers=1) if arch == "deepseek_v3" else tiny(arch)
    n = model.config.num_hidden_layers
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    mtp: list[torch.Tensor] = []
    with torch.no_grad():
        logits = model(ids, mtp_out=mtp)
        assert torch.equal(logits, model(ids))  # asking for MTP changes nothing in the main output
        # By hand: the main model's final-normed hidden states (hooked), the embedding one token ahead.
        seen: dict[str, torch.Tensor] = {}
        model.model.norm.register_forward_hook(lambda _m, _a, out: seen.setdefault("h", out))
        model(ids)
        layer = model.model.layers[n]
        ahead = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        x = layer.eh_proj(torch.cat([layer.enorm(model.model.embed_tokens(ahead)), layer.hnorm(seen["h"])], -1))
        pos = torch.arange(ids.shape[1])[None]
        cos, sin = model.rotary(pos, x.dtype)
        from miles_hpc.models.attention import sdpa_attention
        from miles_hpc.models.transformer import DecoderLayer

        x, _, _ = DecoderLayer.forward(layer, x, cos, sin, sdpa_attention, None, None)
        want = model.lm_head(layer.shared_head.norm(x))
    assert len(mtp) == 1 and max_diff(mtp[0], want) < 1e-5
    assert max_diff(mtp[0], logits) > 1e-2  # a layer of its own, not the main head again


def test_packed_mtp_logits_equal_separate_ones() -> None:
    model = tiny()
    a = torch.randint(0, 300, (1, 21), generator=torch.Generator().manual_seed(2))
    b = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(3))
    packed: list[torch.Tensor] = []
    sep_a: list[torch.Tensor] = []
    sep_b: list[torch.Tensor] = []
    with torch.no_grad():
        model(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 21, 30]), mtp_out=packed)
        model(a, mtp_out=sep_a)
        model(b, mtp_out=sep_b)
    # Every row with a token ahead in its own sequence agrees; the last row of each reads token 0 either way.
    assert max_diff(packed[0][:, :21], sep_a[0]) < 1e-5
    assert max_diff(packed[0][:, 21:], sep_b[0]) < 1e-5


def test_checkpoints_keep_the_mtp_layer(tmp_path: Path) -> None:
    model = tiny()
    n = model.config.num_hidden_layers
    save_pretrained(model, tmp_path)
    back = load_pretrained(tmp_path)
    assert back.config.num_nextn_predict_layers == 1
    mine, theirs = model.state_dict(), back.state_dict()
    assert set(mine) == set(theirs) and any(k.startswith(f"model.layers.{n}.eh_proj") for k in mine)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_mtp_out_needs_mtp_layers() -> None:
    model = tiny(num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        model(torch.zeros(1, 4, dtype=torch.long), mtp_out=[])
