"""sync/wire/pg.py: a gloo group across processes that each already have their OWN default process group.

Topology of the main test (what weight sync looks like): processes T0 and T1 form a 2-rank "trainer" default world;
engines E0 and E1 each initialise a 1-rank default world of their own. The custom group is {T0: rank 0, E0: 1, E1: 2}
(rank_offset 1, as SGLang numbers engine ranks); T1 is not in it. Tensors of several dtypes (bfloat16 and float8 as
well) are broadcast from rank 0, then a send/recv pair and a barrier run, and every default world still works after.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import subprocess
import time
import traceback
from pathlib import Path

import pytest
import torch
from conftest import require

from miles_hpc.sync.wire.pg import CustomGroup, GroupSpec

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free now (launch/local.free_port's picks: below the ephemeral range)."""
    from miles_hpc.launch.local import free_port as pick

    ports: list[int] = []
    while len(ports) < n:
        if (port := pick()) not in ports:
            ports.append(port)
    return ports


def payload(i: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank 0's tensor number ``i``: deterministic, non-trivial, a different shape per dtype."""
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(3 + i, 5, generator=g) * 4
    if dtype == torch.bool:
        return x > 0
    return x.to(dtype)


def _worker(role: str, default_port: int, group_port: int, out: str) -> None:
    import torch.distributed as dist

    try:
        if role.startswith("T"):
            rank = int(role[1])
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=rank, world_size=2)
        else:  # each engine has a world of its own (a different store), as a real engine server would; a
            # store without a port: a port picked here could race the parent's (it did once in CI, EADDRINUSE)
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        lines = []
        if role != "T1":
            rank = {"T0": 0, "E0": 1, "E1": 2}[role]
            spec = GroupSpec(
                backend="gloo",
                master_address="127.0.0.1",
                master_port=group_port,
                rank=rank,
                world_size=3,
                group_name="weight_update_group",
                timeout_s=60,
            )
            group = CustomGroup(spec)
            for i, dtype in enumerate(DTYPES):
                t = payload(i, dtype) if rank == 0 else torch.zeros(3 + i, 5, dtype=dtype)
                group.broadcast(t, src=0)
                ok = torch.equal(t.view(torch.uint8), payload(i, dtype).view(torch.uint8))
                lines.append(f"{dtype} {ok}")
            # a non-contiguous receive buffer is filled in place too
            want = payload(1, torch.float32)  # [4, 5]
            buf = torch.zeros(5, 4).t() if rank else want.t().contiguous().t()
            assert not buf.is_contiguous()
            group.broadcast(buf, src=0)
            lines.append(f"noncontig {torch.equal(buf, want)}")
            if rank == 0:
                group.send(torch.arange(7, dtype=torch.bfloat16), dst=2)
            elif rank == 2:
                got = torch.zeros(7, dtype=torch.bfloat16)
                group.recv(got, src=0)
                lines.append(f"recv {torch.equal(got, torch.arange(7, dtype=torch.bfloat16))}")
            group.barrier()
            group.destroy()
            group.destroy()  # idempotent
        # the process's own default world is untouched by the custom group
        x = torch.ones(1)
        dist.all_reduce(x)
        lines.append(f"default_world {x.item()}")
        dist.destroy_process_group()
        Path(out).write_text("\n".join(lines))
    except Exception:
        Path(out).write_text("ERROR\n" + traceback.format_exc())
        raise


