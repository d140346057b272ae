"""Config: YAML load, dotted overrides, strict validation with key path and file name, round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from miles_hpc.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
)

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_defaults_and_shipped_configs_load() -> None:
    assert load_config(None) == RunConfig()
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert isinstance(cfg, RunConfig), path


def test_yaml_and_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, "name: a\nrollout:\n  temperature: 0.7\n  top_k: 5\n")
    cfg = load_config(
        p,
        ["rollout.temperature=1", "train.lr=3e-4", "train.weight_decay=1E2", "model.path=/x/y", "store.enabled=false"],
    )
    assert cfg.name == "a"
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.rollout.top_k == 5
    assert cfg.train.lr == 3e-4 and cfg.train.weight_decay == 100.0
    assert cfg.model.path == "/x/y"
    assert cfg.store.enabled is False


def test_frozen() -> None:
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "b"  # type: ignore[misc]


def test_unknown_key_names_path_and_file(tmp_path: Path) -> None:
    p = write(tmp_path, "rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "rollout.temprature" in msg and str(p) in msg
    assert "temperature" in msg  # lists the valid keys of the section


def test_unknown_top_level_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'bogus'"):
        load_config(write(tmp_path, "bogus: 1\n"))


@pytest.mark.parametrize(
    "text, key",
    [
        ("rollout:\n  max_new_tokens: 1.5\n", "rollout.max_new_tokens"),
        ("rollout:\n  max_new_tokens: '12'\n", "rollout.max_new_tokens"),
        ("store:\n  enabled: 1\n", "store.enabled"),
        ("train:\n  backend: deepspeed\n", "train.backend"),
        ("model: 3\n", "model"),
        ("seed: true\n", "seed"),
    ],
)
def test_wrong_type_names_path_and_file(tmp_path: Path, text: str, key: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert key in str(e.value) and str(p) in str(e.value)


def test_value_validation_names_path(tmp_path: Path) -> None:
    p = write(tmp_path, "rollout:\n  top_p: 1.5\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "rollout.top_p" in str(e.value) and str(p) in str(e.value)


def test_bad_override(tmp_path: Path) -> None:
    p = write(tmp_path, "name: a\n")
    with pytest.raises(ConfigError, match=r"rollout\.nope"):
        load_config(p, ["rollout.nope=1"])
    with pytest.raises(ConfigError, match=r"expected key\.sub=value"):
        load_config(p, ["rollout.temperature"])
    with pytest.raises(ConfigError, match=r"name is not a section"):
        load_config(p, ["name.x=1"])
    with pytest.raises(ConfigError, match=r"train\.lr"):
        load_config(p, ["train.lr=-1"])


def test_not_a_mapping_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1,\n"))


def test_round_trip_through_yaml(tmp_path: Path) -> None:
    cfg = load_config(None, ["rollout.top_k=7", "name=x", "sync.strategy=delta", "model.path=null"])
    p = tmp_path / "resolved.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_apply_overrides_does_not_mutate_input() -> None:
    data = {"rollout": {"top_k": 1}}
    out = apply_overrides(data, ["rollout.top_k=2", "train.lr=0.1"])
    assert data == {"rollout": {"top_k": 1}}
    assert out == {"rollout": {"top_k": 2}, "train": {"lr": 0.1}}
