"""The embedded engine's command line as one typed value (stage: engine; imports nothing of ours, nor torch).

`EngineLaunch` holds every flag of `miles-hpc serve`, once: each field's metadata names its flag, parse type and
help. Launchers build the value and start `launch.argv()` (launch/local.py, launch/workers.py); `serve` parses its
command line back into the same value (`EngineLaunch.add_arguments` + `from_namespace`). `parse(argv()[4:])`
gives the value back unchanged (tests/test_engine_launch.py), so a flag can never be spelt two ways.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_PAGE_SIZE", "EngineLaunch"]

DEFAULT_PAGE_SIZE = 16  # tokens per KV block of the embedded engine (EngineConfig.block_size's default)


def _flag(default: Any, help: str, parse: Callable[[str], Any] | None = str) -> Any:
    """A field that is the flag ``--<name-with-dashes>``; ``parse`` None: a boolean switch (store_true)."""
    return field(default=default, metadata={"help": help, "parse": parse})


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineLaunch:
    """One `miles-hpc serve` process: its checkpoint and every flag (None / the default: the flag is left out)."""

    model_dir: str = field(metadata={"help": "HF-format checkpoint directory"})
    host: str = _flag("127.0.0.1", "bind address (0.0.0.0: all interfaces)")
    port: int = _flag(30000, "TCP port; 0 picks a free one", int)
    api_key: str | None = _flag(None, "key for every endpoint but /health*, /ready, /metrics (visible in ps!)")
    api_key_file: str | None = _flag(None, "file holding --api-key (first line), so it stays out of ps")
    admin_api_key: str | None = _flag(None, "key for weight-update and control endpoints")
    admin_api_key_file: str | None = _flag(None, "file holding --admin-api-key")
    device: str = _flag("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: str | None = _flag(None, "weights/KV dtype: float32, bfloat16, float16 (default: the checkpoint's)")
    tp_size: int = _flag(1, "tensor-parallel ranks serving the model (one process and device each; SGLang's flag)", int)
    max_total_tokens: int = _flag(65536, "KV-cache capacity in tokens (CPU)", int)
    page_size: int = _flag(
        DEFAULT_PAGE_SIZE,
        "tokens per KV-cache page (block); prefix caching reuses whole pages (SGLang's flag; its default is 1)",
        int,
    )
    kv_cache_fraction: float = _flag(
        0.85, "GPU: fraction of the memory free after loading weights for the KV cache", float
    )
    max_context_len: int | None = _flag(None, "prompt + output tokens per request (default: model's)", int)
    max_running_requests: int = _flag(256, "requests decoding at once", int)
    seed: int = _flag(0, "seeds requests that bring no sampling_seed", int)
    batch_invariant: bool = _flag(
        False,
        "zero-KL mode: batch-invariant kernels (log-probs equal the trainer's in zero-KL mode bit for bit)",
        None,
    )
    enable_return_indexer_topk: bool = _flag(
        False,
        "DSA models: record each cached token's indexer top-k so requests may ask for it (return_indexer_topk; "
        "indexer replay); num_indexer_layers * index_topk * 4 bytes more per cached token",
        None,
    )
    max_request_mb: float = _flag(64.0, "largest request body (413 beyond)", float)
    request_body_timeout: float = _flag(
        60.0, "seconds a request body may go without a byte before the request fails with 408 (a stalled client)", float
    )
    rendezvous: str | None = _flag(None, "write {host, port, pid, url, ...} JSON here once listening")
    weight_update_timeout: float = _flag(600.0, "seconds a weight-update group join or broadcast may take", float)
    pause_lease: float | None = _flag(
        None,
        "seconds a pause may last with no /continue_generation or weight-sync call before generation continues by "
        "itself (default: --weight-update-timeout; 0: no lease)",
        float,
    )

    def argv(self, python: str = sys.executable) -> list[str]:
        """The command that starts this engine (flags at their default are left out)."""
        out = [python, "-m", "miles_hpc.cli", "serve", self.model_dir]
        for f in _flags():
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            out += [flag] if f.metadata["parse"] is None else [flag, str(value)]
        return out

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Every flag, on `serve`'s parser."""
        parser.add_argument("model_dir", help="HF-format checkpoint directory")
        for f in _flags():
            flag, parse, help = "--" + f.name.replace("_", "-"), f.metadata["parse"], f.metadata["help"]
            if parse is None:
                parser.add_argument(flag, action="store_true", help=help)
            else:
                parser.add_argument(flag, type=parse, default=f.default, help=help)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EngineLaunch:
        return cls(model_dir=ns.model_dir, **{f.name: getattr(ns, f.name) for f in _flags()})

    @classmethod
    def parse(cls, args: Sequence[str]) -> EngineLaunch:
        """`serve`'s arguments (after ``serve``) back into the value."""
        parser = argparse.ArgumentParser(prog="miles-hpc serve")
        cls.add_arguments(parser)
        return cls.from_namespace(parser.parse_args(list(args)))


def _flags() -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(EngineLaunch) if f.name != "model_dir"]
