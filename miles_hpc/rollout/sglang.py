"""Launching real SGLang engines and the engine rendezvous files (stage: rollout, process side).

:class:`SGLangLaunchSpec` renders the ``python -m sglang.launch_server ...`` command line that a rollout worker runs
(docs/design.md section 3); the rendezvous functions are how an engine (SGLang or ours) announces itself and how the
controller waits for all of them. Standard library only: ``tests/sglang_schema_check.py`` imports this module in
SGLang's own venv and parses our command line with SGLang's argparse.

Invariants:
- API keys never appear on a command line (``ps`` and ``/proc/PID/cmdline`` are world-readable on shared nodes):
  they go to SGLang through ``--config FILE``, a YAML file of mode 0600 that SGLang merges into its arguments.
  (SGLang 0.5.23 still reports the merged arguments, keys included, in ``/server_info``'s ``launch_command`` and
  fields; that endpoint needs the plain key, so a plain-key holder can read the admin key there.)
- ``RUN/rendezvous/engine-<i>.json`` appears only complete: written to a temporary file in the same directory, fsynced
  and renamed. A reader never sees a torn record; an engine that rewrites its record replaces it whole.
- ``engine-<i>.starting.json`` (optional) says an engine process began on a node; it lets a timeout name the node
  of an engine that never became ready.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from miles_hpc.atomic import write_text_atomic

# Flags the spec sets itself: extra_args may not repeat them (argparse would silently keep the last one).
_MANAGED_FLAGS = frozenset(
    {
        "--model-path",
        "--host",
        "--port",
        "--tp-size",
        "--dp-size",
        "--ep-size",
        "--api-key",
        "--admin-api-key",
        "--config",
        "--mem-fraction-static",
        "--page-size",
        "--enable-return-routed-experts",
        "--enable-lora",
        "--max-lora-rank",
        "--lora-target-modules",
        "--base-gpu-id",
        "--nnodes",
        "--node-rank",
        "--dist-init-addr",
        "--enable-metrics",
        "--random-seed",
        "--weight-version",
    }
)


# HF architectures of the families we ship that SGLang serves (its models' EntryClass in the release preflight accepts,
# SGLANG_MIN there; tests/sglang_schema_check.py finds each in the installed sglang). A family outside this list is
# refused for rollout.backend=sglang until its row is added here with the SGLang release that has it. The weight sync
# sends a text model's names (`model.layers.*`, `lm_head.weight`) for a multimodal checkpoint too: SGLang's
# KimiK25ForConditionalGeneration.load_weights drops `language_model.` from every name and hands the rest to its
# DeepseekV3ForCausalLM, so those names load as the checkpoint's do.
SGLANG_ARCHS = frozenset(
    {
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "DeepseekV3ForCausalLM",
        "Glm4MoeForCausalLM",
        "GlmMoeDsaForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
    }
)


@dataclass(frozen=True, kw_only=True, slots=True)
class SGLangLaunchSpec:
    """One SGLang engine (possibly spanning nodes with TP > GPUs per node). Render with :meth:`command`."""

    model_path: str
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    api_key_file: str | None = None  # files holding the keys (the launcher writes them per job, mode 0600)
    admin_api_key_file: str | None = None
    # Where write_secrets_config() puts the YAML passed as --config; default: next to the key file.
    secrets_config_file: str | None = None
    mem_fraction_static: float | None = None
    page_size: int | None = None  # KV-cache page in tokens (prefix reuse in whole pages); None: SGLang's default
    enable_return_routed_experts: bool = False  # R3: needed for return_routed_experts
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()
    base_gpu_id: int = 0  # first GPU of this engine on its node (several engines per node)
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of node 0, for nnodes > 1
    enable_metrics: bool = True  # /metrics exists only with it
    random_seed: int | None = None
    weight_version: str | None = None  # the version the engine reports before the first update
    python: str = "python"  # the interpreter of SGLang's venv (it is never our main venv)
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size", "ep_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (host:port of node 0) is required when nnodes > 1")
        if self.page_size is not None and self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if (self.max_lora_rank is not None or self.lora_target_modules) and not self.enable_lora:
            raise ValueError("max_lora_rank/lora_target_modules need enable_lora=True")
        clash = sorted({a.split("=", 1)[0] for a in self.extra_args} & _MANAGED_FLAGS)
        if clash:
            raise ValueError(f"extra_args repeat flags the spec sets (use its fields instead): {clash}")

    def secrets_path(self) -> Path | None:
        """The ``--config`` YAML that carries the keys, or None without keys."""
        if self.secrets_config_file:
            return Path(self.secrets_config_file)
        key_file = self.admin_api_key_file or self.api_key_file
        return None if key_file is None else Path(key_file).with_name("sglang-keys.yaml")

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The environment this engine runs in: `base` with SGLang told to report each token's log-prob under the
        plain softmax (temperature 1), as our engine does and our trainer scores it. By default SGLang reports
        log_softmax(logits / temperature) when a request samples at temperature != 1 (sglang/srt/layers/sampler.py,
        `SGLANG_RETURN_ORIGINAL_LOGPROB`), which would put a temperature-sized gap between rollout and trainer."""
        return {**base, "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}

    def command(self) -> list[str]:
        """The argv that starts this engine (keys excluded: see :meth:`write_secrets_config`)."""
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path]
        cmd += ["--host", self.host, "--port", str(self.port)]
        cmd += ["--tp-size", str(self.tp_size), "--dp-size", str(self.dp_size), "--ep-size", str(self.ep_size)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", repr(self.mem_fraction_static)]
        if self.page_size is not None:
            cmd += ["--page-size", str(self.page_size)]
        if self.enable_return_routed_experts:
            cmd += ["--enable-return-routed-experts"]
        if self.enable_lora:
            cmd += ["--enable-lora"]
            if self.max_lora_rank is not None:
                cmd += ["--max-lora-rank", str(self.max_lora_rank)]
            if self.lora_target_modules:
                cmd += ["--lora-target-modules", *self.lora_target_modules]
        if self.base_gpu_id:
            cmd += ["--base-gpu-id", str(self.base_gpu_id)]
        if self.nnodes > 1:
            cmd += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank)]
            cmd += ["--dist-init-addr", str(self.dist_init_addr)]
        if self.enable_metrics:
            cmd += ["--enable-metrics"]
        if self.random_seed is not None:
            cmd += ["--random-seed", str(self.random_seed)]
        if self.weight_version is not None:
            cmd += ["--weight-version", self.weight_version]
        secrets = self.secrets_path()
        if secrets is not None:
            cmd += ["--config", str(secrets)]
        return cmd + list(self.extra_args)

    def secrets_config(self) -> dict[str, str]:
        """``{"api-key": ..., "admin-api-key": ...}`` read from the key files (only those set)."""
        out = {}
        for flag, path in (("api-key", self.api_key_file), ("admin-api-key", self.admin_api_key_file)):
            if path is not None:
                key = Path(path).read_text().strip()
                if not key:
                    raise ValueError(f"{path}: key file is empty")
                out[flag] = key
        return out

    def write_secrets_config(self) -> Path | None:
        """Write the ``--config`` YAML (mode 0600, atomically) before running :meth:`command`; None without keys."""
        path = self.secrets_path()
        if path is None:
            return None
        # JSON strings are valid YAML scalars, so no YAML library is needed to quote the keys safely.
        text = "".join(f"{k}: {json.dumps(v)}\n" for k, v in self.secrets_config().items())
        write_text_atomic(path, text, mode=0o600)
        return path


