"""`sync.wire.checksum.tensor_checksum`: what it covers, that it is pinned (trainer and engine of different versions of
this code must agree), and that a GPU computes the same value as the CPU."""

from __future__ import annotations

import pytest
import torch

from miles_hpc.sync.wire import checksum
from miles_hpc.sync.wire.checksum import CHUNK, tensor_checksum, tensor_checksums


def test_covers_dtype_shape_and_bits() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_checksum(t) == tensor_checksum(t.clone()) == tensor_checksum(t.t().contiguous().t())
    assert tensor_checksum(t) != tensor_checksum(t.reshape(3, 2))
    assert tensor_checksum(t) != tensor_checksum(t.double())
    b = t.to(torch.bfloat16)
    assert tensor_checksum(b) != tensor_checksum(b.view(torch.int16))  # same bits, different dtype name
    flipped = b.clone()
    flipped.view(torch.int16)[0, 1] += 1  # one ulp
    assert tensor_checksum(flipped) != tensor_checksum(b)
    swapped = b.clone().view(-1)
    swapped[[0, 5]] = swapped[[5, 0]]
    assert tensor_checksum(swapped.view(2, 3)) != tensor_checksum(b)
    assert tensor_checksum(torch.tensor([True, False])) != tensor_checksum(torch.tensor([False, True]))
    assert tensor_checksum(torch.zeros(2, dtype=torch.complex64)) != tensor_checksum(torch.zeros(4))


def test_pinned_values() -> None:
    # Changing these changes the contract between trainer and engine: bump both sides together (docs/engine.md).
    assert tensor_checksum(torch.ones(2, 3, dtype=torch.bfloat16)) == "837ad54a737adadebdec0b81055f9a5f"
    assert tensor_checksum(torch.zeros(0)) == "814fa3bda1c18b944ea287229174bcc7"
    # The word 1 alone: lane 0 is splitmix64(0) | 1 = 0xe220a8397b1dcdaf, little-endian.
    assert checksum.fingerprint(torch.tensor([1], dtype=torch.int64)).hex() == "afcd1d7b39a820e2390182a31a5a2cc4"


def test_words_are_little_endian_bytes_padded() -> None:
    # Five bf16 values: bytes 80 3f 00 40 00 00 00 00 | 80 bf + 6 zero bytes -> two words (by hand, not by the code).
    t = torch.tensor([1.0, 2.0, 0.0, 0.0, -1.0], dtype=torch.bfloat16)
    assert checksum.words(t).tolist() == [0x4000_3F80, 0xBF80]
    mask = (1 << 64) - 1

    def mix(x: int) -> int:  # splitmix64, as the module docstring states it
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    lanes = [(0x4000_3F80 * (mix(lane << 32) | 1) + 0xBF80 * (mix(1 + (lane << 32)) | 1)) & mask for lane in (0, 1)]
    assert checksum.fingerprint(t) == b"".join(v.to_bytes(8, "little") for v in lanes)
    assert checksum.words(t[1:]).tolist() == [0xBF80_0000_0000_4000 - (1 << 64)]  # 2 bytes off alignment: a copy
    assert not checksum.is_view(checksum.words(t[1:]), t[1:]) and not checksum.is_view(checksum.words(t), t)
    assert checksum.is_view(checksum.words(t[:4]), t[:4])


def test_every_chunk_counts_and_in_order() -> None:
    n = 2 * CHUNK + 7  # two whole chunks of words and a partial one (int64: one word per element)
    t = torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    base = tensor_checksum(t)
    for i in (0, CHUNK - 1, CHUNK, 2 * CHUNK + 6):
        u = t.clone()
        u[i] += 1
        assert tensor_checksum(u) != base, i
    rolled = torch.cat([t[CHUNK : 2 * CHUNK], t[:CHUNK], t[2 * CHUNK :]])  # two chunks swapped
    assert tensor_checksum(rolled) != base
    b = torch.zeros(11, dtype=torch.bfloat16)
    for i in range(11):  # every byte position of a word, and the padded last word
        u = b.clone()
        u.view(torch.int16)[i] = -(2**15)  # the top bit alone: the weakest change a lane can see
        assert tensor_checksum(u) != tensor_checksum(b), i


def test_many_at_once_equal_one_by_one() -> None:
    g = torch.Generator().manual_seed(2)
    named = [("a", torch.randn(3, 5, generator=g)), ("b", torch.zeros(0)), ("c", torch.randn(9, generator=g).half())]
    assert tensor_checksums(named) == {n: tensor_checksum(t) for n, t in named}
    assert tensor_checksums([]) == {}


