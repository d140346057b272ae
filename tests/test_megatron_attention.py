"""train/mcore_attention.py: megatron's core attention as SDPA over a packed row's sequences. Against masked softmax
attention computed here (the local spec's math), GQA and MLA's wider q/k than v included; the bounds travel as the
attention mask, a boolean mask is refused; the spec walker swaps megatron's local core attention (and subclasses of
it) and nothing else. The whole models' parity with ours through it is tests/test_megatron.py's."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import has_megatron, require


def _megatron() -> tuple:
    require(has_megatron(), "megatron-core (the megatron extra)")
    from megatron.core.transformer.transformer_config import TransformerConfig

    from miles_hpc.train import mcore_attention

    return TransformerConfig, mcore_attention


def _config(heads: int = 4, groups: int = 2, kv_channels: int = 8):  # noqa: ANN202
    tcfg_cls, _ = _megatron()
    return tcfg_cls(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=kv_channels,
        attention_dropout=0.0,
    )


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float) -> torch.Tensor:
    """Masked softmax over the whole row, the block-diagonal causal mask: [T, 1, heads * dv]."""
    t, heads = q.shape[0], q.shape[2]
    seq = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    rep = heads // k.shape[2]
    qh = q[:, 0].transpose(0, 1).double()
    kh = k[:, 0].transpose(0, 1).double().repeat_interleave(rep, 0)
    vh = v[:, 0].transpose(0, 1).double().repeat_interleave(rep, 0)
    scores = (qh @ kh.transpose(1, 2) * scale).masked_fill(~allowed, -math.inf)
    return (scores.softmax(-1) @ vh).transpose(0, 1).reshape(t, 1, -1)


@pytest.mark.parametrize(("heads", "groups", "d", "dv"), [(4, 2, 8, 8), (4, 4, 12, 8), (2, 1, 16, 16)])
def test_packed_attention_is_masked_attention_per_sequence(heads: int, groups: int, d: int, dv: int) -> None:
    _, ma = _megatron()
    g = torch.Generator().manual_seed(0)
    bounds = [0, 7, 7, 19, 44, 45]  # an empty sequence and a one-token one among them
    t = bounds[-1]
    q = torch.randn(t, 1, heads, d, generator=g)
    k = torch.randn(t, 1, groups, d, generator=g)
    v = torch.randn(t, 1, groups, dv, generator=g)
    scale = 0.3
    core = ma.PackedCoreAttention(_config(heads, groups), 1, None, "self", softmax_scale=scale, k_channels=d)
    mask = ma.packed_mask(torch.tensor(bounds, dtype=torch.int32))
    out = core(q, k, v, mask)
    assert out.shape == (t, 1, heads * dv) and mask.device.type == "cpu"
    torch.testing.assert_close(out.double(), _reference(q, k, v, bounds, scale), atol=1e-5, rtol=1e-5)
    default = ma.PackedCoreAttention(_config(heads, groups, kv_channels=d), 1, None, "self")
    assert default.softmax_scale == d**-0.5


def test_a_boolean_mask_or_bounds_that_miss_tokens_are_refused() -> None:
    _, ma = _megatron()
    core = ma.PackedCoreAttention(_config(), 1, None, "self")
    q, k = torch.zeros(6, 1, 4, 8), torch.zeros(6, 1, 2, 8)
    with pytest.raises(ValueError, match="takes the row's sequence bounds as attention_mask"):
        core(q, k, k, torch.ones(1, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="do not cover 6 tokens"):
        core(q, k, k, torch.tensor([0, 4, 5]))
    with pytest.raises(NotImplementedError, match="attention dropout"):
        ma.PackedCoreAttention(_config(), 1, None, "self", attention_dropout=0.1)


def test_the_spec_walker_swaps_the_local_core_attention_only() -> None:
    _, ma = _megatron()
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    class Subclass(DotProductAttention):  # as MLA's local core attention
        pass

    class Other(torch.nn.Module):  # as DSA's
        pass

    @dataclasses.dataclass
    class Sub:
        core_attention: object
        other: object

    spec = ModuleSpec(module=torch.nn.Module, submodules=[Sub(DotProductAttention, Other), Sub(Subclass, 3)])
    got = ma.replace_core_attention(spec, ma.PackedCoreAttention)
    assert [s.core_attention for s in got.submodules] == [ma.PackedCoreAttention] * 2
    assert [s.other for s in got.submodules] == [Other, 3] and got.module is torch.nn.Module
