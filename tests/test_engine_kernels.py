"""The engine's Triton kernels added for the decode step's speed against their torch references: the greedy sampler
(`triton_ops.greedy_sample` vs `decode_ops.greedy_sample_reference`) and the skinny GEMM (`triton_gemm.skinny_linear`
vs `F.linear`), in Triton's interpreter on CPU (CI) and compiled on a GPU (`-m gpu`)."""

from __future__ import annotations

import pytest

CHECK = """
import torch
import torch.nn.functional as F
from miles_hpc.engine.decode_ops import greedy_sample_reference
from miles_hpc.engine.triton_gemm import skinny_linear
from miles_hpc.engine.triton_ops import greedy_sample


def check(device, dtypes):
    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for n, v in ((3, 5000), (7, 4099), (1, 10), (2, 151936)):
            x = (torch.randn(n, v, generator=g) * 4).to(dtype)
            x[0, 7] = x[0].max() + 1
            x[0, v - 3] = x[0, 7]  # a tie: the first index wins, as torch's argmax
            if n > 1:
                x[1, : v // 2] = float("-inf")  # banned-looking entries
            x = x.to(device)
            want = torch.empty(n, dtype=torch.int64, device=device), torch.empty(n, device=device)
            got = torch.full((n,), -5, dtype=torch.int64, device=device), torch.full((n,), float("nan"), device=device)
            greedy_sample_reference(x, *want)
            greedy_sample(x, *got)
            assert torch.equal(got[0], want[0]), (got[0], want[0])
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)  # float32 sums of V terms
        for m, k, n, split in ((1, 256, 96, 1), (20, 512, 70, 2), (64, 1024, 130, 4), (3, 768, 64, 3)):
            a = torch.randn(m, k, generator=g).to(device, dtype)
            w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
            out = torch.full((m, n), float("nan"), device=device, dtype=dtype)
            y = skinny_linear(a, w, block_n=32, block_k=128, split_k=split, out=out)
            ref = F.linear(a.double(), w.double())
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert y.dtype == dtype and err < (1e-6 if dtype == torch.float32 else 2e-3), (dtype, m, k, n, err)


if __name__ == "__main__":
    # float16, not bfloat16: the interpreter's bfloat16 dot is not the GPU's (the GPU test runs bfloat16).
    check("cpu", (torch.float32, torch.float16))
    print("ok")
"""


@pytest.mark.process
def test_kernels_in_the_interpreter(tmp_path) -> None:  # noqa: ANN001
    from conftest import run_check

    run_check(CHECK, tmp_path)


@pytest.mark.gpu
def test_kernels_on_the_gpu(tmp_path) -> None:  # noqa: ANN001
    from conftest import run_check

    run_check(CHECK, tmp_path, "cuda")
