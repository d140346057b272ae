"""`sync.wire.checksum_kernels` (the fingerprint's Triton kernels) against the torch definition, run in Triton's
interpreter on the CPU (CI) and compiled on a GPU (`-m gpu`): many tensors in one launch from one base pointer
(separate allocations, views at odd offsets, empty tensors, several chunks, every word width), and the copy that
hashes what it writes. Run as a script (``python test_checksum_kernels.py``) this file is the interpreter check:
TRITON_INTERPRET must be set before Triton decorates the kernels, so it runs in its own process."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from miles_hpc.sync.wire import checksum

sys.path.insert(0, str(Path(__file__).parent))
from conftest import require, run_interpreted  # noqa: E402

pytestmark = pytest.mark.process

SMALL_CHUNK = 1 << 14  # several chunks at interpreter speed (the kernels take the chunk as a parameter)


def groups(device: str, g: torch.Generator) -> list[list[torch.Tensor]]:
    """Word tensors for one launch each: views of one buffer at 16-byte and 8-byte aligned offsets, separate
    allocations (lower and higher addresses than the first), empties, one word, several chunks and a partial one;
    37 tensors (the block search's depth); words padded from tensors of every element width."""
    buf = torch.randn(6 * SMALL_CHUNK, generator=g).to(torch.bfloat16).to(device)
    buf_words = checksum.words(buf)
    other = checksum.words(torch.randn(2 * SMALL_CHUNK, generator=g).to(device))  # a separate allocation
    aligned = [
        buf_words[2:5002],
        buf_words[6002 : 6002 + 3 * SMALL_CHUNK + 18],
        buf_words[:0],
        other,
        buf_words[-SMALL_CHUNK:],
    ]
    odd = [buf_words[1:4000], buf_words[5001 : 5001 + SMALL_CHUNK], buf_words[-1:]]  # 8 bytes off 16
    many = [buf_words[i * 997 : i * 997 + 13 * i] for i in range(37)]
    padded = [
        checksum.words(t)
        for t in (
            torch.randint(0, 2, (13,), generator=g).bool().to(device),
            torch.randn(SMALL_CHUNK * 4 + 3, generator=g).half().to(device),
            torch.randn(5, generator=g).to(device),
            torch.randn(3, dtype=torch.complex64, generator=g).to(device),
            buf[1:4001],
        )
    ]
    return [aligned, odd, many, padded]


def reference(ws: list[torch.Tensor]) -> torch.Tensor:
    """The definition (checksum's torch path) with the small chunk, computed on the CPU."""
    saved = checksum.CHUNK
    checksum.CHUNK = SMALL_CHUNK
    try:
        return torch.stack([checksum._torch_lanes(w.cpu()) for w in ws])
    finally:
        checksum.CHUNK = saved


def check(device: str) -> None:
    from miles_hpc.sync.wire import checksum_kernels as ck

    powers = checksum.power_table(8, torch.device(device))
    # the default layout, one chunk per step with each position block's chunks split over many programs, and
    # four chunks per step over smaller blocks (partial steps, chunks ending inside a block, every split)
    for layout in (
        {},
        {"ROWS": 1, "MIN_CHUNKS": 1, "PREFETCH": False},
        {"ROWS": 4, "BLOCK": 1024, "MIN_CHUNKS": 1, "PROGRAMS": 1 << 20, "PREFETCH": True},
    ):
        saved_layout = {k: getattr(ck, k) for k in layout}
        for k, v in layout.items():
            setattr(ck, k, v)
        try:
            g = torch.Generator().manual_seed(0)
            for ws in groups(device, g):
                got = ck.lanes_many(ws, SMALL_CHUNK, powers)
                assert got is not None and torch.equal(got.cpu(), reference(ws)), (layout, [w.numel() for w in ws])
                dsts = [torch.full_like(w, 7) for w in ws]
                lanes = ck.copy_lanes_many(ws, dsts, SMALL_CHUNK, powers)
                assert lanes is not None and torch.equal(lanes.cpu(), reference(ws)), layout
                assert all(torch.equal(d, w) for d, w in zip(dsts, ws))
        finally:
            for k, v in saved_layout.items():
                setattr(ck, k, v)
    # `lanes_into`, what the checksum API launches: tensors of any dtype read in place, into any rows of `out`
    g = torch.Generator().manual_seed(1)
    ts = [
        torch.randn(4000, generator=g).to(torch.bfloat16).to(device),
        torch.randn(SMALL_CHUNK + 6, generator=g).to(device),
        torch.randint(0, 2, (64,), generator=g).bool().to(device),
    ]
    want = reference([checksum.words(t) for t in ts])
    for copy in (False, True, False, True):  # (the second time from the kept tables: `launch`'s cache)
        out = torch.zeros(5, 2, dtype=torch.int64, device=device)
        dsts = [torch.empty_like(t) for t in ts] if copy else None
        assert ck.lanes_into(out, [4, 0, 2], ts, dsts, SMALL_CHUNK, powers)
        assert torch.equal(out.cpu()[[4, 0, 2]], want) and not out[[1, 3]].any()
        assert dsts is None or all(torch.equal(checksum.words(d), checksum.words(t)) for d, t in zip(dsts, ts))
    out = torch.zeros(1, 2, dtype=torch.int64, device=device)
    assert not ck.lanes_into(out, [0], [ts[0][1:]], None, SMALL_CHUNK, powers)  # 2 bytes off: not in place
    assert not ck.lanes_into(out, [0], [ts[0][:3]], None, SMALL_CHUNK, powers)  # 6 bytes: not a whole word
    assert not out.any()
    # The check every process makes once per GPU before it trusts the kernels (checksum.self_check), here on
    # this device with the small chunk (the definition reads checksum.CHUNK).
    saved, checksum.CHUNK = checksum.CHUNK, SMALL_CHUNK
    try:
        assert checksum.self_check(ck, torch.device(device))
    finally:
        checksum.CHUNK = saved
    # Views whose offsets are not whole elements of each other share no base pointer: refused, nothing written.
    if device == "cpu":  # (torch keeps its own views element-aligned; a foreign buffer need not be)
        raw = bytearray(64)
        odd = [
            torch.frombuffer(raw, dtype=torch.int64, count=2),
            torch.frombuffer(raw, dtype=torch.int64, count=2, offset=4),
        ]
        assert ck.lanes_many(odd, SMALL_CHUNK, powers) is None
    print("ok")


def test_kernels_in_the_interpreter() -> None:
    run_interpreted(f"import runpy; runpy.run_path({__file__!r}, run_name='__main__')")


@pytest.mark.parametrize("copy", [False, True])
def test_kernels_compile_for_hopper_with_vector_access(copy: bool) -> None:
    """The interpreter does not catch what only the compiler refuses (a non-constexpr global, say): compile for
    sm_90 here, without a GPU, and check that aligned whole blocks move 16 bytes per access."""
    require(importlib.util.find_spec("triton") is not None, "triton (the dev extra)")
    from miles_hpc.sync.wire import checksum_kernels as ck

    ptx = ck.compile_for(90, copy, aligned=True).asm["ptx"]
    assert "ld.global.v2.b64" in ptx and ("st.global.v2.b64" in ptx) == copy
    assert "atom.global.gpu.acq_rel.add.u64" in ptx or "red.global" in ptx
    assert "ld.global.v2.b64" not in ck.compile_for(90, copy, aligned=False).asm["ptx"]


@pytest.mark.gpu
def test_kernels_on_the_gpu() -> None:
    require(torch.cuda.is_available(), "a CUDA device")
    check("cuda")
    # The checksum API on top: many tensors of mixed widths in one call, and the copy that hashes.
    g = torch.Generator().manual_seed(3)
    ts = [
        torch.randn(n, generator=g).to(dt).cuda()
        for n, dt in (
            (5000, torch.bfloat16),
            (33, torch.float32),
            (checksum.CHUNK + 9, torch.bfloat16),
            (0, torch.float16),
            (7, torch.float16),
        )
    ]
    assert torch.equal(
        checksum.lanes_of(ts).cpu(), torch.stack([checksum._torch_lanes(checksum.words(t.cpu())) for t in ts])
    )
    dsts = [torch.empty_like(t) for t in ts]
    lanes = checksum.copy_with_lanes(list(zip(ts, dsts)))  # fused, except the padded tensors (7 and 33 values)
    assert all(torch.equal(d, t) for d, t in zip(dsts, ts))
    assert torch.equal(lanes, checksum.lanes_of(ts))
    strided = torch.zeros(2 * ts[0].numel(), dtype=ts[0].dtype, device="cuda")[::2]  # not fused: torch copies
    lanes = checksum.copy_with_lanes([(ts[0], strided), (ts[2], dsts[2].zero_())])
    assert torch.equal(strided, ts[0]) and torch.equal(dsts[2], ts[2])
    assert torch.equal(lanes, checksum.lanes_of([ts[0], ts[2]]))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    check("cpu")
