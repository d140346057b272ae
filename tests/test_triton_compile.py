"""tests/triton_compile.py, the CPU-only compile check of our Triton kernels: a recorded launch compiles for every
target, and what only the compiler refuses (a block size that is not a constexpr, which the interpreter runs) or what
a target cannot hold (shared memory over its limit) is reported as a failure naming the kernel and target."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import require

pytestmark = pytest.mark.process  # the compiler runs ptxas / lld as subprocesses

if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled_dot(x, y, out, n, scale, B: tl.constexpr, K: tl.constexpr):
        r, k = tl.arange(0, B), tl.arange(0, K)
        a = tl.load(x + r[:, None] * K + k[None, :], mask=r[:, None] < n, other=0.0)
        b = tl.load(y + k[:, None] * B + r[None, :])
        tl.store(out + r[:, None] * B + r[None, :], tl.dot(a, b) * scale, mask=r[:, None] < n)

    @triton.jit
    def _runtime_block(x, out, B):  # a block size that is not a constexpr: the interpreter runs it
        r = tl.arange(0, B)
        tl.store(out + r, tl.load(x + r) * 2)


def _records(tmp_path: Path, k: int = 16) -> Path:
    import triton_compile as tc

    x, y, out = torch.zeros(32, k), torch.zeros(k, 32), torch.zeros(32, 32)
    rec = tc.launch_record(_scaled_dot.fn if hasattr(_scaled_dot, "fn") else _scaled_dot, (x, y, out, 30, 0.5),
                           {"B": 32, "K": k, "num_warps": 4})  # fmt: skip
    assert rec["signature"] == {"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32", "scale": "fp32",
                                "B": "constexpr", "K": "constexpr"}  # fmt: skip
    assert rec["constexprs"] == {"B": 32, "K": k} and rec["options"] == {"num_warps": 4}
    path = tmp_path / "launches.jsonl"
    path.write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")  # the same launch twice: compiled once
    return path


def test_a_launch_compiles_for_every_target_and_a_runtime_block_size_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require(importlib.util.find_spec("triton") is not None, "triton (the dev extra)")
    import triton_compile as tc

    assert tc.main([str(_records(tmp_path)), "--jobs", "2"]) == 0
    assert (
        "compiled 1 kernel launches for cuda:90, cuda:80, hip:gfx942, hip:gfx950 (4 builds)" in capsys.readouterr().out
    )
    x = torch.zeros(32)
    rec = tc.launch_record(_runtime_block.fn if hasattr(_runtime_block, "fn") else _runtime_block, (x, x, 32), {})
    (tmp_path / "bad.jsonl").write_text(json.dumps(rec) + "\n")
    assert tc.main([str(tmp_path / "bad.jsonl"), "--jobs", "1", "--targets", "cuda:90,hip:gfx942"]) == 1
    out = capsys.readouterr().out
    for target in ("cuda:90", "hip:gfx942"):
        assert f"FAILED test_triton_compile._runtime_block for {target} {{}}: CompilationError" in out, out


def test_shared_memory_over_the_targets_limit_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    require(importlib.util.find_spec("triton") is not None, "triton (the dev extra)")
    import triton_compile as tc

    rec = json.loads(_records(tmp_path).read_text().splitlines()[0])
    tc.compile_record(rec, "cuda:90")  # within the limit
    monkeypatch.setitem(tc.SHARED_LIMIT, "cuda:90", 0)  # a dot stages its tiles in shared memory
    with pytest.raises(RuntimeError, match="bytes of shared memory; cuda:90 has 0 per block"):
        tc.compile_record(rec, "cuda:90")
