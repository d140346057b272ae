"""Shared helpers of the engine-server tests: tiny checkpoints, a REAL `miles-hpc serve` process, HTTP calls.

Every server test talks real HTTP (aiohttp) to a real server process started exactly as the launcher starts it
(`python -m miles_hpc.cli serve MODEL --port 0 --rendezvous FILE`) and discovered through its rendezvous file.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import torch

from miles_hpc.models import load_pretrained
from miles_hpc.models.presets import init_model

REPO = Path(__file__).resolve().parents[1]


def make_model(out: Path, arch: str = "qwen3", seed: int = 0) -> Path:
    """A random-init tiny checkpoint (what `miles-hpc init-model --arch ARCH --size tiny --seed S OUT` writes)."""
    if not (out / "config.json").exists():
        init_model(arch, "tiny", out, seed=seed)
    return out


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    info: dict[str, Any]
    log: Path
    rendezvous: Path

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # our own child, by handle
                self.proc.wait()
                raise AssertionError(f"server ignored signal {sig} for {timeout} s:\n{self.log_tail()}") from None
        return int(self.proc.returncode)


def children_of(pid: int) -> list[int]:
    """Child processes of `pid`, from /proc (no procps needed)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def start_server(model_dir: Path, workdir: Path, *args: str, timeout: float = 90.0) -> Server:
    """Start `miles-hpc serve` on a free port and wait for its rendezvous file (the launcher's contract)."""
    workdir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    rdv, log = workdir / f"engine-{tag}.json", workdir / f"server-{tag}.log"
    cmd = [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "serve",
        str(model_dir),
        "--port",
        "0",
        "--rendezvous",
        str(rdv),
        *args,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    deadline = time.monotonic() + timeout
    while not rdv.exists():
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"no rendezvous file after {timeout} s:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.05)
    info = json.loads(rdv.read_text())
    return Server(url=info["url"], proc=proc, info=info, log=log, rendezvous=rdv)


@contextmanager
def running_server(model_dir: Path, workdir: Path, *args: str) -> Iterator[Server]:
    """A server for the duration of the block; it must exit cleanly (code 0) on SIGTERM afterwards."""
    server = start_server(model_dir, workdir, *args)
    try:
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"server exit code {code}:\n{server.log_tail()}"


@dataclass
class Reply:
    status: int
    body: Any  # parsed JSON when the answer is JSON, else the text
    text: str


async def acall(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    *,
    data: bytes | None = None,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> Reply:
    """One request; ``key`` becomes ``Authorization: Bearer <key>``; the answer's JSON (or text) in Reply.body."""
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    if body is not None:
        data = json.dumps(body).encode()
    if data is not None:
        headers["Content-Type"] = "application/json"
    async with session.request(
        method, url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        text = await resp.text()
        try:
            parsed = json.loads(text) if text else None
        except ValueError:
            parsed = text
        return Reply(resp.status, parsed, text)


def call(method: str, url: str, body: Any = None, **kw: Any) -> Reply:
    """One request from synchronous test code."""

    async def go() -> Reply:
        async with aiohttp.ClientSession() as s:
            return await acall(s, method, url, body, **kw)

    return asyncio.run(go())


def generate(url: str, input_ids: list[int] | list[list[int]], max_new_tokens: int = 8, **kw: Any) -> Any:
    """POST /generate with greedy sampling; returns the JSON answer (asserts 200)."""
    sp = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **kw.pop("sampling", {})}
    r = call("POST", f"{url}/generate", {"input_ids": input_ids, "sampling_params": sp, **kw})
    assert r.status == 200, r.text
    return r.body


def greedy_reference(model_dir: Path, prompt: list[int], output: list[int]) -> float:
    """Teacher-forced check of a greedy `output` against the plain `load_pretrained` model of `model_dir`: the
    largest (max logit - logit of the token the engine chose) over the output. 0 when every token is exactly the
    reference argmax; a value of ~1e-6 can only be a float32 near-tie that two kernels order differently."""
    model = load_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output]))[0].double()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]
    chosen = rows[torch.arange(len(output)), torch.tensor(output)]
    return float((rows.max(dim=-1).values - chosen).max().item()) if output else 0.0


def reference_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> list[float]:
    """Temperature-1 log-probs of `output` under the reference model (what meta_info.output_token_logprobs holds)."""
    model = load_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output]))[0].double()
    lp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(output)], dim=-1)
    return lp[torch.arange(len(output)), torch.tensor(output)].tolist()


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? (\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """Strict Prometheus text-format (0.0.4) check and parse -> {metric name: value} (labels dropped).

    Every line is `# HELP name text`, `# TYPE name counter|gauge|...` (before that metric's samples, once) or a
    sample `name{label="value",...} value`; values parse as floats; the text ends with a newline."""
    assert text.endswith("\n"), "exposition must end with a newline"
    typed: dict[str, str] = {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            assert name not in typed and name not in out, f"TYPE after samples or twice: {line}"
            typed[name] = kind
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        name, value = m.group(1), float(m.group(3))
        assert name in typed, f"sample without TYPE: {line}"
        if typed[name] == "counter":
            assert name.endswith("_total") and value >= 0, line
        out[name] = value
    return out


def metrics(url: str) -> dict[str, float]:
    r = call("GET", f"{url}/metrics")
    assert r.status == 200, r.text
    return parse_metrics(r.text)


async def ametrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    r = await acall(session, "GET", f"{url}/metrics")
    assert r.status == 200, r.text
    return parse_metrics(r.text)
