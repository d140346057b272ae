"""Where a worker process sits: rank, world size, local rank, node, master address and port (stage: cluster;
docs/design.md section 3). Imports nothing of ours.

Sources, in the order :func:`bootstrap` tries them:
- torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): taken as they are;
- Slurm (``SLURM_PROCID`` ...): rank and size of this job step; in a heterogeneous job the step's own het group is
  an argument (Slurm names every group's variables, ``SLURM_*_HET_GROUP_<k>``, but not which one this task is in);
  the master is the first node of that group's node list;
- MPI (an MPI launcher's variables, ``OMPI_COMM_WORLD_RANK`` / ``PMIX_RANK`` / ``PMI_RANK``): mpi4py's rank and size,
  host names allgathered for the local rank and the master;
- nothing: a single process.

Ports are never a fixed well-known number: :func:`port_candidates` derives a sequence from the job id (jobs that
share nodes get different ports) and :func:`master_port` lets rank 0 take the first free one and publish it, with an address of its node that resolves, in the run's rendezvous
directory, where the other ranks read both (a shared file system is the rendezvous; no Ray).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Placement", "bootstrap", "expand_nodelist", "from_slurm", "from_torchrun", "master_port", "port_candidates"]

PORT_LO, PORT_SPAN = 20000, 30000  # derived ports fall in [20000, 50000): above well-known and below ephemeral


@dataclass(frozen=True, slots=True)
class Placement:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: str
    master_addr: str
    master_port: int | None  # None: not known yet (master_port() decides it)
    source: str  # torchrun | slurm | mpi | single
    job_id: str | None = None
    het_group: int | None = None
    attempt: int = 0  # SLURM_RESTART_COUNT: a requeued job keeps its id, so files carry the attempt too

    def env(self) -> dict[str, str]:
        """torchrun-style variables for this placement (what torch.distributed's env:// reads)."""
        if self.master_port is None:
            raise ValueError("master_port is not decided yet: call master_port() first")
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ node lists
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order: ``n[001-003,010],gpu7`` -> n001 n002 n003 n010 gpu7.

    Zero padding follows the range's start (``[08-10]`` -> 08 09 10); several bracket groups in one name expand
    as a product (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2). A malformed list raises ValueError naming it."""
    names: list[str] = []
    for item in _split_top(nodelist.strip(), nodelist):
        names += _expand_one(item, nodelist)
    return names


def _split_top(text: str, whole: str) -> list[str]:
    """Split at commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"node list {whole!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"node list {whole!r}: unbalanced '['")
    out.append(cur)
    if any(not s for s in out):
        raise ValueError(f"node list {whole!r}: empty entry")
    return out


def _expand_one(item: str, whole: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close = item.index("]", open_at)
    head, body, rest = item[:open_at], item[open_at + 1 : close], item[close + 1 :]
    values: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part)
        if m is None:
            raise ValueError(f"node list {whole!r}: bad range {part!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"node list {whole!r}: range {part!r} runs backwards")
        width = len(lo)
        values += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return [head + v + tail for v in values for tail in _expand_one(rest, whole)]


# ------------------------------------------------------------------------------------------------ sources
def from_torchrun(env: Mapping[str, str]) -> Placement:
    world = int(env["WORLD_SIZE"])
    return Placement(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
        node=socket.gethostname(),
        master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]),
        source="torchrun",
    )


