"""SGLang launcher command lines (golden lists) and the engine rendezvous files (write/read/wait), CPU tier.

That each flag exists in SGLang's own argparse is checked by tests/sglang_schema_check.py in SGLang's venv.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from miles_hpc.rollout.sglang import (
    EngineRecord,
    EngineRendezvousTimeout,
    SGLangLaunchSpec,
    mark_engine_starting,
    read_engine_record,
    read_engine_records,
    wait_for_engines,
    write_engine_record,
)


def test_minimal_command_is_golden() -> None:
    assert SGLangLaunchSpec(model_path="/models/q").command() == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/q",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--tp-size",
        "1",
        "--dp-size",
        "1",
        "--ep-size",
        "1",
        "--enable-metrics",
    ]


def test_full_command_is_golden_and_keys_stay_off_it(tmp_path: Path) -> None:
    (tmp_path / "api_key").write_text("plain-secret\n")
    (tmp_path / "admin_api_key").write_text("admin-secret\n")
    spec = SGLangLaunchSpec(
        model_path="/m",
        tp_size=8,
        dp_size=2,
        ep_size=8,
        host="0.0.0.0",
        port=31001,
        api_key_file=str(tmp_path / "api_key"),
        admin_api_key_file=str(tmp_path / "admin_api_key"),
        mem_fraction_static=0.85,
        page_size=1,
        enable_return_routed_experts=True,
        enable_lora=True,
        max_lora_rank=32,
        lora_target_modules=("q_proj", "o_proj"),
        base_gpu_id=4,
        nnodes=2,
        node_rank=1,
        dist_init_addr="n0:5000",
        random_seed=3,
        weight_version="0",
        python="/sg/bin/python",
        extra_args=("--log-level", "warning"),
    )
    secrets = tmp_path / "sglang-keys.yaml"
    assert spec.command() == [
        "/sg/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--host",
        "0.0.0.0",
        "--port",
        "31001",
        "--tp-size",
        "8",
        "--dp-size",
        "2",
        "--ep-size",
        "8",
        "--mem-fraction-static",
        "0.85",
        "--page-size",
        "1",
        "--enable-return-routed-experts",
        "--enable-lora",
        "--max-lora-rank",
        "32",
        "--lora-target-modules",
        "q_proj",
        "o_proj",
        "--base-gpu-id",
        "4",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--dist-init-addr",
        "n0:5000",
        "--enable-metrics",
        "--random-seed",
        "3",
        "--weight-version",
        "0",
        "--config",
        str(secrets),
        "--log-level",
        "warning",
    ]
    assert spec.write_secrets_config() == secrets
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    assert secrets.read_text() == 'api-key: "plain-secret"\nadmin-api-key: "admin-secret"\n'
    assert not any("secret" in a for a in spec.command())
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 0}, "tp_size must be >= 1"),
        ({"port": 70000}, "port"),
        ({"nnodes": 2}, "dist_init_addr"),
        ({"max_lora_rank": 8}, "enable_lora"),
        ({"extra_args": ("--api-key", "x")}, r"repeat flags.*--api-key"),
        ({"extra_args": ("--tp-size=2",)}, "--tp-size"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
        ({"page_size": 0}, "page_size must be >= 1"),
        ({"extra_args": ("--page-size", "4")}, "--page-size"),
    ],
)
def test_spec_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SGLangLaunchSpec(model_path="/m", **kwargs)  # type: ignore[arg-type]


def test_record_write_read_roundtrip(tmp_path: Path) -> None:
    rec = EngineRecord(index=2, host="10.1.2.3", port=30002, pid=123, tp_size=4, gpu_ids=(4, 5, 6, 7), node="gpu07")
    path = write_engine_record(tmp_path / "rendezvous", rec)
    assert path.name == "engine-2.json" and rec.url == "http://10.1.2.3:30002"
    assert read_engine_record(path) == rec
    assert [p.name for p in path.parent.iterdir()] == ["engine-2.json"]  # no temporary file left behind
    assert EngineRecord(index=0, host="::1", port=1).url == "http://[::1]:1"


def test_reads_the_embedded_servers_record_format(tmp_path: Path) -> None:
    # `miles-hpc serve --rendezvous FILE` writes {host, port, pid, url, ...}: no index, maybe newer keys.
    path = tmp_path / "engine-5.json"
    path.write_text(json.dumps({"host": "127.0.0.1", "port": 4000, "pid": 9, "url": "http://127.0.0.1:4000", "x": 1}))
    rec = read_engine_record(path)
    assert (rec.index, rec.port, rec.pid, rec.url) == (5, 4000, 9, "http://127.0.0.1:4000")
    assert rec.started_at == pytest.approx(path.stat().st_mtime)
    (tmp_path / "engine-6.json.tmp").write_text("{")  # a half-written temporary is not a record
    assert list(read_engine_records(tmp_path)) == [5]


def test_wait_returns_records_once_all_appear(tmp_path: Path) -> None:
    write_engine_record(tmp_path, EngineRecord(index=1, host="h1", port=2))

    def late() -> None:
        time.sleep(0.2)
        write_engine_record(tmp_path, EngineRecord(index=0, host="h0", port=1))

    t = threading.Thread(target=late)
    t.start()
    recs = wait_for_engines(tmp_path, 2, timeout=5, poll_s=0.02)
    t.join()
    assert [r.host for r in recs] == ["h0", "h1"]


def test_wait_timeout_names_missing_engines_and_nodes(tmp_path: Path) -> None:
    write_engine_record(tmp_path, EngineRecord(index=0, host="h0", port=1))
    mark_engine_starting(tmp_path, 2, node="gpu03")
    with pytest.raises(EngineRendezvousTimeout) as info:
        wait_for_engines(tmp_path, 4, timeout=0.1, poll_s=0.02, nodes={3: "gpu04"})
    msg = str(info.value)
    assert info.value.missing == [1, 2, 3]
    assert "1 of 4 engines ready" in msg and str(tmp_path) in msg
    assert (
        "engine 1," in msg and "engine 2 (node gpu03, started, never ready)" in msg and "engine 3 (node gpu04)" in msg
    )


def test_wait_ignores_a_previous_jobs_records(tmp_path: Path) -> None:
    old = write_engine_record(tmp_path, EngineRecord(index=0, host="h", port=1, started_at=time.time() - 3600))
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    with pytest.raises(EngineRendezvousTimeout, match="missing: engine 0"):
        wait_for_engines(tmp_path, 1, timeout=0.05, poll_s=0.01, started_after=time.time() - 60)
