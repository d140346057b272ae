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


@pytest.mark.parametrize(
    "data, needle",
    [
        (bytes(range(256)) * 4, "a binary file (a NUL byte at offset 0)"),
        (b"\x89PNG\r\n\x1a\n" + b"\xff" * 64, "not UTF-8 text (byte 0x89 at offset 0)"),
        (b"rollout:\n  temperature: \xff\xfe\n", "not UTF-8 text (byte 0xff at offset 24)"),
        ("steps: 3\n".encode("utf-16"), "UTF-16 or UTF-32 text"),
        (b"- a\n- b\n", "top level must be a mapping, got list"),
        (b"just a string\n", "top level must be a mapping, got str"),
        (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply for the YAML parser"),
        (b"".join(b"  " * i + b"k%d:\n" % i for i in range(70)) + b"  " * 70 + b"1\n", "nested more than 64 levels"),
        (b"rollout: &r\n  x: *r\n", "a YAML alias refers to a value that contains it"),
        (b"steps: " + b"9" * 5000 + b"\n", "Exceeds the limit (4300 digits)"),
        (b"steps: 3\nrollout: {}\nsteps: 4\n", "key 'steps' is given twice (first on line 1)"),
        (b"a: !!python/object:os.system ls\n", "not valid YAML"),
    ],
)
def test_malformed_files_name_the_file_and_the_problem(tmp_path: Path, data: bytes, needle: str) -> None:
    p = tmp_path / "cfg.yaml"
    p.write_bytes(data)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith(f"{p}: ") and needle in str(e.value), str(e.value)[:300]


def test_a_directory_and_a_huge_file_are_not_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{tmp_path}: cannot read config: it is a directory"):
        load_config(tmp_path)
    big = tmp_path / "model.safetensors"
    with big.open("wb") as f:
        f.truncate((16 << 20) + 1)  # sparse: a checkpoint passed by mistake
    with pytest.raises(ConfigError, match="larger than 16 MB"):
        load_config(big)


def test_what_strictness_still_allows(tmp_path: Path) -> None:
    # a UTF-8 byte-order mark, anchors merged in and overridden, an alias used many times ("billion laughs")
    text = "\ufeffrollout: &r\n  temperature: 0.5\n  top_k: 3\nsync: {timeout_s: 7}\n"
    p = tmp_path / "ok.yaml"
    p.write_text(text, encoding="utf-8")
    cfg = load_config(p, ["rollout={<<: {temperature: 0.7, top_k: 2}, top_k: 5}"])
    assert (cfg.rollout.temperature, cfg.rollout.top_k, cfg.sync.timeout_s) == (0.7, 5, 7.0)
    laughs = "x0: &a0 [a, a]\n" + "".join(f"x{i}: &a{i} [*a{i - 1}, *a{i - 1}]\n" for i in range(1, 40))
    with pytest.raises(ConfigError, match="unknown key 'x0'"):  # parsed and checked at once, not expanded
        load_config(write(tmp_path, laughs))


def test_bad_override_values_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"override 'rollout.top_k=\[1,': the value: not valid YAML"):
        load_config(None, ["rollout.top_k=[1,"])
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(None, ["rollout.top_k=" + "[" * 3000])