@pytest.mark.process
def test_custom_group_across_separate_default_worlds(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    default_port, group_port = free_ports(2)
    roles = ["T0", "T1", "E0", "E1"]
    outs = {r: tmp_path / f"{r}.txt" for r in roles}
    procs = [ctx.Process(target=_worker, args=(r, default_port, group_port, str(outs[r]))) for r in roles]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    results = {r: outs[r].read_text() if outs[r].exists() else "no output" for r in roles}
    for r in roles:
        assert "ERROR" not in results[r], f"{r}: {results[r]}"
    for r in ("T0", "E0", "E1"):
        lines = results[r].splitlines()
        assert lines[: len(DTYPES)] == [f"{d} True" for d in DTYPES], f"{r}: {results[r]}"
        assert "noncontig True" in lines, f"{r}: {results[r]}"
    assert "recv True" in results["E1"]
    assert "default_world 2.0" in results["T0"] and "default_world 2.0" in results["T1"]
    assert "default_world 1.0" in results["E0"] and "default_world 1.0" in results["E1"]
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_spec_validation() -> None:
    base = dict(backend="gloo", master_address="127.0.0.1", master_port=1234, rank=0, world_size=2)
    GroupSpec(**base)
    GroupSpec(**{**base, "backend": "mpi"})  # an MPIGroup's spec (open_group); CustomGroup refuses it
    with pytest.raises(ValueError, match="open_group"):
        CustomGroup(GroupSpec(**{**base, "backend": "mpi"}))
    for bad, msg in [
        ({"backend": "ucx"}, "backend"),
        ({"rank": 2}, "rank 2"),
        ({"master_port": 0}, "port"),
        ({"group_name": ""}, "group_name"),
        ({"timeout_s": 0}, "timeout_s"),
    ]:
        with pytest.raises(ValueError, match=msg):
            GroupSpec(**{**base, **bad})


def test_join_without_rank0_times_out() -> None:
    # rank 1 with no rank 0 serving the store: fails within the timeout instead of hanging forever
    spec = GroupSpec(
        backend="gloo", master_address="127.0.0.1", master_port=free_port(), rank=1, world_size=2, timeout_s=1
    )
    with pytest.raises(Exception):  # noqa: B017 (torch raises DistStoreError / RuntimeError depending on version)
        CustomGroup(spec)


# ---------------------------------------------------------------------------------------------- SGLang wire check
REPO = Path(__file__).resolve().parents[1]
SGLANG_VENV = Path(os.environ.get("SGLANG_VENV", REPO / ".venv-sglang"))
_SGLANG_SIDE = """
import datetime, sys, torch, torch.distributed as dist
from sglang.srt.utils.common import init_custom_process_group
print("IMPORTED", flush=True)  # importing SGLang takes a minute on a busy 2-core machine: the join starts after it
port, rank = int(sys.argv[1]), int(sys.argv[2])
pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank,
                               group_name="weight_update_group", timeout=datetime.timedelta(seconds=90))
t = torch.arange(6, dtype=torch.bfloat16) + 1 if rank == 0 else torch.zeros(6, dtype=torch.bfloat16)
dist.broadcast(t, src=0, group=pg)
print("SGLANG", t.tolist(), flush=True)
"""


def _read_until(proc: subprocess.Popen[bytes], marker: bytes, timeout_s: float) -> bytes:
    """``proc``'s (unbuffered) stdout up to and with ``marker``; fails with what it printed if it exits or stays
    silent past ``timeout_s``."""
    assert proc.stdout is not None
    fd, seen = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while marker not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:  # EOF (it exited) or the deadline
            break
        seen += chunk
    if marker not in seen:
        raise AssertionError(f"the SGLang side never printed {marker!r}: {seen.decode(errors='replace')[-3000:]}")
    return seen


@pytest.mark.sglang
@pytest.mark.parametrize("sglang_rank", [0, 1])
def test_wire_compatible_with_sglang(sglang_rank: int) -> None:
    """Our group joins one made by SGLang's own ``init_custom_process_group`` (in SGLang's venv, its torch), as
    trainer rank 0 driving an SGLang engine (sglang_rank=1) and as an engine driven by an SGLang-style trainer."""
    python = SGLANG_VENV / "bin" / "python"
    require(python.exists(), f"SGLang venv at {SGLANG_VENV} (make it with scripts/test_sglang.sh --install-only)")
    port = free_port()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    other = subprocess.Popen(
        [str(python), "-c", _SGLANG_SIDE, str(port), str(sglang_rank)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        bufsize=0,
        env=env,
    )
    try:
        head = _read_until(other, b"IMPORTED\n", timeout_s=600)
        group = CustomGroup(
            GroupSpec(
                backend="gloo",
                master_address="127.0.0.1",
                master_port=port,
                rank=1 - sglang_rank,
                world_size=2,
                timeout_s=90,
            )
        )
        t = torch.arange(6, dtype=torch.bfloat16) + 1 if sglang_rank == 1 else torch.zeros(6, dtype=torch.bfloat16)
        group.broadcast(t, src=0)
        rest, _ = other.communicate(timeout=120)
        out = (head + rest).decode(errors="replace")
        group.destroy()
    except Exception as e:  # the join or the broadcast failed: what the other side said is the diagnosis
        other.kill()
        said, _ = other.communicate()
        raise AssertionError(f"{e}\n--- the SGLang side:\n{said.decode(errors='replace')[-3000:]}") from e
    finally:
        if other.poll() is None:
            other.kill()  # our own child, by handle
            other.wait()
    assert other.returncode == 0, out[-3000:]
    assert t.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert "SGLANG [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]" in out
