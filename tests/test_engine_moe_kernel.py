"""The engine's fused routed experts (`engine/triton_moe.py`) against `moe.grouped_mix`, the trainer's reference:
the alignment of (token, slot) pairs into expert blocks in torch, the kernels in Triton's interpreter on CPU (CI)
and compiled on a GPU (`-m gpu`), and an engine with them giving the eager engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch

CHECK = """
import torch
import torch.nn.functional as F
from miles_hpc.engine.triton_moe import fused_experts
from miles_hpc.models.moe import grouped_mix


def reference(x, gate_up, down, ids, weights):
    def expert(e, rows):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down[e])

    return grouped_mix(x, ids, weights, gate_up.shape[0], expert)


def check(device, dtypes):
    g = torch.Generator().manual_seed(0)
    # (tokens, hidden, expert width, experts, top-k): widths off the tiles, unused experts, one token, k = 1
    cases = ((5, 96, 40, 8, 2), (33, 64, 80, 16, 4), (1, 128, 64, 4, 4), (70, 48, 24, 32, 1))
    for dtype in dtypes:
        for n, h, i, e, k in cases:
            x = torch.randn(n, h, generator=g).to(device, dtype)
            gate_up = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(device, dtype)
            down = (torch.randn(e, h, i, generator=g) * i**-0.5).to(device, dtype)
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(device)
            ids[: n // 2, 0] = 1  # a crowded expert
            weights = torch.rand(n, k, generator=g).to(device, dtype)
            want = reference(x, gate_up, down, ids, weights)
            for bm in (16, 32):
                got = fused_experts(x, gate_up, down, ids, weights, block_m=bm, block_n=32, block_k=32)
                err = ((got.double() - want.double()).norm() / want.double().norm()).item()
                tol = 1e-6 if dtype == torch.float32 else 1e-2
                assert got.dtype == dtype and got.shape == want.shape and err < tol, (dtype, n, h, i, e, k, bm, err)


if __name__ == "__main__":
    check("cpu", (torch.float32, torch.float16))
    print("ok")
"""


def test_alignment_groups_pairs_by_expert_in_padded_blocks() -> None:
    pytest.importorskip("triton")
    from miles_hpc.engine.triton_moe import align

    g = torch.Generator().manual_seed(1)
    for n, e, k, bm in ((7, 5, 2, 4), (1, 3, 1, 16), (40, 16, 4, 8), (9, 64, 8, 16)):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
        pairs, block_expert = align(ids, e, bm)
        assert pairs.numel() % bm == 0 and pairs.numel() >= n * k + e * (bm - 1)
        assert block_expert.numel() == pairs.numel() // bm
        real = pairs[pairs >= 0]
        assert sorted(real.tolist()) == list(range(n * k))  # every pair once
        flat = ids.reshape(-1)
        for b, ex in enumerate(block_expert.tolist()):
            rows = pairs[b * bm : (b + 1) * bm]
            rows = rows[rows >= 0]
            if ex < 0:
                assert rows.numel() == 0  # past the last group: nothing
            else:
                assert torch.all(flat[rows] == ex)  # a block holds one expert's pairs
        used = [x for x in block_expert.tolist() if x >= 0]
        assert used == sorted(used) and set(used) == set(flat.tolist())  # in expert order, none missing
        for ex in set(flat.tolist()):  # a group takes ceil(count / bm) blocks, and its pairs keep their order
            mine = pairs[(block_expert == ex).repeat_interleave(bm)]
            mine = mine[mine >= 0]
            assert mine.numel() == int((flat == ex).sum()) and torch.all(mine[1:] > mine[:-1])
            assert int((block_expert == ex).sum()) == -(-mine.numel() // bm)


@pytest.mark.process
def test_fused_experts_in_the_interpreter(tmp_path) -> None:  # noqa: ANN001
    from conftest import run_check

    run_check(CHECK, tmp_path)


@pytest.mark.gpu
def test_fused_experts_on_the_gpu(tmp_path) -> None:  # noqa: ANN001
    from conftest import run_check

    run_check(CHECK, tmp_path, "cuda")
