"""The Gated DeltaNet layer (models/linear_attn.py) against transformers' own layer on the same weights: Qwen3-Next's
fused projections and Qwen3.5's separate ones, several tiny shapes; outputs and input gradients agree; a prefill
then token-by-token decode on the carried state equals one pass; a packed row equals its sequences run alone."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from miles_hpc.models.linear_attn import DeltaNetDims, GatedDeltaNet

SHAPES = [  # hidden, key heads, value heads, key dim, value dim, conv width
    (32, 2, 4, 8, 6, 4),
    (24, 1, 1, 16, 16, 2),
    (48, 2, 6, 4, 8, 3),
]


def _pair(shape: tuple[int, ...], fused: bool, seed: int) -> tuple[torch.nn.Module, GatedDeltaNet]:
    hidden, nk, nv, dk, dv, w = shape
    keys = dict(hidden_size=hidden, linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
                linear_value_head_dim=dv, linear_conv_kernel_dim=w, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)  # fmt: skip
    torch.manual_seed(seed)
    if fused:
        hf: torch.nn.Module = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**keys), 0)
    else:
        hf = Qwen3_5MoeGatedDeltaNet(Qwen3_5MoeTextConfig(**keys), 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        hf.A_log.copy_(torch.rand_like(hf.A_log).mul(3).sub(1))
    ours = GatedDeltaNet(DeltaNetDims.from_hf(keys, fused=fused))
    assert sorted(ours.state_dict()) == sorted(hf.state_dict())
    ours.load_state_dict(hf.state_dict())
    return hf, ours


@pytest.mark.parametrize("fused", [True, False], ids=["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_matches_transformers(shape: tuple[int, ...], fused: bool) -> None:
    hf, ours = _pair(shape, fused, seed=sum(shape))
    x = torch.randn(2, 70, shape[0], generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = hf(xa)
    got, state = ours(xb)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    weights = torch.randn_like(want)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, dict(hf.named_parameters())[name].grad, rtol=1e-3, atol=1e-5)
    assert state.conv.shape == (2, ours.dims.conv_channels, shape[5] - 1)
    assert state.rule.shape == (2, shape[2], shape[3], shape[4])


@pytest.mark.parametrize("fused", [True, False], ids=["qwen3_next", "qwen3_5"])
def test_prefill_then_decode_and_packing(fused: bool) -> None:
    _, ours = _pair(SHAPES[0], fused, seed=7)
    x = torch.randn(3, 25, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole, final = ours(x)
        out, state = ours(x[:, :17])
        steps = [out]
        for t in range(17, 25):
            o, state = ours(x[:, t : t + 1], state=state)
            steps.append(o)
        torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state.rule, final.rule, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state.conv, final.conv)
        # Packed: three sequences of different lengths in one row, each as if alone.
        lengths = [25, 9, 14]
        row = torch.cat([x[0], x[1, :9], x[2, :14]])[None]
        packed, states = ours(row, lengths=lengths)
        start = 0
        for i, n in enumerate(lengths):
            alone, s = ours(row[:, start : start + n])
            torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(states.rule[i : i + 1], s.rule, rtol=1e-4, atol=1e-5)
            start += n
        with pytest.raises(ValueError, match="summing to T"):
            ours(row, lengths=[3, 4])


def test_value_heads_must_group_over_key_heads() -> None:
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        DeltaNetDims(hidden=8, key_heads=2, value_heads=3, key_dim=4, value_dim=4, conv_width=4)


@pytest.mark.parametrize("mixer", ["deltanet", "mamba2"])
def test_sequences_of_one_length_run_together_as_each_alone(mixer: str) -> None:
    """run_sequences groups a packed row's sequences by length into the rows of one call: every sequence's output
    and end state are the ones it has alone, from its own start state (a row mixed with its neighbours, or a state
    scattered to the wrong sequence, is not), up to fp32 rounding: a batch's projections and one row's round
    differently (1e-7 here; a mixed-up row is off by O(1))."""
    from miles_hpc.models.linear_attn import LinearState
    from miles_hpc.models.mamba2 import Mamba2Dims, Mamba2Mixer

    torch.manual_seed(0)
    module: torch.nn.Module
    if mixer == "deltanet":
        module = GatedDeltaNet(
            DeltaNetDims(hidden=16, key_heads=2, value_heads=4, key_dim=4, value_dim=3, conv_width=3)
        )
    else:
        module = Mamba2Mixer(Mamba2Dims(hidden=16, heads=4, head_dim=3, state=5, groups=2, conv_width=3, chunk=8))
    lengths = [5, 3, 5, 1, 3, 5, 12]
    x = torch.randn(1, sum(lengths), 16)
    _, probe = module(x[:, :1])
    start = LinearState(
        torch.randn(len(lengths), *probe.conv.shape[1:]), torch.randn(len(lengths), *probe.rule.shape[1:])
    )
    with torch.no_grad():
        out, end = module(x, lengths=lengths, state=start)
        at = 0
        for i, n in enumerate(lengths):
            alone, alone_end = module(x[:, at : at + n], state=start.select([i]))
            assert torch.allclose(out[:, at : at + n], alone, atol=1e-5), i
            assert torch.allclose(end.conv[i], alone_end.conv[0], atol=1e-5) and torch.allclose(
                end.rule[i], alone_end.rule[0], atol=1e-5
            )
            at += n
