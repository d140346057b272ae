"""Zero-KL's Triton kernels (`models/triton_invariant.py`) in Triton's interpreter on CPU (CI) and compiled on a GPU
(`-m gpu`): each matches its `invariant.py` reference to rounding, and a row's bits do not depend on the rows
computed beside it (alone, in a batch, one query at a time as a decode step, a chunk after a cached prefix)."""

from __future__ import annotations

import pytest
import torch

CHECK = """
import torch
import torch.nn.functional as F
from miles_hpc.models import invariant, triton_invariant as ti


def close(got, want, tol, what):
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    assert got.shape == want.shape and err < tol, (what, tuple(got.shape), tuple(want.shape), err)


def rows_invariant(fn, x, what, shifts):
    # A row's bits whatever the other rows hold and however many there are; with `shifts` (a GPU, where a dot's
    # row does not depend on its place in the tile) also alone or in any slice. Triton's interpreter runs a tile's
    # dot as a numpy matmul, whose vector path may round a row by its place in the block: on CPU rows keep theirs.
    whole = fn(x)
    noise = torch.randn(x.shape[0] + 29, x.shape[1], generator=torch.Generator().manual_seed(1)).to(x)
    for hi in (1, 4, 9):  # fewer rows, each in its place: a decode step's batch against the trainer's
        assert torch.equal(fn(x[:hi]), whole[:hi]), (what, "rows", hi)
    for lo, hi in ((0, 1), (3, 4), (2, 9), (x.shape[0] - 1, x.shape[0])):
        mixed = noise.clone()
        mixed[lo:hi] = x[lo:hi]  # other neighbours, more rows
        assert torch.equal(fn(mixed)[lo:hi], whole[lo:hi]), (what, "neighbours", lo, hi)
        if shifts:
            assert torch.equal(fn(x[lo:hi]), whole[lo:hi]), (what, "alone", lo, hi)


def check(device, dtypes):
    g = torch.Generator().manual_seed(0)
    shifts = device != "cpu"
    for dtype in dtypes:
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        x = torch.randn(37, 72, generator=g).to(device, dtype)
        w = (torch.randn(40, 72, generator=g) * 72**-0.5).to(device, dtype)
        b = torch.randn(40, generator=g).to(device, dtype)
        for bias in (None, b):
            close(ti.linear(x, w, bias), F.linear(x.double(), w.double(), None if bias is None else bias.double()), tol, "linear")
            rows_invariant(lambda t: ti.linear(t, w, bias), x, "linear", shifts)
        h = torch.randn(11, 2500, generator=g).to(device, dtype)  # rows longer than ROW_BLOCK
        gamma = (1 + 0.1 * torch.randn(2500, generator=g)).to(device, dtype)
        close(ti.rms_norm(h, gamma, 1e-6), invariant._rms_norm_rows(h, gamma, 1e-6), tol, "rms_norm")
        rows_invariant(lambda t: ti.rms_norm(t, gamma, 1e-6), h, "rms_norm", shifts)
        logits = (4 * torch.randn(11, 2500, generator=g)).to(device, dtype)
        close(ti.log_softmax(logits), torch.log_softmax(logits.double(), -1), 1e-6, "log_softmax")
        rows_invariant(ti.log_softmax, logits, "log_softmax", shifts)
        # The engine scores float32 logits, the trainer its model's dtype: the same values, the same bits (the
        # compiled kernel's layout, and so tl.sum's order, follows the loads' dtype).
        assert torch.equal(ti.log_softmax(logits.float()), ti.log_softmax(logits)), ("log_softmax", "input dtype")
        # The trainer's token log-probs (its dtype) are the engine's full rows (float32) at the token.
        target = torch.randint(0, 2500, (11,), generator=g).to(device)
        full = ti.log_softmax(logits.float()).gather(1, target[:, None]).squeeze(1)
        assert torch.equal(ti.token_log_softmax(logits, target), full), ("token_log_softmax", dtype)
        check_attention(device, dtype, tol, g, shifts)


def check_attention(device, dtype, tol, g, shifts):
    lens, hq, hkv, d, dv = (37, 70), 4, 2, 16, 32
    seqs = [(torch.randn(n, hq, d, generator=g), torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, dv, generator=g)) for n in lens]
    q, k, v = (torch.cat([s[i] for s in seqs]).to(device, dtype) for i in range(3))
    cu = [0, lens[0], lens[0] + lens[1]]
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    out = ti.attention(q, k, v, [0, 0], cu, cu, d**-0.5)  # the trainer's packed call
    for i, n in enumerate(lens):
        sl = slice(cu[i], cu[i + 1])
        want = invariant.attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), pos[sl], d**-0.5)
        close(out[sl], want.transpose(0, 1), tol, ("attention", i))
    # Sequence 1 as the engine meets it: one decode query at a time over its keys (on CPU those that keep their
    # place in a query tile: see rows_invariant), and a chunk after a cached prefix.
    s0, n = cu[1], lens[1]
    kk, vv = k[s0:], v[s0:]
    for p in (0, 16, 64) + ((15, 63, n - 1) if shifts else ()):
        one = ti.attention(q[s0 + p : s0 + p + 1], kk, vv, [p], [0, 1], [0, n], d**-0.5)
        assert torch.equal(one, out[s0 + p : s0 + p + 1]), ("decode", p)
    for start in (32,) + ((41,) if shifts else ()):
        chunk = ti.attention(q[s0 + start : s0 + n], kk, vv, [start], [0, n - start], [0, n], d**-0.5)
        assert torch.equal(chunk, out[s0 + start : s0 + n]), ("prefill chunk after a cached prefix", start)
    check_paged(q, k, v, out, cu, lens, d**-0.5, g)


def check_paged(q, k, v, out, cu, lens, scale, g):
    # Every query as a decode row over a paged cache (shuffled blocks, other sequences' keys and garbage around
    # them): each row has the packed call's bits, whatever rows share the call, in any order.
    for bs in (4, 16):
        nblocks = sum(-(-n // bs) for n in lens) + 3
        kc = torch.randn(nblocks * bs, *k.shape[1:], generator=g).to(k)
        vc = torch.randn(nblocks * bs, *v.shape[1:], generator=g).to(v)
        perm = torch.randperm(nblocks, generator=g)
        width = max(-(-n // bs) for n in lens)
        tables, used = [], 0
        for i, n in enumerate(lens):
            row = perm[used : used + -(-n // bs)]
            used += row.numel()
            slots = (row[:, None] * bs + torch.arange(bs)).flatten()[:n].to(k.device)
            kc[slots], vc[slots] = k[cu[i] : cu[i + 1]], v[cu[i] : cu[i + 1]]
            tables.append(torch.cat([row, torch.full((width - row.numel(),), nblocks - 1)]))
        tables = torch.stack(tables).to(torch.int32).to(k.device)
        seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
        pos = torch.cat([torch.arange(n) for n in lens])
        order = torch.randperm(seq.numel(), generator=g)
        for rows in (order, order[:5], order[7:8]):
            got = ti.paged_attention(q[rows], kc, vc, tables[seq[rows]], pos[rows].to(k.device), bs, scale)
            assert torch.equal(got, out[rows]), ("paged decode rows", bs, rows.numel())


if __name__ == "__main__":
    check("cpu", (torch.float32, torch.float16))
    print("ok")
"""


@pytest.mark.process
def test_invariant_kernels_in_the_interpreter(tmp_path) -> None:  # noqa: ANN001
    from conftest import run_check

    run_check(CHECK, tmp_path)


@pytest.mark.gpu
def test_invariant_kernels_on_the_gpu(tmp_path) -> None:  # noqa: ANN001
    from conftest import run_check

    run_check(CHECK, tmp_path, "cuda")


def test_attention_refuses_what_its_blocks_cannot_hold() -> None:
    import importlib.util

    from conftest import require

    require(importlib.util.find_spec("triton") is not None, "triton (the dev extra)")
    from miles_hpc.models import triton_invariant as ti

    q, k = torch.zeros(3, 4, 12), torch.zeros(5, 2, 12)
    with pytest.raises(ValueError, match="powers of two"):
        ti.attention(q, k, k, [0], [0, 3], [0, 5], 1.0)
    q, k = torch.zeros(3, 4, 16), torch.zeros(2, 2, 16)
    with pytest.raises(ValueError, match="position 2 needs keys up to it; 2 given"):
        ti.attention(q, k, k, [0], [0, 3], [0, 2], 1.0)
