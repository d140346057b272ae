"""The gated delta rule (models/deltanet.py): the chunked and recurrent forms agree with each other, with
transformers' reference functions (qwen3_next), in values and gradients; a prefill's state carried into token-by-token
decode equals one pass; a packed row never carries state across its sequences; the short convolution likewise."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as ref

from miles_hpc.models.deltanet import (
    causal_conv,
    gated_delta_chunked,
    gated_delta_packed,
    gated_delta_recurrent,
)


def _inputs(
    seed: int, b: int = 2, t: int = 37, n_k: int = 2, n_v: int = 4, dk: int = 8, dv: int = 6
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, n_k, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, t, n_v, dv, generator=gen)
    g = -torch.rand(b, t, n_v, generator=gen) * 2  # log-decay <= 0
    beta = torch.rand(b, t, n_v, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("t,chunk", [(1, 4), (5, 4), (37, 8), (64, 64), (130, 64)])
@pytest.mark.parametrize("heads", [(2, 2), (1, 3), (2, 4)])
def test_chunked_equals_recurrent_and_transformers(t: int, chunk: int, heads: tuple[int, int]) -> None:
    q, k, v, g, beta = _inputs(t * 7 + heads[1], t=t, n_k=heads[0], n_v=heads[1])
    state = torch.randn(2, heads[1], 8, 6, generator=torch.Generator().manual_seed(1))
    o_c, s_c = gated_delta_chunked(q, k, v, g, beta, state, chunk=chunk)
    o_r, s_r = gated_delta_recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(o_c, o_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_c, s_r, rtol=1e-4, atol=1e-5)
    kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = ref.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=chunk, **kw)
    torch.testing.assert_close(o_c, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_c, s_ref, rtol=1e-4, atol=1e-5)
    o_ref, s_ref = ref.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    torch.testing.assert_close(o_r, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_r, s_ref, rtol=1e-4, atol=1e-5)


def test_gradients_of_both_forms_agree() -> None:
    leaves = [x.requires_grad_() for x in _inputs(3, t=21)]  # both forms compute in float32
    weights = torch.randn(2, 21, 4, 6, generator=torch.Generator().manual_seed(4))
    grads = []
    for fn in (lambda *a: gated_delta_chunked(*a, chunk=8), gated_delta_recurrent):
        o, s = fn(*leaves)
        (o * weights).sum().add(s.square().sum()).backward()
        grads.append([x.grad.clone() for x in leaves])
        for x in leaves:
            x.grad = None
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_prefill_state_then_decode_equals_one_pass() -> None:
    q, k, v, g, beta = _inputs(5, t=40)
    whole, _ = gated_delta_chunked(q, k, v, g, beta, chunk=16)
    first, s = gated_delta_chunked(q[:, :29], k[:, :29], v[:, :29], g[:, :29], beta[:, :29], chunk=16)
    steps = []
    for t in range(29, 40):
        o, s = gated_delta_recurrent(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                     beta[:, t : t + 1], s)  # fmt: skip
        steps.append(o)
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), whole, rtol=1e-4, atol=1e-5)


def test_packed_sequences_never_share_state() -> None:
    lengths = [7, 1, 20, 12]
    q, k, v, g, beta = _inputs(9, b=1, t=sum(lengths))
    packed, finals = gated_delta_packed(q, k, v, g, beta, lengths, chunk=8)
    start = 0
    for i, n in enumerate(lengths):
        part = slice(start, start + n)
        alone, s = gated_delta_recurrent(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part])
        torch.testing.assert_close(packed[:, part], alone, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(finals[i : i + 1], s, rtol=1e-4, atol=1e-5)
        start += n
    # The second sequence's outputs do not move when the first one's tokens change.
    q2 = q.clone()
    q2[:, :7] += 1.0
    v2 = v.clone()
    v2[:, :7] -= 1.0
    again, _ = gated_delta_packed(q2, k, v2, g, beta, lengths, chunk=8)
    torch.testing.assert_close(again[:, 7:], packed[:, 7:])
    with pytest.raises(ValueError, match="summing to T"):
        gated_delta_packed(q, k, v, g, beta, [7, 1], chunk=8)


def test_short_convolution_prefill_then_steps_equals_one_pass() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 11, 5, generator=gen)
    w = torch.randn(5, 4, generator=gen)
    whole, _ = causal_conv(x, w)
    expected = ref.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    torch.testing.assert_close(whole, expected)
    first, state = causal_conv(x[:, :6], w)
    outs = [first]
    for t in range(6, 11):
        o, state = causal_conv(x[:, t : t + 1], w, state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), whole)
    assert state.shape == (2, 5, 3)
