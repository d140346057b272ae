"""The BF16 weight-delta codec (sync/codec/delta_codec.py): bit-exact round trips, framing, corruption, and coded size.

Updates are made here in the order-preserving key space with numpy, independently of the codec's own key code.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_hpc.sync.codec.delta_codec import DeltaError, DeltaPayload, decode, encode, from_bytes, to_bytes
from miles_hpc.sync.wire.checksum import tensor_checksum

WIDTH = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}
INT = {16: (np.uint16, torch.int16, np.int16), 32: (np.uint32, torch.int32, np.int32)}


def to_keys(t: torch.Tensor) -> np.ndarray:
    """Order-preserving unsigned keys of the bit patterns (sign-magnitude -> offset binary), as int64."""
    w = WIDTH[t.dtype]
    u = t.contiguous().view(INT[w][1]).numpy().view(INT[w][0]).astype(np.int64).reshape(-1)
    neg = u >> (w - 1) == 1
    return np.where(neg, (~u) & ((1 << w) - 1), u | (1 << (w - 1)))


def from_keys(k: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    w = WIDTH[dtype]
    pos = k >> (w - 1) == 1
    u = np.where(pos, k ^ (1 << (w - 1)), (~k) & ((1 << w) - 1)).astype(INT[w][0])
    return torch.from_numpy(u.view(INT[w][2])).view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT[WIDTH[t.dtype]][1])


def perturb(old: torch.Tensor, density: float, rng: np.random.Generator, big: float = 0.05) -> torch.Tensor:
    """Move a `density` fraction of values by +-1 ulp, a `big` share of those by up to +-300 ulps (in key space)."""
    k = to_keys(old)
    n = k.size
    chosen = rng.random(n) < density if density < 1 else np.ones(n, bool)
    step = rng.choice([-1, 1], n) * np.where(rng.random(n) < big, rng.integers(2, 300, n), 1)
    k2 = np.clip(k + chosen * step, 0, (1 << WIDTH[old.dtype]) - 1)
    k2 = np.where(chosen & (k2 == k), k ^ 1, k2)  # a clipped move still changes the value
    return from_keys(k2, old.dtype, tuple(old.shape))


def weights(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def roundtrip(old: torch.Tensor, new: torch.Tensor) -> DeltaPayload:
    p = encode(old, new)
    assert torch.equal(bits(decode(old, p)), bits(new))
    q = from_bytes(to_bytes(p))
    assert q == p
    assert torch.equal(bits(decode(old, q)), bits(new))
    assert p.checksum == tensor_checksum(new)
    return p


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(0,), (), (1,), (7, 13), (3, 5, 64), (20000,)])
@pytest.mark.parametrize("density", [0.0, 1e-4, 0.02, 0.5, 1.0])
def test_roundtrip_shapes_dtypes_densities(dtype: torch.dtype, shape: tuple[int, ...], density: float) -> None:
    old = weights(shape, dtype, seed=1)
    new = perturb(old, density, np.random.default_rng(2))
    p = roundtrip(old, new)
    if torch.equal(bits(old), bits(new)):
        assert p.kind == "same" and p.data == b""
    if p.kind == "delta":
        assert len(p.data) < p.raw_nbytes


def test_special_values_roundtrip() -> None:
    # NaNs with payloads and both signs, infinities, signed zeros, subnormals, the largest finite values.
    specials = [0x7FC0, 0x7FC1, 0x7F81, 0xFFC3, 0xFF80, 0x7F80, 0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x7F7F, 0xFF7F]
    old = torch.tensor(np.array(specials * 50, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    shuffled = torch.tensor(np.random.default_rng(0).permutation(old.view(torch.int16).numpy()))
    for new in (shuffled.view(torch.bfloat16), perturb(old, 0.3, np.random.default_rng(1))):
        roundtrip(old, new)
    # single flips among neighbours: -0.0 <-> +0.0, inf -> largest finite, NaN -> another NaN payload
    pairs = [(0x8000, 0x0000), (0x0000, 0x8000), (0x7F80, 0x7F7F), (0x7FC0, 0x7FC1), (0x0001, 0x8001)]
    for a, b in pairs:
        o = torch.tensor(np.array([a] * 64, np.uint16).view(np.int16)).view(torch.bfloat16)
        n = o.view(torch.int16).clone()
        n[5] = int(np.array(b, np.uint16).view(np.int16))
        p = roundtrip(o, n.view(torch.bfloat16))
        assert p.kind in ("delta", "full")


def test_large_ulp_jumps_and_sign_crossings() -> None:
    rng = np.random.default_rng(3)
    old = weights((4096,), torch.bfloat16, seed=3)
    k = to_keys(old)
    chosen = rng.random(k.size) < 0.01
    k2 = np.where(chosen, np.clip(k + rng.integers(-40000, 40000, k.size), 0, 0xFFFF), k)
    assert roundtrip(old, from_keys(k2, torch.bfloat16, (4096,))).kind == "delta"
    # every value crosses zero (sign flip): big jumps, dense
    roundtrip(old, -old)


def test_dense_random_update_falls_back_to_full() -> None:
    old, new = weights((64, 64), torch.bfloat16, 4), weights((64, 64), torch.bfloat16, 5)
    p = roundtrip(old, new)
    assert p.kind == "full" and len(p.data) == old.numel() * 2 and p.counts == ()
    f32 = weights((1000,), torch.float32, 6)
    assert roundtrip(f32, weights((1000,), torch.float32, 7)).kind == "full"
    assert roundtrip(f32, f32 + 1e-3).kind == "delta"  # every value moves, ~5e5 ulps: still under 32 bits each


def test_identical_is_same_and_decode_copies() -> None:
    old = weights((128, 3), torch.bfloat16, 7)
    p = roundtrip(old, old.clone())
    assert p.kind == "same" and len(to_bytes(p)) < 64
    out = decode(old, p)
    assert out.data_ptr() != old.data_ptr()


def test_non_contiguous_inputs() -> None:
    old = weights((64, 48), torch.bfloat16, 8)
    new = perturb(old, 0.05, np.random.default_rng(8))
    p = encode(old.t(), new.t())
    assert p.shape == (48, 64)
    assert torch.equal(bits(decode(old.t(), p)), bits(new.t()))


def test_corrupt_payload_is_detected_by_checksum_or_structure() -> None:
    old = weights((8192,), torch.bfloat16, 9)
    new = perturb(old, 0.02, np.random.default_rng(9))
    p = encode(old, new)
    assert p.kind == "delta"
    for i in range(0, len(p.data), max(1, len(p.data) // 40)):
        data = bytearray(p.data)
        data[i] ^= 0x10
        with pytest.raises(DeltaError):
            decode(old, dataclasses.replace(p, data=bytes(data)))
    bad_counts = list(p.counts)
    bad_counts[2] += 1
    with pytest.raises(DeltaError):
        decode(old, dataclasses.replace(p, counts=tuple(bad_counts)))
    full = encode(old, weights((8192,), torch.bfloat16, 10))
    data = bytearray(full.data)
    data[100] ^= 1
    with pytest.raises(DeltaError, match="checksum mismatch"):
        decode(old, dataclasses.replace(full, data=bytes(data)))


def test_wrong_base_shape_or_dtype_raises() -> None:
    old = weights((256,), torch.bfloat16, 11)
    new = perturb(old, 0.02, np.random.default_rng(11))
    p = encode(old, new)
    other = perturb(old, 0.02, np.random.default_rng(12))
    with pytest.raises(DeltaError, match="checksum mismatch"):
        decode(other, p)
    with pytest.raises(DeltaError, match="payload is for bfloat16"):
        decode(old.reshape(16, 16), p)
    with pytest.raises(DeltaError, match="payload is for bfloat16"):
        decode(old.half(), p)
    with pytest.raises(DeltaError):
        encode(old, new.half())
    with pytest.raises(DeltaError, match="unsupported dtype"):
        encode(old.to(torch.int16), new.to(torch.int16))


def test_framing_flips_and_truncations_raise() -> None:
    old = weights((2048,), torch.bfloat16, 13)
    frame = to_bytes(encode(old, perturb(old, 0.02, np.random.default_rng(13))))
    assert frame[:4] == b"MHWD"
    for i in range(len(frame)):
        flipped = bytearray(frame)
        flipped[i] ^= 0x01
        with pytest.raises(DeltaError):
            from_bytes(bytes(flipped))
    for n in (0, 3, 7, 12, len(frame) // 2, len(frame) - 1):
        with pytest.raises(DeltaError, match="truncated|CRC|corrupt|after its body"):
            from_bytes(frame[:n])
    with pytest.raises(DeltaError, match="after its body"):
        from_bytes(frame + b"\0")
    with pytest.raises(DeltaError, match="magic"):
        from_bytes(b"XXXX" + frame[4:])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    density=st.sampled_from([0.0, 1e-3, 0.02, 0.2, 0.7, 1.0]),
    big=st.sampled_from([0.0, 0.05, 0.5]),
)
def test_property_roundtrip(seed: int, dtype: torch.dtype, shape: tuple[int, ...], density: float, big: float) -> None:
    rng = np.random.default_rng(seed)
    old = from_keys(rng.integers(0, 1 << WIDTH[dtype], math.prod(shape)), dtype, shape)  # any bit patterns
    roundtrip(old, perturb(old, density, rng, big=big))


def entropy_bound_bits(old: torch.Tensor, new: torch.Tensor) -> float:
    """Order-0 empirical entropy: N H(K/N) for the change mask + K H(ulp difference | changed)."""
    d = to_keys(new) - to_keys(old)
    n, changed = d.size, d[d != 0]
    k = changed.size
    p = k / n
    mask = n * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    _, cnt = np.unique(changed, return_counts=True)
    return mask + float(-(cnt * np.log2(cnt / k)).sum())


def test_coded_size_is_near_the_entropy_of_a_sparse_one_ulp_update() -> None:
    # 2% of values move by +-1 ulp independently of their magnitude: exponent classes cannot help, so the whole
    # payload (framing included) must be within 3% of the order-0 entropy (~1.01% of the bf16 bytes).
    old = weights((1 << 20,), torch.bfloat16, 14)
    new = perturb(old, 0.02, np.random.default_rng(14), big=0.0)
    bound = entropy_bound_bits(old, new)
    coded = len(to_bytes(roundtrip(old, new))) * 8
    assert coded <= 1.03 * bound, (coded / bound, coded / 8 / old.numel() / 2)


def test_exponent_context_beats_the_order0_bound_on_adam_like_updates() -> None:
    # AdamW moves every weight by ~lr, so small weights (fine ulps) change far more often than large ones.
    old32 = torch.randn(1 << 18, generator=torch.Generator().manual_seed(15)) * 0.02
    step = 1e-6 * torch.randn(old32.shape, generator=torch.Generator().manual_seed(16)).sign()
    old, new = old32.bfloat16(), (old32 + step).bfloat16()
    assert 0.005 < float((bits(old) != bits(new)).float().mean()) < 0.1
    coded = len(to_bytes(roundtrip(old, new))) * 8
    assert coded < 0.9 * entropy_bound_bits(old, new)


def adam_like(n: int, dtype: torch.dtype, seed: int, lr: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """An old tensor of normal weights over many exponents and its AdamW-like update (every weight moves ~lr)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2) * 0.02
    step = lr * torch.randn(n, generator=g).sign() * (1 + 30 * (torch.rand(n, generator=g) < 0.01))
    return w.to(dtype), (w + step).to(dtype)


