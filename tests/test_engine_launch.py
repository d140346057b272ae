"""The engine's command line is one typed value: every launcher's argv parses back into it unchanged."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from miles_hpc.cli import build_parser
from miles_hpc.config import load_config
from miles_hpc.engine.launch import EngineLaunch
from miles_hpc.launch.local import engine_launch

ROOT = Path(__file__).resolve().parents[1]


def _non_defaults() -> EngineLaunch:
    """A value with every field away from its default (so each flag must be written and read)."""
    values = {
        "model_dir": "/ckpt/model",
        "host": "0.0.0.0",
        "port": 0,
        "api_key": "k1",
        "api_key_file": "/k/a",
        "admin_api_key": "k2",
        "admin_api_key_file": "/k/b",
        "device": "cuda:3",
        "dtype": "bfloat16",
        "tp_size": 4,
        "max_total_tokens": 1234,
        "page_size": 4,
        "kv_cache_fraction": 0.25,
        "max_context_len": 4096,
        "max_running_requests": 7,
        "seed": 42,
        "batch_invariant": True,
        "enable_return_indexer_topk": True,
        "max_request_mb": 8.5,
        "request_body_timeout": 7.5,
        "rendezvous": "/run/rdv/engine-3.json",
        "weight_update_timeout": 12.5,
        "pause_lease": 3.5,
    }
    assert set(values) == {f.name for f in dataclasses.fields(EngineLaunch)}, "a new flag needs a value here"
    launch = EngineLaunch(**values)  # type: ignore[arg-type]
    for f in dataclasses.fields(EngineLaunch):
        if f.name != "model_dir":
            assert getattr(launch, f.name) != f.default, f.name
    return launch


@pytest.mark.parametrize("launch", [EngineLaunch(model_dir="m"), _non_defaults()], ids=["defaults", "every-flag"])
def test_argv_parses_back_unchanged(launch: EngineLaunch) -> None:
    argv = launch.argv(python="python3")
    assert argv[:4] == ["python3", "-m", "miles_hpc.cli", "serve"]
    assert EngineLaunch.parse(argv[4:]) == launch
    # `miles-hpc serve`'s own parser reads the same value
    assert EngineLaunch.from_namespace(build_parser().parse_args(argv[3:])) == launch


def test_defaults_leave_flags_out() -> None:
    assert EngineLaunch(model_dir="m").argv(python="py") == ["py", "-m", "miles_hpc.cli", "serve", "m"]


def test_run_engines_launch_with_the_run_config(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", ["zero_kl=false", "seed=5"])
    launch = engine_launch(
        cfg,
        tmp_path / "model",
        tmp_path / "keys",
        tmp_path / "rdv" / "engine-1.json",
        1,
        device="cuda:1",
        kv_cache_fraction=0.25,
    )
    back = EngineLaunch.parse(launch.argv()[4:])
    assert back == launch
    assert (back.seed, back.port, back.device, back.dtype) == (6, 0, "cuda:1", cfg.model.dtype)
    assert back.api_key is None and back.api_key_file == str(tmp_path / "keys" / "api_key")  # keys never in argv
    assert back.weight_update_timeout == cfg.sync.timeout_s


def test_the_run_page_size_reaches_the_engine(tmp_path: Path) -> None:
    """rollout.page_size -> `serve --page-size` -> the engine's KV block; unset, the engine keeps its own default."""
    from miles_hpc.engine.config import EngineConfig
    from miles_hpc.engine.launch import DEFAULT_PAGE_SIZE
    from miles_hpc.engine.server import configs_of

    assert EngineConfig().block_size == DEFAULT_PAGE_SIZE == 16  # serve's default is the engine's

    for overrides, block in (([], 16), (["rollout.page_size=1"], 1), (["rollout.page_size=4"], 4)):
        cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", overrides)
        launch = engine_launch(cfg, tmp_path / "model", tmp_path / "keys", tmp_path / "rdv.json", 0)
        (tmp_path / "keys").mkdir(exist_ok=True)
        for name in ("api_key", "admin_api_key"):
            (tmp_path / "keys" / name).write_text("k\n")
        engine_cfg, _ = configs_of(EngineLaunch.parse(launch.argv()[4:]))
        assert engine_cfg.block_size == block