def from_slurm(env: Mapping[str, str], het_group: int | None = None) -> Placement:
    """This task's placement in its Slurm job step. ``het_group``: the component this step runs in (heterogeneous
    jobs only; Slurm does not say which). The master is the first node of that component (or of the step)."""

    def need(key: str) -> str:
        if key not in env:
            raise ValueError(f"Slurm variable {key} is not set: is this task running under srun?")
        return env[key]

    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if het_group is not None:
        if "SLURM_HET_SIZE" not in env:
            raise ValueError(f"het_group={het_group} given, but this is not a heterogeneous job (no SLURM_HET_SIZE)")
        if not 0 <= het_group < int(env["SLURM_HET_SIZE"]):
            raise ValueError(f"het_group={het_group}: the job has {env['SLURM_HET_SIZE']} components")
        nodelist = env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{het_group}") or need(f"SLURM_NODELIST_HET_GROUP_{het_group}")
        job = env.get(f"SLURM_JOB_ID_HET_GROUP_{het_group}", job)
    else:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or need("SLURM_NODELIST")
    nodes = expand_nodelist(nodelist)
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    return Placement(
        rank=int(need("SLURM_PROCID")),
        world_size=int(need("SLURM_NTASKS")),
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        local_world_size=_first_int(env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE"), 1),
        node=node,
        master_addr=nodes[0],
        master_port=None,
        source="slurm",
        job_id=job,
        het_group=het_group,
        attempt=int(env.get("SLURM_RESTART_COUNT", "0")),
    )


def _first_int(spec: str | None, default: int) -> int:
    """``2(x3),1`` (SLURM_TASKS_PER_NODE) -> 2: the tasks on the first node (a good local size for the usual
    even layout)."""
    if not spec:
        return default
    m = re.match(r"(\d+)", spec)
    return int(m.group(1)) if m else default


def _from_mpi() -> Placement:
    from mpi4py import MPI  # an MPI launcher started us: initialising MPI is expected

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    local = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return Placement(
        rank=rank,
        world_size=size,
        local_rank=local.index(rank),
        local_world_size=len(local),
        node=hosts[rank],
        master_addr=hosts[0],
        master_port=None,
        source="mpi",
    )


_MPI_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def bootstrap(
    env: Mapping[str, str] | None = None, *, het_group: int | None = None, mpi: Callable[[], Placement] = _from_mpi
) -> Placement:
    """The placement of this process from whichever launcher started it (module docstring)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return from_torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return from_slurm(env, het_group)
    if any(k in env for k in _MPI_VARS):
        return mpi()
    return Placement(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node=socket.gethostname(),
        master_addr="127.0.0.1",
        master_port=None,
        source="single",
    )


# ------------------------------------------------------------------------------------------------ ports
_VISIBLE = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def visible_gpus(env: Mapping[str, str], default: int) -> int:
    """GPUs this task sees: the first of CUDA_/ROCR_/HIP_VISIBLE_DEVICES that is set (what `srun --gpus-per-task
    --gpu-bind` leaves), else `default` (the node's)."""
    for key in _VISIBLE:
        if key in env:
            return len([x for x in env[key].split(",") if x.strip()])
    return default


def device_index(local_rank: int, per_task: int, visible: int) -> int:
    """The first GPU index of a task that drives `per_task` GPUs: 0 when srun bound it to its own (it sees exactly
    that many: `--gpus-per-task` with `--gpu-bind`, as site files ask), else its block of the node's GPUs
    (`local_rank x per_task`). A task whose block lies past the GPUs it sees is an error naming both."""
    if visible == per_task:
        return 0
    first = local_rank * per_task
    if first + per_task > visible:
        raise RuntimeError(
            f"local rank {local_rank} drives GPUs {first}..{first + per_task - 1} of its node, but this task sees "
            f"{visible} (bound to {per_task} per task? then it should see exactly {per_task}: check --gpus-per-task)"
        )
    return first


def port_candidates(job_id: str | int | None, n: int = 16, salt: int = 0) -> list[int]:
    """``n`` distinct ports derived from the job id (and ``salt``, e.g. a component index), spread over
    [20000, 50000). No job id (a local run): derived from the process id instead."""
    key = int(job_id) if job_id is not None and str(job_id).isdigit() else os.getpid()
    start = (key * 7919 + salt * 104729) % PORT_SPAN
    return [PORT_LO + (start + k * 997) % PORT_SPAN for k in range(n)]


def port_is_free(port: int, host: str = "") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def master_port(
    placement: Placement,
    rendezvous_dir: str | os.PathLike[str],
    *,
    name: str = "master",
    timeout_s: float = 300.0,
    is_free: Callable[[int], bool] = port_is_free,
) -> Placement:
    """Decide the master port: rank 0 takes the first free candidate of its job and writes
    ``rendezvous_dir/<name>.json`` (atomically); the other ranks wait for that file. A placement that already has a
    port (torchrun) is returned as it is."""
    if placement.master_port is not None:
        return placement
    path = Path(rendezvous_dir) / f"{name}.json"
    if placement.rank == 0:
        port = next((p for p in port_candidates(placement.job_id, salt=placement.het_group or 0) if is_free(p)), None)
        if port is None:
            raise RuntimeError(f"no free port among the job's candidates {port_candidates(placement.job_id)}")
        addr = reachable_address(placement.master_addr)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(
            json.dumps(
                {
                    "master_addr": addr,
                    "master_port": port,
                    "job_id": placement.job_id,
                    "attempt": placement.attempt,
                    "time": time.time(),
                }
            )
        )
        os.replace(tmp, path)
    else:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = json.loads(path.read_text())
                # Not a previous job's, nor this job's before a requeue (both reuse the run directory).
                if (info.get("job_id"), info.get("attempt")) == (placement.job_id, placement.attempt):
                    port, addr = int(info["master_port"]), str(info["master_addr"])
                    break
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {placement.rank} on {placement.node}: no {path} from rank 0 "
                    f"({placement.master_addr}) after {timeout_s:.0f} s"
                )
            time.sleep(0.1)
    return Placement(**{**placement.as_dict(), "master_port": port, "master_addr": addr})  # type: ignore[arg-type]


def reachable_address(node: str) -> str:
    """``node`` when it resolves (a cluster's node names do), else this host's own address: rank 0 runs on the
    master node, so its host name names the same machine (Slurm test clusters with fake node names, containers)."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except OSError:
        return socket.gethostbyname(socket.gethostname())
