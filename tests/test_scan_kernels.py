"""`models.scan_kernels` (Triton kernels of the gated delta rule and of Mamba-2's SSD scan) against their torch
references (deltanet.py, mamba2.py): in Triton's interpreter on the CPU (CI), compiled for Hopper without a GPU, and
on a GPU (`-m gpu`); the dispatchers return the references' own results on the CPU and take the torch path when a
gradient is asked for. Run as a script (``python test_scan_kernels.py``, TRITON_INTERPRET=1) this file is the
interpreter check; ``python test_scan_kernels.py cuda`` runs the GPU check without pytest.

Shapes: a decode step (T = 1) and several tokens; lengths under one chunk, odd, over one chunk and a whole number
of chunks; several sequences and heads, grouped heads (n_v / n_k of 1, 2, 3), head sizes that are no power of two
(the kernels mask their tiles), several column blocks per head; zero and random initial states; bf16 inputs.

Tolerances. float32 results (states always, SSD's outputs always, the delta rule's outputs for float32 inputs):
rtol 1e-4, atol 1e-5, the repository's bar for two float32 evaluations of one computation in different orders
(tests/test_deltanet.py and test_mamba2.py hold chunked against recurrent to it): the kernels sum in other orders
(tl.dot, tl.cumsum, tree reductions) and use their own exp. bf16 outputs (the delta rule's output takes v's dtype):
both sides round float32 values that agree to the bar above once to bf16, which may land one bf16 ulp apart; one
ulp is at most 2^-7 of the value, so rtol 2^-7 (plus the same atol). Inputs in bf16 are exact in float32, so the
states of a bf16 run are held to the float32 bar. On a GPU at the models' sizes (a state of 128 x 128, hundreds of
tokens) the references' own two forms (chunked and recurrent, both float32) differ by more than that bar: the
kernels are held to twice that difference where it is larger (measured per case: `spread`, the other form).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_hpc.models import deltanet, mamba2

sys.path.insert(0, str(Path(__file__).parent))
from conftest import require, run_interpreted  # noqa: E402

F32 = {"rtol": 1e-4, "atol": 1e-5}
BF16_OUT = {"rtol": 2**-7, "atol": 1e-5}

# (B, T, n_k, n_v, d_k, d_v, input dtype, initial state, chunk)
GDN_SMALL = [
    (2, 1, 2, 4, 8, 6, torch.float32, True, 64),  # a decode step
    (3, 1, 1, 3, 16, 40, torch.bfloat16, True, 64),  # decode, bf16, 3 value heads per key head, 3 column blocks
    (2, 19, 2, 2, 8, 6, torch.float32, False, 16),  # odd length over one chunk, no state
    (2, 37, 1, 2, 12, 24, torch.bfloat16, True, 16),  # three chunks, the last partial
    (1, 70, 2, 4, 16, 16, torch.float32, True, 64),  # over one chunk of 64
    (1, 64, 1, 1, 8, 8, torch.float32, True, 64),  # exactly one chunk
]
GDN_LARGE = [  # the GPU adds Qwen3.5's head sizes (d_k = d_v = 128, 2 value heads per key head)
    (4, 1, 4, 8, 128, 128, torch.bfloat16, True, 64),
    (2, 300, 2, 4, 128, 128, torch.bfloat16, True, 64),
    (1, 200, 2, 4, 128, 128, torch.float32, False, 64),
]
# (B, T, heads, head_dim P, groups, state N, input dtype, initial state, chunk)
SSD_SMALL = [
    (2, 1, 4, 3, 2, 5, torch.float32, True, 128),  # a decode step
    (2, 1, 4, 40, 1, 16, torch.bfloat16, True, 128),  # decode, bf16, two row blocks
    (2, 9, 4, 3, 2, 5, torch.float32, False, 16),  # shorter than a chunk, no state
    (2, 33, 4, 3, 2, 5, torch.bfloat16, True, 16),  # three chunks, the last partial
    (1, 130, 2, 20, 1, 24, torch.float32, True, 128),  # the reference's chunk of 128, the kernel's of 64
]
SSD_LARGE = [  # Nemotron-H's sizes: head_dim 64, state 128, 16 heads per group
    (4, 1, 32, 64, 2, 128, torch.bfloat16, True, 128),
    (2, 300, 32, 64, 2, 128, torch.bfloat16, True, 128),
]


def gdn_inputs(shape: tuple[Any, ...], device: str, seed: int) -> tuple[list[torch.Tensor | None], int]:
    bsz, t, n_k, n_v, dk, dv, dtype, with_state, chunk = shape
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(bsz, t, n_k, dk, generator=gen) for _ in range(2))
    v = torch.randn(bsz, t, n_v, dv, generator=gen)
    g = -torch.rand(bsz, t, n_v, generator=gen) * 2  # log-decay <= 0
    beta = torch.rand(bsz, t, n_v, generator=gen)
    state = torch.randn(bsz, n_v, dk, dv, generator=gen) if with_state else None
    ins = [q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), state]
    return [x if x is None else x.to(device) for x in ins], chunk


def ssd_inputs(shape: tuple[Any, ...], device: str, seed: int) -> tuple[list[torch.Tensor | None], int]:
    bsz, t, heads, p, groups, n, dtype, with_state, chunk = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(bsz, t, heads, p, generator=gen)
    dt = torch.rand(bsz, t, heads, generator=gen) + 1e-3  # floored softplus: positive
    a = -torch.rand(heads, generator=gen) * 3
    b, c = (torch.randn(bsz, t, groups, n, generator=gen) for _ in range(2))
    state = torch.randn(bsz, heads, p, n, generator=gen) if with_state else None
    ins = [x.to(dtype), dt, a, b.to(dtype), c.to(dtype), state]
    return [y if y is None else y.to(device) for y in ins], chunk


def assert_same(
    got: tuple[torch.Tensor, torch.Tensor],
    want: tuple[torch.Tensor, torch.Tensor],
    what: str,
    spread: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`got` within the tolerances of the module docstring of `want`; with `spread` (the reference's other form on
    the same inputs), the absolute bar is at least twice the two forms' own largest difference."""
    (o, s), (ro, rs) = got, want
    assert o.shape == ro.shape and o.dtype == ro.dtype and s.dtype == rs.dtype == torch.float32, what
    tol = dict(F32 if ro.dtype == torch.float32 else BF16_OUT)
    s_tol = dict(F32)
    if spread is not None:
        tol["atol"] = max(tol["atol"], 2 * (spread[0].float() - ro.float()).abs().max().item())
        s_tol["atol"] = max(s_tol["atol"], 2 * (spread[1] - rs).abs().max().item())
    torch.testing.assert_close(o.float(), ro.float(), **tol, msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(s, rs, **s_tol, msg=lambda m: f"{what} state: {m}")


def check_gdn(device: str, shapes: list[tuple[Any, ...]], precision: str) -> None:
    from miles_hpc.models import scan_kernels as sk

    for i, shape in enumerate(shapes):
        (q, k, v, g, beta, state), chunk = gdn_inputs(shape, device, seed=i)
        assert q is not None and k is not None and v is not None and g is not None and beta is not None
        want = deltanet.gated_delta_recurrent(q, k, v, g, beta, state)
        other = deltanet.gated_delta_chunked(q, k, v, g, beta, state, chunk) if device == "cuda" else None
        assert_same(sk.gated_delta_recurrent_triton(q, k, v, g, beta, state, block_v=16), want, f"recurrent {shape}",
                    other)  # fmt: skip
        if shape[1] == 1 and state is not None:  # the engine's form: the new state written over the old one
            again = state.clone()
            got = sk.gated_delta_recurrent_triton(q, k, v, g, beta, again, out_state=again)
            assert got[1] is again
            assert_same(got, want, f"recurrent in place {shape}")
        recurrent, want = want, deltanet.gated_delta_chunked(q, k, v, g, beta, state, chunk)
        got = sk.gated_delta_chunked_triton(q, k, v, g, beta, state, min(chunk, sk.MAX_CHUNK), precision=precision)
        assert_same(got, want, f"chunked {shape} {precision}", spread=recurrent if device == "cuda" else None)


def check_ssd(device: str, shapes: list[tuple[Any, ...]], precision: str) -> None:
    from miles_hpc.models import scan_kernels as sk

    for i, shape in enumerate(shapes):
        (x, dt, a, b, c, state), chunk = ssd_inputs(shape, device, seed=100 + i)
        assert x is not None and dt is not None and a is not None and b is not None and c is not None
        want = mamba2.ssd_recurrent(x, dt, a, b, c, state)
        other = mamba2.ssd_chunked(x, dt, a, b, c, state, chunk) if device == "cuda" else None
        assert_same(sk.ssd_recurrent_triton(x, dt, a, b, c, state, block_p=16), want, f"ssd recurrent {shape}", other)
        if shape[1] == 1 and state is not None:
            again = state.clone()
            got = sk.ssd_recurrent_triton(x, dt, a, b, c, again, out_state=again)
            assert got[1] is again
            assert_same(got, want, f"ssd recurrent in place {shape}")
        recurrent, want = want, mamba2.ssd_chunked(x, dt, a, b, c, state, chunk)
        got = sk.ssd_chunked_triton(x, dt, a, b, c, state, min(chunk, sk.MAX_CHUNK), precision=precision)
        assert_same(got, want, f"ssd {shape} {precision}", spread=recurrent if device == "cuda" else None)


def check_strided(device: str) -> None:
    """q, k, v as the layer makes them: views of one [B, T, C] convolution output (row stride C, not contiguous)."""
    from miles_hpc.models import scan_kernels as sk

    gen = torch.Generator().manual_seed(7)
    bsz, t, n_k, n_v, dk, dv = 2, 21, 2, 4, 16, 8
    mixed = torch.randn(bsz, t, 2 * n_k * dk + n_v * dv, generator=gen).to(torch.bfloat16).to(device)
    q, k, v = mixed.split([n_k * dk, n_k * dk, n_v * dv], dim=-1)
    q, k, v = q.view(bsz, t, n_k, dk), k.view(bsz, t, n_k, dk), v.view(bsz, t, n_v, dv)
    g = (-torch.rand(bsz, t, n_v, generator=gen)).to(device)
    beta = torch.rand(bsz, t, n_v, generator=gen).to(device)
    for fn, ref in (
        (sk.gated_delta_recurrent_triton, deltanet.gated_delta_recurrent),
        (lambda *a: sk.gated_delta_chunked_triton(*a, chunk=16), lambda *a: deltanet.gated_delta_chunked(*a, chunk=16)),
    ):
        assert_same(fn(q, k, v, g, beta), ref(q, k, v, g, beta), "strided q, k, v")


def check_models(device: str) -> None:
    """The hybrid layers run the kernels through the dispatchers: a tiny Qwen3-Next and Nemotron-H (float32) score a
    packed row of two sequences without a gradient (the kernels) and with one (the torch forms), and one recurrent
    layer decodes a token on from its prefill's state both ways; logits and outputs agree within 1e-4 and every
    kernel ran. In the interpreter (CPU tensors) the dispatchers' device test is widened to the CPU."""
    from miles_hpc.models import ModelConfig, build_model
    from miles_hpc.models import scan_kernels as sk
    from miles_hpc.models.presets import preset_config

    plain_use = sk.use_triton
    if device == "cpu":
        sk.use_triton = lambda *ts: not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts))
    try:
        with counting_kernels() as ran:
            for arch, mixer_type in (("qwen3_next", "GatedDeltaNet"), ("nemotron_h", "Mamba2Mixer")):
                torch.manual_seed(0)
                model = build_model(ModelConfig.from_hf_dict(preset_config(arch, "tiny")), torch.float32, device)
                ids = torch.randint(0, 200, (1, 40), device=device)
                cu = torch.tensor([0, 17, 40], dtype=torch.int32, device=device)
                with torch.no_grad():
                    got = model(ids, cu_seqlens=cu)
                want = model(ids, cu_seqlens=cu)  # the parameters ask for a gradient: the torch forms
                torch.testing.assert_close(
                    got, want.detach(), rtol=1e-4, atol=1e-4, msg=lambda m: f"{arch} logits: {m}"
                )
                mixer = next(m for m in model.modules() if type(m).__name__ == mixer_type)
                x = torch.randn(2, 21, mixer.dims.hidden, device=device)
                with torch.no_grad():
                    _, state = mixer(x[:, :20])
                    step_got, _ = mixer(x[:, 20:], state=state)
                step_want, _ = mixer(x[:, 20:], state=state)
                torch.testing.assert_close(step_got, step_want.detach(), rtol=1e-4, atol=1e-4,
                                           msg=lambda m: f"{arch} decode step: {m}")  # fmt: skip
    finally:
        sk.use_triton = plain_use
    assert all(ran[n] > 0 for n in KERNELS), dict(ran)