def test_a_multipliers_table_cached_at_a_smaller_chunk_is_not_reused(monkeypatch) -> None:
    """The per-device table of multipliers is cached; a process that hashed once with a small `CHUNK` (the
    kernel tests and `self_check` run with one) must still hash with the real one: the table grows, and the
    lanes equal those from a fresh table. (On an H200, `-m gpu` failed 10 tests so: "size of tensor a (262144)
    must match the size of tensor b (16384)".)"""
    g = torch.Generator().manual_seed(4)
    w = torch.randint(-(2**62), 2**62, (3000,), dtype=torch.int64, generator=g)
    monkeypatch.setattr(checksum, "CHUNK", 1024)
    monkeypatch.setattr(checksum, "_tables", {})
    fresh = checksum._torch_lanes(w)
    monkeypatch.setattr(checksum, "_tables", {})
    monkeypatch.setattr(checksum, "CHUNK", 64)
    small = checksum._torch_lanes(w)  # caches a table 64 wide
    monkeypatch.setattr(checksum, "CHUNK", 1024)
    assert torch.equal(checksum._torch_lanes(w), fresh)
    assert not torch.equal(small, fresh)  # (the chunk size is part of the value: the check above is not trivial)
    assert checksum.multipliers(torch.device("cpu"), 1024).shape[1] >= 1024


class DefinitionKernels:
    """Stands in for `checksum_kernels` with the definition itself; subclasses break one thing each."""

    def lanes_into(self, out, rows, srcs, dsts, chunk, powers):  # type: ignore[no-untyped-def]
        for k, (r, s) in enumerate(zip(rows, srcs)):
            if dsts is not None:
                dsts[k].copy_(s)
            out[r] += checksum._torch_lanes(checksum.words(s))
        return True


class OffByOne(DefinitionKernels):
    def lanes_into(self, out, rows, srcs, dsts, chunk, powers):  # type: ignore[no-untyped-def]
        super().lanes_into(out, rows, srcs, dsts, chunk, powers)
        out[list(rows)[0]] += torch.tensor([0, 1])
        return True


class CopiesWrong(DefinitionKernels):
    def lanes_into(self, out, rows, srcs, dsts, chunk, powers):  # type: ignore[no-untyped-def]
        super().lanes_into(out, rows, srcs, dsts, chunk, powers)
        if dsts is not None:
            dsts[0].view(-1)[-1] += 1
        return True


class Raises(DefinitionKernels):
    def lanes_into(self, out, rows, srcs, dsts, chunk, powers):  # type: ignore[no-untyped-def]
        if dsts is not None:
            raise RuntimeError("no kernel image is available for execution on the device")
        return super().lanes_into(out, rows, srcs, dsts, chunk, powers)


class Declines(DefinitionKernels):  # the kernels' own refusal (a tensor they cannot read in place): nothing to compare
    def lanes_into(self, out, rows, srcs, dsts, chunk, powers):  # type: ignore[no-untyped-def]
        return False


@pytest.mark.parametrize(
    "kernels, ok",
    [(DefinitionKernels(), True), (OffByOne(), False), (CopiesWrong(), False), (Raises(), False), (Declines(), True)],
)
def test_self_check_refuses_kernels_that_compute_other_bits(monkeypatch, caplog, kernels, ok: bool) -> None:
    monkeypatch.setattr(checksum, "CHUNK", 64)  # more than two chunks at test speed
    with caplog.at_level("WARNING", logger="miles_hpc.sync.wire.checksum"):
        assert checksum.self_check(kernels, torch.device("cpu")) is ok
    assert ("disagree with the definition on cpu" in caplog.text) is not ok


def test_kernels_are_checked_once_per_device(monkeypatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(checksum, "_kernels", lambda: DefinitionKernels())
    monkeypatch.setattr(checksum, "_checked", {})
    monkeypatch.setattr(checksum, "self_check", lambda k, d: calls.append(d) or d.index == 0)
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert isinstance(checksum._kernels_on(gpu0), DefinitionKernels) and checksum._kernels_on(gpu0) is not None
    assert checksum._kernels_on(gpu1) is None and checksum._kernels_on(gpu1) is None  # failed there: torch path
    assert checksum._kernels_on(torch.device("cpu")) is None
    assert calls == [gpu0, gpu1]


@pytest.mark.gpu
def test_gpu_computes_the_cpu_value() -> None:
    g = torch.Generator().manual_seed(1)
    for t in [
        torch.randn(3, CHUNK // 3 + 11, generator=g).to(torch.bfloat16),
        torch.randn(1000, generator=g),
        torch.randn(3 * CHUNK + 5, generator=g).to(torch.bfloat16),
        torch.randn(CHUNK, generator=g),
        torch.randint(0, 255, (77,), dtype=torch.uint8, generator=g),
        torch.randn(5, dtype=torch.float64),
        torch.zeros(0, 4),
        torch.randn(64, 64, generator=g).half(),
    ]:
        assert tensor_checksum(t.cuda()) == tensor_checksum(t), t.dtype
        if t.dim() == 2:  # a strided view hashes as its contiguous copy on both devices
            assert tensor_checksum(t.cuda().t()) == tensor_checksum(t.t())
    mixed = [
        ("gpu", torch.randn(1000, generator=g).cuda()),
        ("cpu", torch.randn(7, generator=g)),
        ("gpu2", torch.randn(2 * CHUNK + 1, generator=g).bfloat16().cuda()),
    ]
    assert tensor_checksums(mixed) == {n: tensor_checksum(t.cpu()) for n, t in mixed}
