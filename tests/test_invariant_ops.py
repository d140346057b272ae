"""Batch-invariant primitives (models/invariant.py): a row's result is bit-identical whatever batch it is computed
in (alone, among 1..300 rows, at any position), and equals the plain op's up to rounding. The plain torch `mm`
is shown not to be invariant on the same inputs, so the test can fail."""

from __future__ import annotations

import pytest
import torch

from miles_hpc.models import invariant as inv
from miles_hpc.models.layers import RMSNorm

SIZES = (1, 2, 3, 7, 16, 17, 63, 64, 65, 300)


def batches(x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(offset, sub-batch) pairs that contain rows of `x` at varying positions and in varying batch sizes."""
    out = [(0, x[:n]) for n in SIZES if n <= x.shape[0]]
    out += [(k, x[k : k + n]) for k, n in ((5, 20), (37, 1), (100, 3), (250, 50))]
    return out


def assert_invariant(fn, x: torch.Tensor) -> None:  # noqa: ANN001
    ref = fn(x)
    for k, sub in batches(x):
        got = fn(sub)
        assert torch.equal(got, ref[k : k + sub.shape[0]]), (k, sub.shape[0], (got - ref[k : k + len(sub)]).abs().max())
    for i in (0, 1, 99, 299):
        assert torch.equal(fn(x[i : i + 1]), ref[i : i + 1]), i


@pytest.fixture
def rows() -> torch.Tensor:
    return torch.randn(300, 512, generator=torch.Generator().manual_seed(0))


def test_plain_mm_is_not_batch_invariant(rows: torch.Tensor) -> None:
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    full = rows @ w.t()
    assert any(not torch.equal(rows[:n] @ w.t(), full[:n]) for n in (1, 2, 3, 7))  # what the tiles fix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear(rows: torch.Tensor, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(256, 512, generator=g).to(dtype), torch.randn(256, generator=g).to(dtype)
    x = rows.to(dtype)
    assert_invariant(lambda t: inv.linear(t, w, b), x)
    torch.testing.assert_close(inv.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert inv.linear(x[None, :10], w).shape == (1, 10, 256)  # leading dims kept


def test_rms_norm_silu_log_softmax(rows: torch.Tensor) -> None:
    norm = RMSNorm(512, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        assert_invariant(lambda t: inv.rms_norm(t, norm.weight, norm.eps), rows)
        torch.testing.assert_close(inv.rms_norm(rows, norm.weight, norm.eps), norm(rows))
        gate, up = rows[:, :256], rows[:, 256:]
        assert_invariant(lambda t: inv.silu_mul(t[:, :256], t[:, 256:]), rows)
        torch.testing.assert_close(inv.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
        logits = torch.randn(300, 1000, generator=torch.Generator().manual_seed(2))
        assert_invariant(inv.log_softmax, logits)
        torch.testing.assert_close(inv.log_softmax(logits), torch.log_softmax(logits, -1))


def test_gradients_flow_through_tiles() -> None:
    x = torch.randn(37, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    inv.linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.detach().sum(0).expand(37, 64))
    assert w.grad is not None and w.grad.shape == w.shape


def test_gradients_equal_the_plain_ops_gradients() -> None:
    """The backward recomputes the plain op on all rows (no tiles): its gradients are the plain op's, w.r.t. the
    input and the parameters, for every primitive (a wrong recompute, a lost parameter gradient fails here)."""
    g = torch.Generator().manual_seed(3)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_(True)

    def grads(out: torch.Tensor, *ts: torch.Tensor) -> list[torch.Tensor]:
        return list(
            torch.autograd.grad((out * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum(), ts)
        )

    x, w, b, nw = leaf(70, 48), leaf(24, 48), leaf(24), leaf(48)
    for a, c in zip(grads(inv.log_softmax(x), x), grads(torch.log_softmax(x, dim=-1), x)):
        torch.testing.assert_close(a, c)
    gate, up = leaf(70, 32), leaf(70, 32)
    for a, c in zip(grads(inv.silu_mul(gate, up), gate, up), grads(torch.nn.functional.silu(gate) * up, gate, up)):
        torch.testing.assert_close(a, c)
    for a, c in zip(grads(inv.linear(x, w, b), x, w, b), grads(torch.nn.functional.linear(x, w, b), x, w, b)):
        torch.testing.assert_close(a, c)
    ref_norm = RMSNorm(48, 1e-6)
    with torch.no_grad():
        ref_norm.weight.copy_(nw)
    for a, c in zip(grads(inv.rms_norm(x, nw, 1e-6), x, nw), grads(ref_norm(x), x, ref_norm.weight)):
        torch.testing.assert_close(a, c)
    # Attention: GQA (4 query heads on 2), queries at positions 10..29 of 30 keys (a chunk after a prefix).
    q, k, v = leaf(4, 20, 16), leaf(2, 30, 16), leaf(2, 30, 8)
    pos = torch.arange(10, 30)
    mask = torch.arange(30)[None, :] <= pos[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=0.25, enable_gqa=True
    )[0]
    got = inv.attention(q, k, v, pos, 0.25)
    torch.testing.assert_close(got, ref)
    for a, c in zip(grads(got, q, k, v), grads(ref, q, k, v)):
        torch.testing.assert_close(a, c)


def test_row_tile_depends_on_width_only() -> None:
    assert inv.row_tile(64) == 64 and inv.row_tile(512) == 64 and inv.row_tile(1024) == 32
    assert inv.row_tile(150_000) == 1  # a vocabulary row: one row per tile


@pytest.mark.parametrize("hq,hkv,dv", [(4, 2, 16), (2, 2, 8)])
def test_attention_is_the_same_for_decode_prefill_and_whole_sequence(hq: int, hkv: int, dv: int) -> None:
    """One 150-token sequence: the whole sequence at once (the trainer), one query at a time over the keys so far (a
    decode step), and a prefix-cached chunk (queries 90..129 over keys 0..129) give bit-identical rows; and they
    equal SDPA's causal attention up to rounding."""
    g = torch.Generator().manual_seed(3)
    n, d = 150, 16
    q, k, v = (
        torch.randn(hq, n, d, generator=g),
        torch.randn(hkv, n, d, generator=g),
        torch.randn(hkv, n, dv, generator=g),
    )
    pos = torch.arange(n)
    whole = inv.attention(q, k, v, pos, 0.25)
    for p in (0, 1, 63, 64, 65, 149):
        one = inv.attention(q[:, p : p + 1], k[:, : p + 1], v[:, : p + 1], pos[p : p + 1], 0.25)
        assert torch.equal(one, whole[:, p : p + 1]), p
    chunk = inv.attention(q[:, 90:130], k[:, :130], v[:, :130], pos[90:130], 0.25)
    assert torch.equal(chunk, whole[:, 90:130])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0), is_causal=True, scale=0.25
    )
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_primitives_are_batch_invariant_on_gpu(dtype: torch.dtype) -> None:
    """The same checks with cuBLAS and CUDA kernels: the fixed-shape tiles pin the kernel choice there too."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(300, 512, generator=g).to("cuda", dtype)
    w = torch.randn(256, 512, generator=g).to("cuda", dtype)
    assert_invariant(lambda t: inv.linear(t, w), rows)
    assert_invariant(lambda t: inv.rms_norm(t, torch.ones(512, device="cuda", dtype=dtype), 1e-6), rows)
    assert_invariant(lambda t: inv.silu_mul(t[:, :256], t[:, 256:]), rows)
    assert_invariant(inv.log_softmax, torch.randn(300, 1000, generator=g).to("cuda", dtype))
    q, k, v = (torch.randn(h, 150, 16, generator=g).to("cuda", dtype) for h in (4, 2, 2))
    pos = torch.arange(150, device="cuda")
    whole = inv.attention(q, k, v, pos, 0.25)
    for p in (0, 64, 149):
        assert torch.equal(
            inv.attention(q[:, p : p + 1], k[:, : p + 1], v[:, : p + 1], pos[p : p + 1], 0.25), whole[:, p : p + 1]
        ), p


@pytest.mark.parametrize(
    "hq,hkv,needs", [(4, 2, (True, True, True)), (2, 2, (False, True, True)), (4, 1, (True, False, False))]
)
def test_packed_backward_in_one_padded_call_equals_the_per_sequence_one(
    hq: int, hkv: int, needs: tuple[bool, bool, bool]
) -> None:
    """The trainer's packed attention backward (`_padded_grads`: sequences padded into one causal SDPA) gives each
    sequence's gradients as the per-sequence SDPA does, and zero outside the sequences' rows."""
    g = torch.Generator().manual_seed(0)
    lens, d = [5, 1, 17, 9], 8
    spans, o = [], 1  # row 0 belongs to no sequence
    for n in lens:
        spans.append((0, o, o + n, o, o + n))
        o += n
    q, k, v = (torch.randn(h, o + 2, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    up = torch.randn(hq, o + 2, d, generator=g, dtype=torch.float64)
    got = inv._padded_grads(q, k, v, spans, 0.3, up, needs)
    assert [gt is not None for gt in got] == list(needs)
    for _, a, b, c, e in spans:
        want = inv._sdpa_grads(q[:, a:b], k[:, c:e], v[:, c:e], torch.arange(b - a), 0.3, up[:, a:b], needs)
        for gt, w in zip(got, want):
            if w is not None:
                assert gt is not None
                torch.testing.assert_close(gt[:, a:b], w, rtol=1e-10, atol=1e-10)
    for gt in got:
        if gt is not None:
            assert not gt[:, 0].any() and not gt[:, o:].any()