def check_cuda_matches_cpu(old: torch.Tensor, new: torch.Tensor) -> DeltaPayload:
    """The CUDA codec (Triton class layout where there are several classes) makes the CPU's payload, decodes the
    CPU's payload on the GPU and its own on the CPU, bit for bit."""
    p = encode(old.cuda(), new.cuda())
    assert p == encode(old, new)
    out = decode(old.cuda(), p)
    assert out.is_cuda and torch.equal(bits(out.cpu()), bits(new))
    assert torch.equal(bits(decode(old, p)), bits(new))
    return p


INTERPRETED = """
import dataclasses, os, sys, numpy as np, pytest, torch
sys.path.insert(0, os.path.join(os.environ["MILES_ROOT"], "tests"))
from miles_hpc.sync.codec import delta_kernels as dk
from miles_hpc.sync.codec import delta_codec as dc
from test_delta_codec import adam_like, bits
torch.set_num_threads(1)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for n in (1, 2047, 2049, 100_003):
        old, new = adam_like(n, dtype, seed=n)
        ref = dc.encode(old, new)  # the CPU's sort-based layout
        dc._kernels = lambda t: dk  # the Triton kernels, interpreted, on the same CPU tensors
        got = dc.encode(old, new)
        assert got == ref, (dtype, n)
        assert torch.equal(bits(dc.decode(old, got)), bits(new)), (dtype, n)
        rng = np.random.default_rng(n)
        for _ in range(5 if got.kind == "delta" else 0):
            data = bytearray(got.data)
            data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
            with pytest.raises(dc.DeltaError):
                dc.decode(old, dataclasses.replace(got, data=bytes(data)))
        dc._kernels = lambda t: None
print("ok")
"""


