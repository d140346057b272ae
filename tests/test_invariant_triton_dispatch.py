"""Zero-KL mode's kernels setting (`MILES_INVARIANT_KERNELS`, models/invariant.py): with "triton" the invariant ops
run `models/triton_invariant.py`'s one-launch kernels, here in Triton's interpreter on CPU tensors (CI). Checked:
each op's forward is its kernel's bits and close to the torch tiles, its gradient is the torch path's bit for bit
(the same backward: F.linear's GEMMs, or the plain op recomputed), a linear's gradients are F.linear's,
`packed_attention` of a step's sequences (a decode query, a chunk after a cached prefix, a whole sequence)
likewise, a head width the kernel cannot hold falls back to the torch path, and an engine and a trainer in zero-KL
mode run through the kernels end to end. Their log-probs agree only to rounding
here: the interpreter's dots round a row by its place in the tile (tests/test_triton_invariant.py), so bit
equality between the two sides is a GPU check (tests/test_zero_kl_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from miles_hpc.models import invariant

CHECK = """
import os
import sys
import torch

sys.path.insert(0, os.path.join(os.environ["MILES_ROOT"], "tests"))
from miles_hpc.models import invariant, triton_invariant as ti

calls = {}
for name in ("linear", "rms_norm", "log_softmax", "attention"):
    def counted(*a, _f=getattr(ti, name), _n=name, **kw):
        calls[_n] = calls.get(_n, 0) + 1
        return _f(*a, **kw)
    setattr(ti, name, counted)


def setting(value, fn, *args):
    os.environ[invariant.KERNELS_ENV] = value
    try:
        return fn(*args)
    finally:
        os.environ[invariant.KERNELS_ENV] = "torch"


def forward_and_grads(value, fn, inputs, seed=1):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = setting(value, fn, *leaves)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    out.backward(up)
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


def check_op(what, fn, kernel, inputs, tol):
    fast, fast_grads = forward_and_grads("triton", fn, inputs)
    ref, ref_grads = forward_and_grads("torch", fn, inputs)
    before = dict(calls)
    assert torch.equal(fast, kernel(*inputs)), (what, "not the kernel's bits")
    assert calls != before, (what, "the kernel did not run")
    err = ((fast - ref).norm() / ref.norm()).item()
    assert err < tol, (what, err)
    for a, b in zip(fast_grads, ref_grads):
        assert torch.equal(a, b), (what, "gradient")