KERNELS = ("gated_delta_recurrent_triton", "gated_delta_chunked_triton", "ssd_recurrent_triton", "ssd_chunked_triton")


@contextmanager
def counting_kernels() -> Iterator[Counter[str]]:
    """Count the calls of each Triton entry point of `scan_kernels` (the dispatchers look them up at call time)."""
    from miles_hpc.models import scan_kernels as sk

    ran: Counter[str] = Counter()
    saved = {n: getattr(sk, n) for n in KERNELS}

    def counted(name: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            ran[name] += 1
            return saved[name](*args, **kwargs)

        return run

    try:
        for n in KERNELS:
            setattr(sk, n, counted(n))
        yield ran
    finally:
        for n, fn in saved.items():
            setattr(sk, n, fn)


def check(device: str, large: bool, precision: str | None = None) -> None:
    """Every kernel on every shape; the chunked kernels' products at ``precision`` (None: the module's default)."""
    from miles_hpc.models import scan_kernels as sk

    check_gdn(device, GDN_SMALL + (GDN_LARGE if large else []), precision or sk.GDN_PRECISION)
    if precision in (None, sk.SSD_PRECISION):  # SSD under tf32x3 is not used (scan_kernels.SSD_PRECISION says why)
        check_ssd(device, SSD_SMALL + (SSD_LARGE if large else []), precision or sk.SSD_PRECISION)
    check_strided(device)
    if precision in (None, sk.GDN_PRECISION):
        check_models(device)
    print("ok")


@pytest.mark.process
def test_kernels_in_the_interpreter() -> None:
    run_interpreted(f"import runpy; runpy.run_path({__file__!r}, run_name='__main__')")


def test_dispatchers_on_cpu_return_the_references_results() -> None:
    from miles_hpc.models import scan_kernels as sk

    (q, k, v, g, beta, state), _ = gdn_inputs(GDN_SMALL[3], "cpu", seed=0)
    for got, want in (
        (sk.gated_delta_recurrent(q, k, v, g, beta, state), deltanet.gated_delta_recurrent(q, k, v, g, beta, state)),
        (sk.gated_delta_chunked(q, k, v, g, beta, state, 16), deltanet.gated_delta_chunked(q, k, v, g, beta, state, 16)),
    ):  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    (x, dt, a, b, c, state), _ = ssd_inputs(SSD_SMALL[3], "cpu", seed=0)
    for got, want in (
        (sk.ssd_recurrent(x, dt, a, b, c, state), mamba2.ssd_recurrent(x, dt, a, b, c, state)),
        (sk.ssd_chunked(x, dt, a, b, c, state), mamba2.ssd_chunked(x, dt, a, b, c, state)),
    ):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not sk.use_triton(x, dt, None)


def test_without_triton_the_module_imports_and_dispatches_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only install (no Triton): the module still imports, and its dispatchers run the references."""
    import importlib.util

    from miles_hpc.models import scan_kernels

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("miles_hpc.models._scan_kernels_bare", scan_kernels.__file__)
    assert spec is not None and spec.loader is not None
    bare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bare)
    assert bare.triton is None
    (q, k, v, g, beta, state), _ = gdn_inputs(GDN_SMALL[0], "cpu", seed=0)
    got, want = (
        bare.gated_delta_recurrent(q, k, v, g, beta, state),
        deltanet.gated_delta_recurrent(q, k, v, g, beta, state),
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_constants_follow_the_references() -> None:
    from miles_hpc.models import scan_kernels as sk

    assert sk.SSD_CHUNK == mamba2.CHUNK
    assert sk.EPS == inspect.signature(deltanet.l2_normalize).parameters["eps"].default
    assert inspect.signature(sk.ssd_chunked).parameters["chunk"].default == mamba2.CHUNK
    assert inspect.signature(sk.gated_delta_chunked).parameters["chunk"].default == deltanet.CHUNK


def _compile_for_hopper(fn: Any, constexprs: dict[str, Any], warps: int) -> Any:
    """``fn`` compiled for sm_90 (Triton's bundled ptxas; no GPU): bf16 activations, float32 everything else."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bf16 = {"Q", "K", "V", "Out", "X", "Bm", "Cm"}
    signature = {}
    for p in fn.params:
        if p.name in constexprs:
            signature[p.name] = "constexpr"
        elif p.name in ("eps", "scale"):
            signature[p.name] = "fp32"
        elif p.name[0].isupper() and p.name not in ("T", "NT"):
            signature[p.name] = "*bf16" if p.name in bf16 else "*fp32"
        else:
            signature[p.name] = "i32"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


@pytest.mark.process  # ptxas runs as a subprocess
def test_kernels_compile_for_hopper() -> None:
    """The interpreter does not catch what only the compiler refuses (a dot side under 16, a non-constexpr
    shape): each kernel compiled for sm_90, at small tiles (compile time), without a GPU."""
    require(importlib.util.find_spec("triton") is not None, "triton (the dev extra)")
    from miles_hpc.models import scan_kernels as sk

    heads = {"HV": 4, "GROUP": 2, "DK": 24, "DV": 20, "BK": 32}
    ssd = {"H": 4, "HPG": 2, "P": 20, "N": 24, "BP": 16, "BN": 32, "HAS_S0": True}
    for fn, constexprs, warps in (
        (sk._gdn_recurrent, {**heads, "BV": 16, "HAS_S0": True}, sk.WARPS),
        (sk._gdn_chunk_prep, {**heads, "BVF": 32, "C": 16, "PREC": sk.GDN_PRECISION}, sk.PREP_WARPS),
        (sk._gdn_chunk_scan, {**heads, "BV": 16, "C": 16, "HAS_S0": True, "PREC": sk.GDN_PRECISION}, sk.WARPS),
        (sk._ssd_recurrent, ssd, sk.WARPS),
        (sk._ssd_chunk_scan, {**ssd, "C": 16, "PREC": sk.SSD_PRECISION}, sk.PREP_WARPS),
    ):
        assert ".entry" in _compile_for_hopper(fn, constexprs, warps).asm["ptx"]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_kernels_on_the_gpu(precision: str) -> None:
    """Compiled, at the GPU's sizes too; the chunked kernels' products in float32 on the FMA units (ieee) and in
    three TF32 tensor-core passes (tf32x3, the delta rule's default; SSD runs ieee only), each held to the float32
    bar (the interpreter computes both as ieee)."""
    require(torch.cuda.is_available(), "a CUDA device")
    check("cuda", large=True, precision=precision)


@pytest.mark.gpu
def test_dispatchers_on_the_gpu() -> None:
    """On CUDA the dispatchers run the kernels (results within the tolerances, not the references' bits) and fall
    back to the references, with their autograd, when an input asks for a gradient."""
    require(torch.cuda.is_available(), "a CUDA device")
    from miles_hpc.models import scan_kernels as sk

    (q, k, v, g, beta, state), _ = gdn_inputs(GDN_LARGE[1], "cuda", seed=5)
    assert sk.use_triton(q, k, v, g, beta, state)
    spread = deltanet.gated_delta_recurrent(q, k, v, g, beta, state)  # the reference's own float32 spread
    assert_same(sk.gated_delta_chunked(q, k, v, g, beta, state), deltanet.gated_delta_chunked(q, k, v, g, beta, state),
                "dispatched chunked", spread)  # fmt: skip
    step = [t[:, :1] for t in (q, k, v, g, beta)]
    assert_same(sk.gated_delta_recurrent(*step, state), deltanet.gated_delta_recurrent(*step, state), "dispatched step")
    (x, dt, a, b, c, s0), _ = ssd_inputs(SSD_LARGE[1], "cuda", seed=6)
    spread = mamba2.ssd_recurrent(x, dt, a, b, c, s0)
    assert_same(sk.ssd_chunked(x, dt, a, b, c, s0), mamba2.ssd_chunked(x, dt, a, b, c, s0), "dispatched ssd", spread)
    step = [t[:, :1] for t in (x, dt)]
    assert_same(sk.ssd_recurrent(step[0], step[1], a, b[:, :1], c[:, :1], s0),
                mamba2.ssd_recurrent(step[0], step[1], a, b[:, :1], c[:, :1], s0), "dispatched ssd step")  # fmt: skip
    leaf = v.float().requires_grad_()
    assert not sk.use_triton(q, k, leaf, g, beta, state)
    o, _ = sk.gated_delta_chunked(q, k, leaf, g, beta, state)
    assert o.grad_fn is not None  # the torch path, differentiable
    with torch.no_grad():
        assert sk.use_triton(q, k, leaf, g, beta, state)


if __name__ == "__main__":
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if device == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"
        torch.set_num_threads(1)
    for precision in ["ieee", "tf32x3"] if device != "cpu" else [None]:
        check(device, large=device != "cpu", precision=precision)
    if device == "cpu":  # ROCm's precision (scan_kernels.gdn_precision): recorded, so compiled for AMD too
        from miles_hpc.models import scan_kernels as sk

        check_gdn(device, GDN_SMALL[:2], sk.GDN_PRECISION_ROCM)