@pytest.mark.process
def test_kernel_layout_in_the_interpreter_matches_cpu() -> None:
    """CI has no GPU: the class-layout kernels (delta_kernels.py) run in Triton's interpreter on CPU tensors and
    must make the CPU path's payloads, decode them, and refuse corrupted ones."""
    from conftest import run_interpreted

    run_interpreted(INTERPRETED)


@pytest.mark.gpu
def test_cuda_roundtrip_matches_cpu() -> None:
    old = weights((4096, 64), torch.bfloat16, 17)
    check_cuda_matches_cpu(old, perturb(old, 0.02, np.random.default_rng(17)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 2047, 2048, 2049, 100_003, 1 << 20])
def test_cuda_class_layout_matches_cpu(dtype: torch.dtype, n: int) -> None:
    # Block edges of the kernels (BLOCK = 2048) and many exponent classes (the AdamW-like update).
    old, new = adam_like(n, dtype, seed=n)
    p = check_cuda_matches_cpu(old, new)
    if n >= 1 << 20 and dtype != torch.float32:
        assert p.kind == "delta" and p.counts[0] > 2  # several classes: the Triton path ran


@pytest.mark.gpu
def test_cuda_special_values_and_corruption() -> None:
    specials = [0x7FC0, 0x7FC1, 0x7F81, 0xFFC3, 0xFF80, 0x7F80, 0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x7F7F, 0xFF7F]
    sp = torch.tensor(np.array(specials * 50, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    old, new = adam_like(1 << 18, torch.bfloat16, seed=3)
    old, new = torch.cat([old, sp]), torch.cat([new, perturb(sp, 0.3, np.random.default_rng(1))])
    p = check_cuda_matches_cpu(old, new)
    assert p.kind == "delta" and p.counts[0] > 2
    rng = np.random.default_rng(5)
    for _ in range(20):  # a flipped body bit: a structural error or a checksum mismatch, never a wrong tensor
        data = bytearray(p.data)
        data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        with pytest.raises(DeltaError):
            decode(old.cuda(), dataclasses.replace(p, data=bytes(data)))


_FORMAT = {torch.bfloat16: (127, 7), torch.float16: (15, 10), torch.float32: (127, 23)}  # exponent bias, mantissa


def pinned_case(n: int, dtype: torch.dtype, step_exp: int, per_mille: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(old, new) for a pinned payload, made with integer arithmetic alone (numpy's PCG64 integers, shifts), so the
    same on every CPU: torch.randn and torch.exp on the CPU are not (their vectorised kernels differ by instruction
    set in the last bits: the pins of session 10, built with them, failed under ATEN_CPU_CAPABILITY=default and on
    some hosts). Old values: random sign and mantissa, exponents spread over ~12 binades around 2^-6; steps of
    about 2^step_exp (times 1..2 and 2^-2..2^2) on `per_mille` of the values, in ulps of each old value, in key
    space (so a step that rounds to no ulp leaves the value, as an optimizer step does)."""
    bias, mant = _FORMAT[dtype]
    w = WIDTH[dtype]
    rng = np.random.default_rng(seed)
    e = bias - 6 + sum(rng.integers(-2, 3, n) for _ in range(3))
    u = (rng.integers(0, 2, n) << (w - 1)) | (e << mant) | rng.integers(0, 1 << mant, n)
    old = torch.from_numpy(u.astype(INT[w][0]).view(INT[w][2])).view(dtype)
    shift = step_exp - (e - bias - mant) + rng.integers(-2, 3, n)  # log2 of (step / ulp), before the 1..2 factor
    r = rng.integers(1 << 16, 1 << 17, n)
    ulps = np.where(shift >= 16, r << np.clip(shift - 16, 0, 40), r >> np.clip(16 - shift, 0, 63))
    moved = rng.integers(0, 1000, n) < per_mille
    k = to_keys(old)
    k2 = np.clip(k + moved * (rng.integers(0, 2, n) * 2 - 1) * ulps, 0, (1 << w) - 1)
    return old, from_keys(k2, dtype, (n,))


PINNED = [  # (values, dtype, step exponent, per mille stepped, seed, sha256[:16] of the body)
    (200_000, torch.bfloat16, -20, 1000, 1, "5300399666b6f2e3"),
    (300_000, torch.bfloat16, -17, 1000, 2, "0b9222624f48032d"),
    (50_000, torch.float16, -10, 1000, 3, "e6e796fb4da8ad90"),
    (100_000, torch.float32, -20, 1000, 4, "8d122923a2c3cbe6"),
    (5000, torch.bfloat16, -7, 1000, 5, "62c4eb1ae62f0cc3"),  # most of some classes changed: inverted sets, escapes
    (100_000, torch.bfloat16, -12, 500, 6, "f13fc80c19c89d14"),
]


def test_payloads_are_pinned() -> None:
    """The encoder's choices (classes, Rice parameters, set inversions, escapes) are deterministic: integer
    arithmetic, and float estimates from correctly rounded operations alone (delta_codec._log2, not np.log2), so
    its bit streams are pinned: a change that alters them is a format decision, not a refactor. (Version 3 added
    the escape counts to the counts, five per class and section: the bits did not change. These pins replaced
    session 10's, whose inputs came from torch's CPU float kernels; the encoder that made these gave the old
    pins' bits on the old inputs, on the AVX-512 host that made both.)"""
    import hashlib

    for n, dtype, step_exp, per_mille, seed, digest in PINNED:
        old, new = pinned_case(n, dtype, step_exp, per_mille, seed)
        p = encode(old, new)
        assert p.kind == "delta" and torch.equal(bits(decode(old, p)), bits(new))
        assert hashlib.sha256(p.data).hexdigest()[:16] == digest, (n, dtype, seed)
        classes = p.counts[0]
        assert len(p.counts) == classes + 13 * classes  # C and C-1 bounds, then 5 + 5 + 3 per class


@pytest.mark.process
def test_pins_hold_with_torchs_scalar_cpu_kernels() -> None:
    """The pins do not depend on the CPU's vector instructions: the same test with torch's CPU kernels forced to
    their scalar versions (ATEN_CPU_CAPABILITY=default, which moved session 10's pinned inputs)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::test_payloads_are_pinned"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
