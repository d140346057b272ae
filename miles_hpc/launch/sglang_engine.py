"""Real SGLang engines of a run under a scheduler (stage: launch): one rollout task per engine and node.

An engine spans `rollout.engine_nodes` nodes with `rollout.engine_tp` GPUs in all (`engine_tp / engine_nodes` on
each), SGLang's `--nnodes/--node-rank/--dist-init-addr`. Rollout task `rank` serves node `rank % engine_nodes` of
engine `rank // engine_nodes` (`engine_task`). Node 0 of an engine picks the address of its torch.distributed
rendezvous, publishes it in ``RUN/rendezvous/engine-<i>.dist.json`` with an attempt number, starts SGLang with the
HTTP front and, once it answers ``/health``, writes the engine's record; the other nodes wait for that file and
start SGLang with their node rank (they serve no HTTP). A restart of node 0 publishes a new attempt, and the other
nodes restart theirs onto it (`dist_attempt`), so an engine always comes back whole.

`sglang_spec` is the one place a run's config becomes SGLang flags (pinned by golden tests, and every flag checked
against SGLang's own server-args definitions in the SGLang schema tier): `--tp-size`, `--ep-size`, the node flags,
`--enable-return-routed-experts` when `algo.routing_replay`, LoRA flags when the sync strategy needs them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from miles_hpc.atomic import write_text_atomic
from miles_hpc.cluster.bootstrap import Placement, device_index, visible_gpus
from miles_hpc.config import RunConfig
from miles_hpc.launch.run_dir import RunPaths
from miles_hpc.rollout.sglang import EngineRecord, SGLangLaunchSpec, write_engine_record

__all__ = ["dist_attempt", "engine_task", "sglang_spec", "start_sglang"]


def engine_task(rank: int, engine_nodes: int) -> tuple[int, int]:
    """(engine index, node rank within the engine) of rollout task `rank`."""
    return rank // engine_nodes, rank % engine_nodes


def sglang_spec(
    cfg: RunConfig,
    model_dir: Path,
    keys: Path,
    index: int,
    *,
    port: int,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    base_gpu_id: int = 0,
) -> SGLangLaunchSpec:
    """The launch of node `node_rank` of engine `index` (a pure function of the config and the placement)."""
    from miles_hpc.sync.factory import strategy_class

    r = cfg.rollout
    needs = strategy_class(cfg).engine_needs(cfg)  # e.g. LoRA sync: SGLang serves adapters only when started for them
    return SGLangLaunchSpec(
        model_path=str(model_dir),
        tp_size=r.engine_tp,
        ep_size=r.engine_ep,
        page_size=r.page_size,
        host="0.0.0.0",
        port=port,
        api_key_file=str(keys / "api_key"),
        admin_api_key_file=str(keys / "admin_api_key"),
        secrets_config_file=str(keys / f"sglang-{index}-{node_rank}.yaml"),
        random_seed=cfg.seed + index,
        weight_version="0",
        python=r.sglang_python,
        base_gpu_id=base_gpu_id,
        nnodes=r.engine_nodes,
        node_rank=node_rank,
        dist_init_addr=dist_init_addr,
        enable_return_routed_experts=cfg.algo.routing_replay,
        enable_lora=needs.lora_rank is not None,
        max_lora_rank=needs.lora_rank,
        lora_target_modules=needs.lora_target_modules,
        extra_args=tuple(r.sglang_args),
    )


def _dist_file(paths: RunPaths, index: int) -> Path:
    return paths.rendezvous / f"engine-{index}.dist.json"


def dist_attempt(paths: RunPaths, index: int) -> tuple[int, str] | None:
    """(attempt, host:port) node 0 of engine `index` published last, or None."""
    try:
        d = json.loads(_dist_file(paths, index).read_text())
        return int(d["attempt"]), str(d["addr"])
    except (OSError, ValueError, KeyError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def start_sglang(
    cfg: RunConfig, paths: RunPaths, model_dir: Path, task_rank: int, place: Placement, *, after: int = -1
) -> tuple[subprocess.Popen[bytes], int]:
    """Start this task's node of its engine (module docstring); returns the process and the attempt it joined.
    `after`: a node > 0 waits for an attempt newer than this one (its previous)."""
    r = cfg.rollout
    index, node_rank = engine_task(task_rank, r.engine_nodes)
    gpus_here = r.engine_tp // r.engine_nodes
    node_gpus = cfg.slurm.gpus_per_node or (place.local_rank + 1) * gpus_here
    base = (
        0
        if place.source == "single"
        else device_index(place.local_rank, gpus_here, visible_gpus(os.environ, node_gpus))
    )
    keys = paths.root / "keys"
    if node_rank:
        deadline = time.monotonic() + r.engine_timeout_s
        while (seen := dist_attempt(paths, index)) is None or seen[0] <= after:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {index} node {node_rank}: node 0 published no rendezvous address")
            time.sleep(1.0)
        attempt, addr = seen
        spec = sglang_spec(
            cfg, model_dir, keys, index, port=_free_port(), node_rank=node_rank, dist_init_addr=addr, base_gpu_id=base
        )
        spec.write_secrets_config()
        return subprocess.Popen(spec.command(), env=spec.environment(os.environ)), attempt
    attempt = (dist_attempt(paths, index) or (-1, ""))[0] + 1
    dist: str | None = None
    if r.engine_nodes > 1:
        dist = f"{socket.gethostname()}:{_free_port()}"
        write_text_atomic(_dist_file(paths, index), json.dumps({"attempt": attempt, "addr": dist}) + "\n")
    port = _free_port()
    spec = sglang_spec(cfg, model_dir, keys, index, port=port, dist_init_addr=dist, base_gpu_id=base)
    spec.write_secrets_config()
    child = subprocess.Popen(spec.command(), env=spec.environment(os.environ))
    _wait_healthy(child, port, f"SGLang engine {index} on {place.node}", r.engine_timeout_s, spec)
    record = EngineRecord(
        index=index,
        host=socket.gethostname(),
        port=port,
        pid=child.pid,
        tp_size=r.engine_tp,
        node=place.node,
        backend="sglang",
    )
    write_engine_record(paths.rendezvous, record)
    return child, attempt


def _wait_healthy(
    child: subprocess.Popen[bytes], port: int, what: str, timeout_s: float, spec: SGLangLaunchSpec
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if child.poll() is not None:
            raise RuntimeError(
                f"{what} exited with code {child.returncode} before it answered /health: {' '.join(spec.command())}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            child.kill()
            raise TimeoutError(f"{what}: no /health after {timeout_s:.0f} s")
        time.sleep(1.0)
