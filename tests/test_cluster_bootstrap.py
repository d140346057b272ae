"""cluster/bootstrap.py: node lists, placements from Slurm (plain and heterogeneous), torchrun, MPI and none, and
the master port that rank 0 picks and publishes for the others."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from miles_hpc.cluster.bootstrap import (
    Placement,
    bootstrap,
    expand_nodelist,
    from_slurm,
    master_port,
    port_candidates,
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("n1", ["n1"]),
        ("n[001-004,010]", ["n001", "n002", "n003", "n004", "n010"]),
        ("gpu[08-10],login1", ["gpu08", "gpu09", "gpu10", "login1"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a[7],b-ib[1-2]", ["a7", "b-ib1", "b-ib2"]),
    ],
)
def test_expand_nodelist(text: str, want: list[str]) -> None:
    assert expand_nodelist(text) == want


@pytest.mark.parametrize("bad", ["n[1-", "n]1[", "n[3-1]", "n[a-b]", "n1,,n2"])
def test_expand_nodelist_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(bad)


# What srun sets in a heterogeneous job's step for component 0 (the trainer), second of two tasks.
HET = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "1",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURMD_NODENAME": "n1",
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n[1]",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "n2",
    "SLURM_JOB_ID_HET_GROUP_0": "4242",
    "SLURM_JOB_ID_HET_GROUP_1": "4243",
    "SLURM_RESTART_COUNT": "1",
}


def test_slurm_het_group_placement() -> None:
    p = from_slurm(HET, het_group=0)
    assert (p.rank, p.world_size, p.local_rank, p.local_world_size) == (1, 2, 1, 2)
    assert (p.node, p.master_addr, p.job_id, p.het_group, p.attempt, p.source) == ("n1", "n1", "4242", 0, 1, "slurm")
    assert from_slurm(HET, het_group=1).master_addr == "n2"  # each component's own first node
    with pytest.raises(ValueError, match="has 2 components"):
        from_slurm(HET, het_group=2)
    plain = {k: v for k, v in HET.items() if "HET" not in k} | {"SLURM_JOB_NODELIST": "c[05-06]"}
    assert from_slurm(plain).master_addr == "c05"
    with pytest.raises(ValueError, match="not a heterogeneous job"):
        from_slurm(plain, het_group=0)
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        from_slurm({"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"})


def test_bootstrap_picks_the_launcher() -> None:
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "29999"}
    p = bootstrap(torchrun | HET)  # torchrun wins: it already decided everything
    assert (p.source, p.rank, p.world_size, p.master_port) == ("torchrun", 3, 4, 29999)
    assert bootstrap(HET, het_group=0).source == "slurm"
    mpi = Placement(
        rank=2,
        world_size=3,
        local_rank=0,
        local_world_size=1,
        node="x",
        master_addr="h",
        master_port=None,
        source="mpi",
    )
    assert bootstrap({"OMPI_COMM_WORLD_RANK": "2"}, mpi=lambda: mpi) is mpi
    single = bootstrap({})
    assert (single.source, single.rank, single.world_size) == ("single", 0, 1)


def test_ports_derive_from_the_job_and_differ_between_jobs() -> None:
    a, b = port_candidates("4242"), port_candidates("4243")
    assert a == port_candidates(4242) and a != b and len(set(a)) == len(a)
    assert all(20000 <= p < 50000 for p in a + b)
    assert port_candidates("4242", salt=1) != a  # the other component of a het job


def test_master_port_rank0_publishes_the_first_free_port(tmp_path: Path) -> None:
    base = from_slurm(HET, het_group=0)
    taken = set(port_candidates("4242", salt=0)[:2])  # the first two candidates are busy on rank 0's node
    got: dict[int, int | None] = {}

    def rank(r: int) -> None:
        p = Placement(**{**base.as_dict(), "rank": r})  # type: ignore[arg-type]
        got[r] = master_port(p, tmp_path, is_free=lambda port: port not in taken, timeout_s=10).master_port

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]  # rank 1 starts waiting first
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] == got[1] == port_candidates("4242")[2]
    assert master_port(base, tmp_path, is_free=lambda port: True).env()["MASTER_PORT"] == str(got[1])
    # A requeued job (same id, next attempt) does not take the previous attempt's file.
    again = Placement(**{**base.as_dict(), "attempt": 2})  # type: ignore[arg-type]
    with pytest.raises(TimeoutError, match="no .*master.json from rank 0"):
        master_port(again, tmp_path, timeout_s=0.3)


def test_device_index_follows_the_binding() -> None:
    """A task bound by srun to its own GPUs (--gpus-per-task, --gpu-bind) sees exactly those: index 0; unbound, it
    takes its block of the node's GPUs; a block past what it sees is named."""
    from miles_hpc.cluster.bootstrap import device_index, visible_gpus

    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}, 8) == 2
    assert visible_gpus({"ROCR_VISIBLE_DEVICES": "3"}, 8) == 1  # ROCm: Slurm binds through ROCR
    assert visible_gpus({}, 8) == 8
    assert [device_index(r, 1, 1) for r in range(4)] == [0, 0, 0, 0]  # bound: each its own GPU
    assert [device_index(r, 1, 8) for r in range(4)] == [0, 1, 2, 3]  # unbound: the node's, by local rank
    assert [device_index(r, 4, 8) for r in range(2)] == [0, 4]  # engines of TP 4 on 8 GPUs
    assert device_index(1, 4, 4) == 0  # bound engine task
    with pytest.raises(RuntimeError, match="local rank 2 drives GPUs 8..11"):
        device_index(2, 4, 8)
