"""sync/wire/store.py: the TCPStore of the trainer world and of the weight-sync groups listens on the address its
peers use, not on every interface; a gloo world and a weight-sync group still form through it, SGLang's join (a
plain torch ``tcp://`` client) included."""

from __future__ import annotations

import datetime
import inspect
import multiprocessing as mp
import socket
import traceback
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from miles_hpc.sync.wire.pg import CustomGroup, GroupSpec
from miles_hpc.sync.wire.store import client_store, is_loopback, listen_socket, master_store, process_group_kwargs

pytestmark = pytest.mark.process
WILDCARDS = {"0.0.0.0", "::"}


def listening(port: int, pid: int | None = None) -> set[str]:
    """The local addresses on which a TCP socket of process ``pid`` (default: this one) listens on ``port``."""
    conns = psutil.Process(pid).net_connections(kind="inet")
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def other_local_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (the store must not answer there), or None."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


def connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_master_store_listens_on_loopback_only() -> None:
    store = master_store("127.0.0.1", 0, 1, 10, wait_for_workers=False)
    port = int(store.port)
    assert listening(port) == {"127.0.0.1"}
    client = client_store("127.0.0.1", port, None, 10)
    client.set("k", "v")
    assert store.get("k") == b"v"
    other = other_local_address()
    if other is not None:  # the same port through another interface of this machine: nothing listens there
        assert not connects(other, port)
    del client, store


def test_the_check_sees_torchs_wildcard_bind() -> None:
    """What the fix is for: torch's own master store (tcp:// rendezvous) listens on every interface."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    port = int(store.port)
    assert listening(port) & WILDCARDS
    other = other_local_address()
    if other is not None:
        assert connects(other, port)
    del store


def test_listen_socket_names_the_host_on_failure() -> None:
    taken = listen_socket("127.0.0.1")
    try:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen_socket("127.0.0.1", port)
        with pytest.raises(OSError, match="cannot resolve the store host"):
            listen_socket("no-such-host.invalid")
    finally:
        taken.close()
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("node01")


def _world_rank(rank: int, port: int, out: str) -> None:
    try:
        kwargs = process_group_kwargs("127.0.0.1", port, rank=rank, world_size=2, timeout_s=60)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60), **kwargs)
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        obj = [f"from {rank}"]
        dist.broadcast_object_list(obj, src=1)
        where = sorted(listening(port)) if rank == 0 else []
        dist.barrier()
        dist.destroy_process_group()
        Path(out).write_text(f"{x.item()} {obj[0]} {','.join(where)}")
    except Exception:
        Path(out).write_text("ERROR\n" + traceback.format_exc())
        raise


def _free_port() -> int:
    from miles_hpc.launch.local import free_port as pick

    return pick()  # below the ephemeral range: no other process's connection takes it first


def test_a_two_rank_gloo_world_forms_through_it(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    port = _free_port()
    outs = [tmp_path / f"r{r}.txt" for r in (0, 1)]
    procs = [ctx.Process(target=_world_rank, args=(r, port, str(outs[r]))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()  # our own child, by handle
    said = [o.read_text() if o.exists() else "no output" for o in outs]
    assert said[0] == "3.0 from 1 127.0.0.1", said
    assert said[1] == "3.0 from 1 ", said
    assert [p.exitcode for p in procs] == [0, 0]


def _sglang_style_engine(port: int, out: str) -> None:
    """An engine joining as SGLang's ``init_custom_process_group`` does (torch's tcp:// rendezvous, a client)."""
    try:
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world
        from torch.distributed.distributed_c10d import rendezvous as torch_rendezvous

        timeout = datetime.timedelta(seconds=60)
        store, rank, world_size = next(torch_rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore("weight_update_group", store)
        options = (
            "backend_options"
            if "backend_options" in inspect.signature(_new_process_group_helper).parameters
            else "pg_options"
        )
        pg, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend("gloo"),
            store,
            group_name="weight_update_group",
            timeout=timeout,
            **{options: None},
        )
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        t = torch.zeros(6, dtype=torch.bfloat16)
        dist.broadcast(t, src=0, group=pg)
        Path(out).write_text(str(t.tolist()))
        # Close the group before the interpreter exits: left to shutdown, gloo's teardown once aborted the child
        # (SIGABRT after the right output, seen once in CI).
        dist.destroy_process_group(pg)
    except Exception:
        Path(out).write_text("ERROR\n" + traceback.format_exc())
        raise


def test_an_sglang_style_engine_joins_our_rank0(tmp_path: Path) -> None:
    port = _free_port()
    out = tmp_path / "engine.txt"
    engine = mp.get_context("spawn").Process(target=_sglang_style_engine, args=(port, str(out)))
    engine.start()
    try:
        spec = GroupSpec(
            backend="gloo", master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=60
        )
        group = CustomGroup(spec)
        assert listening(port) == {"127.0.0.1"}
        group.broadcast(torch.arange(6, dtype=torch.bfloat16) + 1, src=0)
        engine.join(timeout=60)
        group.destroy()
    finally:
        if engine.is_alive():
            engine.kill()  # our own child, by handle
            engine.join()
    assert out.read_text() == "[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]", out.read_text()
    assert engine.exitcode == 0