# ---------------------------------------------------------------------------------------------------------------
# Rendezvous: RUN/rendezvous/engine-<i>.json


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineRecord:
    """What an engine announces when it is listening (docs/design.md section 3)."""

    index: int
    host: str
    port: int
    url: str = ""  # default http://host:port
    pid: int | None = None
    tp_size: int = 1
    gpu_ids: tuple[int | str, ...] = ()  # CUDA_VISIBLE_DEVICES entries (indices, or UUIDs on some sites)
    node: str | None = None  # scheduler node name (SLURMD_NODENAME) when it differs from host
    backend: str = "sglang"  # sglang | embedded
    started_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not self.url:
            object.__setattr__(self, "url", f"http://{_url_host(self.host)}:{self.port}")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["gpu_ids"] = list(self.gpu_ids)
        return out


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "", "::"):
        host = socket.gethostname()  # a wildcard bind is reached through the node's name
    return f"[{host}]" if ":" in host else host


def record_path(rendezvous_dir: str | Path, index: int, *, starting: bool = False) -> Path:
    return Path(rendezvous_dir) / (f"engine-{index}.starting.json" if starting else f"engine-{index}.json")


def write_engine_record(rendezvous_dir: str | Path, record: EngineRecord) -> Path:
    """Publish ``engine-<i>.json`` atomically (call when the engine answers /health)."""
    path = record_path(rendezvous_dir, record.index)
    write_text_atomic(path, json.dumps(record.to_json(), indent=1) + "\n")
    return path


