"""The Mamba-2 mixer (models/mamba2.py) against transformers' Nemotron-H mixer on the same weights, several tiny
shapes: outputs and gradients agree; the chunked and recurrent scans agree; a prefill then token-by-token decode on the
carried state equals one pass; a packed row equals its sequences alone."""

from __future__ import annotations

import pytest
import torch
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from miles_hpc.models.mamba2 import Mamba2Dims, Mamba2Mixer, ssd_chunked, ssd_recurrent

SHAPES = [  # hidden, heads, head dim, state, groups, conv width, chunk
    (32, 4, 8, 16, 2, 4, 16),
    (24, 2, 12, 8, 1, 3, 8),
    (48, 6, 4, 4, 3, 2, 128),
]


def _pair(shape: tuple[int, ...], seed: int) -> tuple[torch.nn.Module, Mamba2Mixer]:
    hidden, heads, p, n, g, w, chunk = shape
    keys = dict(hidden_size=hidden, mamba_num_heads=heads, mamba_head_dim=p, ssm_state_size=n, n_groups=g,
                conv_kernel=w, chunk_size=chunk, num_hidden_layers=1, layer_types=["mamba"],
                num_attention_heads=2, num_key_value_heads=1, time_step_min=0.05)  # fmt: skip
    torch.manual_seed(seed)
    cfg = NemotronHConfig(**keys)
    hf = NemotronHMamba2Mixer(cfg, 0)
    with torch.no_grad():
        for prm in hf.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)
        hf.A_log.copy_(torch.rand_like(hf.A_log).mul(3).sub(1))
        hf.dt_bias.copy_(torch.randn_like(hf.dt_bias) - 2)  # some steps below the floor
    ours = Mamba2Mixer(Mamba2Dims.from_hf(cfg.to_dict()))
    assert sorted(ours.state_dict()) == sorted(hf.state_dict())
    ours.load_state_dict(hf.state_dict())
    return hf, ours


@pytest.mark.parametrize("shape", SHAPES)
def test_mixer_matches_transformers(shape: tuple[int, ...]) -> None:
    hf, ours = _pair(shape, seed=sum(shape))
    x = torch.randn(2, 45, shape[0], generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = hf(xa)
    got, state = ours(xb)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    weights = torch.randn_like(want)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
    hf_params = dict(hf.named_parameters())
    for name, prm in ours.named_parameters():
        torch.testing.assert_close(prm.grad, hf_params[name].grad, rtol=1e-3, atol=1e-5)
    assert state.rule.shape == (2, shape[1], shape[2], shape[3])


@pytest.mark.parametrize("t,chunk", [(1, 4), (9, 4), (33, 16), (16, 16)])
def test_chunked_scan_equals_recurrent(t: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(2, t, 4, 3, generator=gen)
    dt = torch.rand(2, t, 4, generator=gen)
    a = -torch.rand(4, generator=gen) * 3
    b, c = torch.randn(2, t, 2, 5, generator=gen), torch.randn(2, t, 2, 5, generator=gen)
    s0 = torch.randn(2, 4, 3, 5, generator=gen)
    y_c, s_c = ssd_chunked(x, dt, a, b, c, s0, chunk=chunk)
    y_r, s_r = ssd_recurrent(x, dt, a, b, c, s0)
    torch.testing.assert_close(y_c, y_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_c, s_r, rtol=1e-4, atol=1e-5)


def test_prefill_then_decode_and_packing() -> None:
    _, ours = _pair(SHAPES[0], seed=3)
    x = torch.randn(3, 30, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole, final = ours(x)
        out, state = ours(x[:, :21])
        steps = [out]
        for t in range(21, 30):
            o, state = ours(x[:, t : t + 1], state=state)
            steps.append(o)
        torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state.rule, final.rule, rtol=1e-4, atol=1e-5)
        lengths = [30, 4, 17]
        row = torch.cat([x[0], x[1, :4], x[2, :17]])[None]
        packed, states = ours(row, lengths=lengths)
        start = 0
        for i, n in enumerate(lengths):
            alone, s = ours(row[:, start : start + n])
            torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(states.rule[i : i + 1], s.rule, rtol=1e-4, atol=1e-5)
            start += n


def test_heads_must_group() -> None:
    with pytest.raises(ValueError, match="multiple of n_groups"):
        Mamba2Dims(hidden=8, heads=3, head_dim=2, state=4, groups=2, conv_width=4)