def check_ops():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(37, 72, generator=g), torch.randn(40, 72, generator=g) / 8, torch.randn(40, generator=g)
    check_op("linear", invariant.linear, ti.linear, (x, w, b), 1e-6)
    check_op("linear without bias", invariant.linear, ti.linear, (x, w), 1e-6)
    h, gamma = torch.randn(11, 1500, generator=g), 1 + 0.1 * torch.randn(1500, generator=g)
    check_op("rms_norm", lambda t, s: invariant.rms_norm(t, s, 1e-6), lambda t, s: ti.rms_norm(t, s, 1e-6), (h, gamma), 1e-6)
    check_op("log_softmax", invariant.log_softmax, ti.log_softmax, (4 * h,), 1e-6)
    # A step's three sequences: one decode query at position 20, a 10-query chunk from position 7, 30 from 0.
    starts, nq, nk = [20, 7, 0], [1, 10, 30], [21, 17, 30]
    cu_q, cu_k = [0, 1, 11, 41], [0, 21, 38, 68]
    hq, hkv = 4, 2
    for d in (16, 12):  # 12: no power of two, the torch path under either setting
        q, k, v = (torch.randn(n, 41 if n == hq else 68, d, generator=g) for n in (hq, hkv, hkv))
        def packed(q, k, v):
            return invariant.packed_attention(q, k, v, starts, cu_q, cu_k, d**-0.5)
        if d == 16:
            def kernel(q, k, v):
                return ti.attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), starts, cu_q, cu_k, d**-0.5).transpose(0, 1)
            check_op("packed_attention", packed, kernel, (q, k, v), 1e-6)
        else:
            assert torch.equal(setting("triton", packed, q, k, v), packed(q, k, v)), "fallback"
        for i in range(3):  # each sequence as `attention` of it alone gives it
            a, z, c, e = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
            pos = torch.arange(starts[i], starts[i] + nq[i])
            alone = invariant.attention(q[:, a:z], k[:, c:e], v[:, c:e], pos, d**-0.5)
            assert torch.equal(packed(q, k, v)[:, a:z], alone), ("torch path", i)
    # The trainer's layout (every sequence from position 0): its backward is one padded SDPA, not one per sequence.
    cu = [0, 30, 41, 68]
    q, k, v = (torch.randn(n, 68, 16, generator=g) for n in (hq, hkv, hkv))
    def whole(q, k, v):
        return invariant.packed_attention(q, k, v, [0, 0, 0], cu, cu, 0.25)
    fast, fast_grads = forward_and_grads("triton", whole, (q, k, v))
    ref, ref_grads = forward_and_grads("torch", whole, (q, k, v))
    assert ((fast - ref).norm() / ref.norm()).item() < 1e-6
    for a, b in zip(fast_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def check_run(tmp):
    from pathlib import Path
    from test_zero_kl import generate, make_ckpt, max_diff, free_port
    from miles_hpc.config import AlgoConfig, TrainConfig
    from miles_hpc.train import dist as tdist
    from miles_hpc.train.fsdp import FSDPTrainer

    ckpt = make_ckpt(Path(tmp) / "m", "qwen3", "tiny")
    os.environ[invariant.KERNELS_ENV] = "triton"
    calls.clear()
    seqs = generate(ckpt, True)
    assert calls.get("linear") and calls.get("attention") and calls.get("log_softmax"), calls
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    tdist.init_trainer_world(tdist.world_from_env(env, device="cpu"))
    trainer = FSDPTrainer(ckpt, TrainConfig(max_tokens_per_microbatch=200), AlgoConfig(), device="cpu", seed=0, zero_kl=True)
    calls.clear()
    diff = max_diff(trainer, seqs)
    assert calls.get("linear") and calls.get("attention") and calls.get("rms_norm"), calls
    assert diff < 1e-4, diff
    tdist.teardown()


if __name__ == "__main__":
    import tempfile

    check_ops()
    with tempfile.TemporaryDirectory() as tmp:
        check_run(tmp)
    print("ok")
"""


@pytest.mark.process
def test_the_triton_setting_runs_the_kernels_in_the_interpreter() -> None:
    from conftest import run_interpreted

    run_interpreted(CHECK, timeout=900)


def test_the_kernels_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(invariant.KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="MILES_INVARIANT_KERNELS='cuda': use 'auto', 'torch' or 'triton'"):
        invariant.linear(torch.zeros(2, 4), torch.zeros(3, 4))


def test_cpu_tensors_keep_the_tiles_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default ("auto") and "triton" choose no Triton kernel for CPU tensors outside the interpreter; under it
    only "triton" does (so an interpreter check picks the kernels only when it asks for them)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(invariant.KERNELS_ENV, raising=False)
    x = torch.zeros(2, 4)
    assert invariant.kernels() == "auto" and invariant._triton(x) is None
    for value in ("auto", "torch", "triton"):
        monkeypatch.setenv(invariant.KERNELS_ENV, value)
        assert invariant._triton(x) is None and not invariant._untiled(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for value, chosen in (("auto", False), ("torch", False), ("triton", True)):
        monkeypatch.setenv(invariant.KERNELS_ENV, value)
        assert (invariant._triton(x) is not None) == chosen, value


def test_auto_is_triton_on_cuda_tensors_where_triton_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeCuda:  # _uses_triton reads only .is_cuda
        is_cuda = True

    monkeypatch.delenv(invariant.KERNELS_ENV, raising=False)
    monkeypatch.setattr(invariant, "_have_triton", lambda: True)
    assert invariant._uses_triton(FakeCuda())  # type: ignore[arg-type]
    monkeypatch.setattr(invariant, "_have_triton", lambda: False)  # a CUDA machine without Triton: the tiles
    assert not invariant._uses_triton(FakeCuda())  # type: ignore[arg-type]
    monkeypatch.setenv(invariant.KERNELS_ENV, "torch")
    monkeypatch.setattr(invariant, "_have_triton", lambda: True)
    assert not invariant._uses_triton(FakeCuda())  # type: ignore[arg-type]


@pytest.mark.parametrize("bias", [False, True])
def test_linear_gradients_are_those_of_f_linear(bias: bool) -> None:
    """`invariant.linear`'s backward (two GEMMs, no recomputed forward) gives F.linear's gradients, for 3-D inputs
    and for whichever inputs ask for one."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 37, 72, generator=g), torch.randn(40, 72, generator=g) / 8, torch.randn(40, generator=g)
    up = torch.randn(2, 37, 40, generator=g)
    for needs in ((True, True, True), (False, True, False), (True, False, True)):
        grads = []
        for fn in (invariant.linear, torch.nn.functional.linear):
            leaves = [t.clone().requires_grad_(n) for t, n in zip((x, w, b), needs)]
            fn(leaves[0], leaves[1], leaves[2] if bias else None).backward(up)
            grads.append([t.grad for t in leaves])
        for got, want, need in zip(*grads, needs):
            if not need or (want is None and not bias):
                assert got is None and want is None
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
