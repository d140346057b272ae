"""A timed stand-in engine for the scheduling benchmark (bench_async.py --engine sim): SGLang's HTTP API, where a
sample of L tokens takes L x `--token-ms` whatever else runs, as on a GPU whose decode step is memory-bound with
spare batch slots. That is the regime where a long tail costs a synchronous loop the most, and on a CPU our real
engine cannot show it (its decode step grows with the batch).

What is real: the request and response shapes (our protocol module, so the same client and router drive it), the
weight updates (it joins the broadcast group with the trainer and receives every tensor: the same
`WeightReceiver`), `/weights_checker` over what it received, per-token weight-version spans, pause modes
(`abort` returns the output so far; `retract`/`in_place` hold generation until continue). What is not: the tokens
(seeded random ids, log-prob -1.0).

    python benchmarks/sim_engine.py --port 0 --rendezvous DIR/engine-0.json --token-ms 2 --vocab 320
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import time
import uuid
from pathlib import Path

from aiohttp import web

from miles_hpc.engine import protocol
from miles_hpc.engine.types import FinishReason, GenerateResult
from miles_hpc.engine.weight_receiver import JoinRequest, WeightReceiver, checksum_response
from miles_hpc.sync.wire.checksum import tensor_checksum


class SimEngine:
    def __init__(self, token_ms: float, vocab: int) -> None:
        self.token_s, self.vocab = token_ms / 1000.0, vocab
        self.version = "0"
        self.running = asyncio.Event()
        self.running.set()
        self.paused = asyncio.Event()
        self.abort_all = asyncio.Event()
        self.receiver = WeightReceiver("cpu", timeout_s=120)
        self.sums: dict[str, str] = {}

    async def generate(self, request: web.Request) -> web.Response:
        parsed = protocol.parse_generate(
            await request.json(),
            protocol.ModelLimits(vocab_size=self.vocab, max_context_len=1 << 20),
            lambda: uuid.uuid4().hex,
        )
        req = parsed.requests[0]
        rng = random.Random(req.sampling.sampling_seed if req.sampling.sampling_seed is not None else req.rid)
        out: list[int] = []
        spans: list[dict[str, object]] = []
        finish = FinishReason(type="length")
        t0 = time.monotonic()
        want = req.sampling.max_new_tokens
        # Tokens come out at one per token_s while running; weights change only while paused, so each running
        # stretch has one version. One timer per stretch, not one wake-up per token: the stand-in stays cheap.
        while len(out) < want:
            if self.paused.is_set():
                if self.abort_all.is_set():
                    finish = FinishReason(type="abort", message="paused in abort mode")
                    break
                await self.running.wait()
                continue
            version, start = self.version, time.monotonic()
            try:
                await asyncio.wait_for(self.paused.wait(), (want - len(out)) * self.token_s)
                n = min(want - len(out), int((time.monotonic() - start) / self.token_s))
            except TimeoutError:
                n = want - len(out)
            if n:
                spans.append({"version": version, "start": len(out), "end": len(out) + n})
                out += [rng.randrange(self.vocab) for _ in range(n)]
        res = GenerateResult(
            rid=req.rid,
            output_ids=out,
            finish_reason=finish,
            prompt_tokens=len(req.input_ids),
            cached_tokens=0,
            output_logprobs=[-1.0] * len(out),
            weight_versions=spans,
            weight_version=self.version,
            e2e_latency=time.monotonic() - t0,
        )
        return web.json_response(protocol.generate_response(req, res, None))

    async def pause(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        if body.get("mode", "abort") == "abort":
            self.abort_all.set()
        self.running.clear()
        self.paused.set()
        return web.json_response({"success": True, "message": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.abort_all.clear()
        self.paused.clear()
        self.running.set()
        return web.json_response({"success": True, "message": "continued"})

    async def join(self, request: web.Request) -> web.Response:
        p = protocol.parse_control("init_weights_update_group", await request.json())
        fields = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
        await asyncio.to_thread(self.receiver.join, JoinRequest(**{k: p[k] for k in fields}))
        return web.json_response({"success": True, "message": "joined"})

    async def update(self, request: web.Request) -> web.Response:
        p = protocol.parse_control("update_weights_from_distributed", await request.json())
        named = await asyncio.to_thread(self.receiver.receive, p["group_name"], p["names"], p["dtypes"], p["shapes"])
        self.sums.update({n: tensor_checksum(t) for n, t in named})
        if p["weight_version"] is not None:
            self.version = p["weight_version"]
        return web.json_response({"success": True, "message": "updated"})

    async def destroy(self, request: web.Request) -> web.Response:
        p = protocol.parse_control("destroy_weights_update_group", await request.json())
        await asyncio.to_thread(self.receiver.destroy, p["group_name"])
        return web.json_response({"success": True, "message": "destroyed"})

    async def checksums(self, request: web.Request) -> web.Response:
        return web.json_response(checksum_response(self.sums, self.version))

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": "sim", "weight_version": self.version, "is_generation": True, "weights_half_updated": False}
        )

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": "ok"})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.post("/pause_generation", self.pause),
                web.post("/continue_generation", self.resume),
                web.post("/init_weights_update_group", self.join),
                web.post("/update_weights_from_distributed", self.update),
                web.post("/destroy_weights_update_group", self.destroy),
                web.post("/weights_checker", self.checksums),
                web.get("/get_model_info", self.info),
                web.get("/health", self.ok),
                web.get("/health_generate", self.ok),
                web.post("/flush_cache", self.ok),
                web.post("/abort_request", self.ok),
            ]
        )
        return app


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(SimEngine(args.token_ms, args.vocab).app(), access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", args.port))
    site = web.SockSite(runner, sock)
    await site.start()
    port = sock.getsockname()[1]
    path = Path(args.rendezvous)
    tmp = path.with_suffix(".tmp")
    index = int(path.stem.rsplit("-", 1)[1])  # engine-<i>.json
    tmp.write_text(
        json.dumps(
            {
                "index": index,
                "host": "127.0.0.1",
                "port": port,
                "url": f"http://127.0.0.1:{port}",
                "pid": os.getpid(),
                "tp_size": 1,
                "backend": "embedded",
            }
        )
    )
    os.replace(tmp, path)
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--rendezvous", required=True)
    ap.add_argument("--token-ms", type=float, default=2.0)
    ap.add_argument("--vocab", type=int, default=320)
    asyncio.run(serve(ap.parse_args()))
