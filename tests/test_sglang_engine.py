"""SGLang engines under a scheduler (launch/sglang_engine.py): the config -> flags function, golden for the
flagship's layout, and the node-0 rendezvous of engines that span nodes. (That every flag exists in SGLang's own
argparse is checked by tests/sglang_schema_check.py in SGLang's venv.)"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from miles_hpc.cluster.bootstrap import Placement
from miles_hpc.config import load_config
from miles_hpc.launch.run_dir import RunPaths
from miles_hpc.launch.sglang_engine import dist_attempt, engine_task, sglang_spec, start_sglang

REPO = Path(__file__).resolve().parents[1]
FLAGSHIP = REPO / "configs/experiments/glm52_64gpu.yaml"


def test_tasks_map_to_engines_and_nodes() -> None:
    assert [engine_task(r, 1) for r in range(3)] == [(0, 0), (1, 0), (2, 0)]
    assert [engine_task(r, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_flagship_engine_command_is_golden() -> None:
    """The flagship's engine 2 (TP 8 on one node), R3 on as configured: --tp-size 8 and
    --enable-return-routed-experts."""
    cfg = load_config(FLAGSHIP, ["rollout.sglang_python=/sgl/bin/python"])
    spec = sglang_spec(cfg, Path("/lustre/models/GLM-5.2"), Path("/run/keys"), 2, port=31000)
    assert spec.command() == [
        "/sgl/bin/python", "-m", "sglang.launch_server", "--model-path", "/lustre/models/GLM-5.2",
        "--host", "0.0.0.0", "--port", "31000",
        "--tp-size", "8", "--dp-size", "1", "--ep-size", "1",
        "--enable-return-routed-experts",
        "--enable-metrics", "--random-seed", "2", "--weight-version", "0",
        "--config", "/run/keys/sglang-2-0.yaml",
    ]  # fmt: skip


def test_engine_across_two_nodes_with_expert_parallelism() -> None:
    """TP 16 over 2 nodes (8 GPUs each), EP 8: node 1 names node 0's rendezvous, its own GPUs from base 0."""
    over = ["rollout.engine_tp=16", "rollout.engine_nodes=2", "rollout.engine_ep=8", "rollout.num_engines=2"]
    cfg = load_config(FLAGSHIP, over)
    spec = sglang_spec(cfg, Path("/m"), Path("/k"), 1, port=30001, node_rank=1, dist_init_addr="gpu07:5123")
    cmd = spec.command()
    assert cmd[cmd.index("--tp-size") : cmd.index("--ep-size") + 2] == [
        "--tp-size",
        "16",
        "--dp-size",
        "1",
        "--ep-size",
        "8",
    ]
    i = cmd.index("--nnodes")
    assert cmd[i : i + 6] == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "gpu07:5123"]
    assert "--enable-return-routed-experts" in cmd  # R3 on in the flagship
    assert "--enable-return-routed-experts" not in sglang_spec(
        load_config(FLAGSHIP, [*over, "algo.routing_replay=false"]), Path("/m"), Path("/k"), 1, port=30001,
        node_rank=1, dist_init_addr="gpu07:5123",
    ).command()  # fmt: skip


def test_bad_engine_layouts_are_refused_by_key() -> None:
    from miles_hpc.config import ConfigError

    for over, key in (
        (["rollout.engine_tp=8", "rollout.engine_nodes=3"], "rollout.engine_nodes"),
        (["rollout.engine_tp=8", "rollout.engine_ep=3"], "rollout.engine_ep"),
        (["rollout.engine_tp=0"], "rollout.engine_tp"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config(FLAGSHIP, over)
    tiny = REPO / "configs/tiny_cpu.yaml"
    with pytest.raises(ConfigError, match="rollout.engine_nodes: embedded engines run on one node"):
        load_config(tiny, ["rollout.engine_tp=2", "rollout.engine_nodes=2"])
    with pytest.raises(ConfigError, match="rollout.engine_ep: embedded engines have no expert parallelism"):
        load_config(tiny, ["rollout.engine_tp=2", "rollout.engine_ep=2"])


@pytest.mark.process
def test_a_second_node_waits_for_node_zeros_address_and_joins_it(tmp_path: Path) -> None:
    """Node 1 of engine 0 waits for engine-0.dist.json, starts SGLang with --node-rank 1 and that address, and
    after a restart of node 0 (a newer attempt) joins the new one."""
    run_dir = tmp_path / "run"
    argv_log = tmp_path / "argv.json"
    fake = tmp_path / "sglang-python"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv, open({str(argv_log)!r}, 'w'))\n")
    fake.chmod(0o755)
    over = [f"run_dir={run_dir}", "rollout.engine_tp=16", "rollout.engine_nodes=2", f"rollout.sglang_python={fake}"]
    cfg = load_config(FLAGSHIP, over)
    paths = RunPaths(run_dir)
    (run_dir / "keys").mkdir(parents=True)
    paths.rendezvous.mkdir(parents=True)
    for name in ("api_key", "admin_api_key"):
        (run_dir / "keys" / name).write_text("k\n")
    place = Placement(
        rank=1, world_size=8, local_rank=0, local_world_size=1, node="gpu08", master_addr="gpu07", master_port=None,
        source="slurm",
    )  # fmt: skip
    dist = paths.rendezvous / "engine-0.dist.json"

    def publish(attempt: int, addr: str) -> None:
        time.sleep(0.3)
        dist.write_text(json.dumps({"attempt": attempt, "addr": addr}))

    for attempt, addr, after in ((0, "gpu07:5000", -1), (1, "gpu07:5001", 0)):
        t = threading.Thread(target=publish, args=(attempt, addr))
        t.start()
        child, got = start_sglang(cfg, paths, Path("/m"), 1, place, after=after)
        t.join()
        assert child.wait(30) == 0 and got == attempt and dist_attempt(paths, 0) == (attempt, addr)
        cmd = json.loads(argv_log.read_text())
        i = cmd.index("--nnodes")
        assert cmd[i : i + 6] == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr]
        assert "--base-gpu-id" not in cmd  # its node's GPUs from 0 (8 per node)