def mark_engine_starting(rendezvous_dir: str | Path, index: int, *, node: str | None = None) -> Path:
    """Publish ``engine-<i>.starting.json`` (node, host, pid, time) when an engine process begins loading."""
    info = {"index": index, "node": node or socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
    path = record_path(rendezvous_dir, index, starting=True)
    write_text_atomic(path, json.dumps(info) + "\n")
    return path


_NAME = re.compile(r"^engine-(\d+)\.json$")


def read_engine_record(path: str | Path) -> EngineRecord:
    """One record; the index comes from the file name when the record lacks it (our server's ``--rendezvous``
    writes ``{host, port, pid, url, ...}``), and unknown keys are ignored (newer writers)."""
    path = Path(path)
    data = json.loads(path.read_text())
    m = _NAME.match(path.name)
    if "index" not in data and m is None:
        raise ValueError(f"{path}: no engine index in the record or the file name")
    known = set(EngineRecord.__dataclass_fields__)
    kwargs = {k: v for k, v in data.items() if k in known}
    kwargs.setdefault("index", int(m.group(1)) if m else 0)
    kwargs["gpu_ids"] = tuple(kwargs.get("gpu_ids") or ())
    kwargs.setdefault("started_at", path.stat().st_mtime)  # writers without the field: the file's age says it
    for key in ("host", "port"):
        if key not in kwargs:
            raise ValueError(f"{path}: record has no {key!r}")
    return EngineRecord(**kwargs)


def read_engine_records(rendezvous_dir: str | Path) -> dict[int, EngineRecord]:
    """Every complete ``engine-<i>.json`` in the directory, by index."""
    out = {}
    directory = Path(rendezvous_dir)
    if directory.is_dir():
        for path in directory.iterdir():
            if _NAME.match(path.name):
                rec = read_engine_record(path)
                out[rec.index] = rec
    return out


class EngineRendezvousTimeout(TimeoutError):
    """Not every engine announced itself in time; ``missing`` lists the indices."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


def _starting_info(rendezvous_dir: Path, index: int) -> dict[str, Any] | None:
    try:
        info = json.loads(record_path(rendezvous_dir, index, starting=True).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def wait_for_engines(
    rendezvous_dir: str | Path,
    n: int,
    timeout: float,
    *,
    nodes: Mapping[int, str] | Sequence[str] | None = None,
    started_after: float | None = None,
    poll_s: float = 0.2,
) -> list[EngineRecord]:
    """Block until ``engine-0.json .. engine-<n-1>.json`` exist; return them by index.

    ``nodes`` (index -> node, from the job's plan) names where a missing engine should have run; otherwise its
    ``.starting.json`` does, when it got that far. ``started_after`` ignores records older than this time (a
    requeued job's leftovers). On timeout raises :class:`EngineRendezvousTimeout` naming the missing engines.
    """
    directory = Path(rendezvous_dir)
    deadline = time.monotonic() + timeout
    while True:
        records = {
            i: r
            for i, r in read_engine_records(directory).items()
            if i < n and (started_after is None or r.started_at >= started_after)
        }
        if len(records) == n:
            return [records[i] for i in range(n)]
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    missing = [i for i in range(n) if i not in records]
    where = []
    for i in missing:
        node = (nodes[i] if i < len(nodes) else None) if isinstance(nodes, Sequence) else (nodes or {}).get(i)
        starting = _starting_info(directory, i)
        node = node or (starting or {}).get("node")
        notes = ([f"node {node}"] if node else []) + (["started, never ready"] if starting else [])
        where.append(f"engine {i}" + (f" ({', '.join(notes)})" if notes else ""))
    raise EngineRendezvousTimeout(
        f"{len(records)} of {n} engines ready after {timeout:g} s in {directory}; missing: {', '.join(where)}",
        missing,
    )
