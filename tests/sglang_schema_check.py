"""Check our rollout client's requests and launcher flags against the installed sglang package's own definitions.

Run inside SGLang's venv (scripts/test_sglang.sh), where our dependencies are absent: it imports only
``miles_hpc.rollout.requests`` and ``miles_hpc.rollout.sglang`` (standard library only) from this checkout.

Checks, each printed as ``ok``/``FAIL``:
1. every body our client can send (every optional field set, and the minimal form) constructs the matching SGLang
   request type strictly (``Cls(**body)``: an unknown field raises) and through the pydantic path FastAPI uses;
   ``/generate`` bodies also pass SGLang's JSON contract gate (``generate_contract_error``) and our sampling params
   pass ``SamplingParams(**sp).verify()`` and the contract's ``SamplingParams`` (which rejects unknown keys);
2. every key of ``SAMPLING_KEYS`` exists in both SGLang sampling-param definitions;
3. every endpoint exists in SGLang's HTTP app with our method, and our admin flag equals SGLang's auth level;
4. our launcher's command line parses with ``ServerArgs.add_cli_args`` (values round-trip), and the keys handed over
   through ``--config`` arrive as ``api_key``/``admin_api_key``;
5. every architecture preflight lets SGLang serve (``SGLANG_ARCHS``) is an ``EntryClass`` of its model modules.
Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

from miles_hpc.rollout import requests as rq  # noqa: E402  (after the path insert above)
from miles_hpc.rollout.sglang import SGLANG_ARCHS, SGLangLaunchSpec  # noqa: E402

FAILURES: list[str] = []
VERBOSE = "-v" in sys.argv


def check(name: str, fn: Any) -> None:
    try:
        fn()
    except Exception as e:  # report every failure, not just the first
        FAILURES.append(name)
        print(f"FAIL {name}: {type(e).__name__}: {e}")
    else:
        print(f"ok   {name}")


def strict(cls: type, body: dict[str, Any]) -> None:
    """Construct the SGLang type from the body as keyword arguments (unknown keys raise TypeError) and through the
    pydantic adapter FastAPI uses for the HTTP body."""
    cls(**body)
    from pydantic import TypeAdapter

    TypeAdapter(cls).validate_python(dict(body))


def entry_classes(models_dir: Path) -> dict[str, str]:
    """Class name -> module file of every `EntryClass` in SGLang's model modules, read from their source (importing
    them all needs CUDA kernels)."""
    import ast

    found: dict[str, str] = {}
    for file in sorted(models_dir.glob("*.py")):
        for node in ast.parse(file.read_text(), str(file)).body:
            targets = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            if "EntryClass" in targets:
                value = node.value  # type: ignore[attr-defined]
                for elt in value.elts if isinstance(value, ast.List | ast.Tuple) else [value]:
                    if isinstance(elt, ast.Name):
                        found[elt.id] = file.name
    return found


def archs_check() -> None:
    import sglang.srt.models as models

    found = entry_classes(Path(models.__path__[0]))
    missing = sorted(SGLANG_ARCHS - found.keys())
    if missing:
        raise ValueError(f"not an EntryClass of this sglang: {missing}")
    if VERBOSE:
        print("     " + ", ".join(f"{a} ({found[a]})" for a in sorted(SGLANG_ARCHS)))


def main() -> int:
    from sglang.srt.managers import io_struct as io
    from sglang.srt.sampling.sampling_params import SamplingParams

    print(f"sglang {importlib.metadata.version('sglang')}, checking {ROOT}")
    full_sampling = {
        "max_new_tokens": 16,
        "min_new_tokens": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "stop_token_ids": [2, 3],
        "ignore_eos": False,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": True,
        "no_stop_trim": True,
        "sampling_seed": 1234,
    }
    generate_bodies = {
        "minimal": rq.generate_body([1, 2, 3], {"max_new_tokens": 4}),
        "full": rq.generate_body(
            [1, 2, 3],
            full_sampling,
            rid="r-1",
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
            return_routed_experts=True,
            routed_experts_start_len=1,
            lora_path="adapter-a",
        ),
        "opd_teacher_scoring": rq.generate_body(
            [1, 2, 3], {"max_new_tokens": 0}, rid="t", return_logprob=True, logprob_start_len=0
        ),
        "chunk_continuation": rq.generate_body(
            [1, 2, 3, 4],
            {"max_new_tokens": 8, "temperature": 1.0},
            rid="c",
            return_logprob=True,
            return_routed_experts=True,
            routed_experts_start_len=3,
        ),
    }

    def generate_check(body: dict[str, Any]) -> None:
        from sglang.srt.entrypoints.api_contract import generate_contract_error

        strict(io.GenerateReqInput, body)
        err = generate_contract_error(body)
        if err is not None:
            raise ValueError(f"contract gate: {err}")
        io.GenerateReqInput(**body).normalize_batch_and_arguments()

    for label, body in generate_bodies.items():
        check(f"/generate body ({label}) -> GenerateReqInput {sorted(body)}", lambda b=body: generate_check(b))

    def sampling_check() -> None:
        from sglang.api.v1.api_types import SamplingParams as ContractSamplingParams

        sp = rq.sampling_params_body(full_sampling)
        SamplingParams(**sp).verify(vocab_size=1000)
        ContractSamplingParams.from_json_value(sp)

    check(f"sampling_params -> SamplingParams(...).verify() and contract {sorted(full_sampling)}", sampling_check)

    def sampling_keys_check() -> None:
        import msgspec
        from sglang.api.v1.api_types import SamplingParams as ContractSamplingParams

        srt = {f.name for f in msgspec.structs.fields(SamplingParams)}
        contract = {f.name for f in msgspec.structs.fields(ContractSamplingParams)}
        missing = sorted(rq.SAMPLING_KEYS - (srt & contract))
        if missing:
            raise ValueError(f"SAMPLING_KEYS not in SGLang's SamplingParams: {missing}")

    check(f"SAMPLING_KEYS ({len(rq.SAMPLING_KEYS)}) all exist in SGLang's SamplingParams", sampling_keys_check)

    control = [
        ("abort rid", io.AbortReq, rq.abort_body("r-1")),
        ("abort all", io.AbortReq, rq.abort_body(abort_all=True)),
        ("pause abort", io.PauseGenerationReqInput, rq.pause_body("abort")),
        ("pause retract", io.PauseGenerationReqInput, rq.pause_body("retract")),
        ("pause in_place", io.PauseGenerationReqInput, rq.pause_body("in_place")),
        ("continue", io.ContinueGenerationReqInput, rq.continue_body()),
        ("update_weight_version", io.UpdateWeightVersionReqInput, rq.update_weight_version_body("7")),
        ("weights_checker", io.CheckWeightsReqInput, rq.weights_checker_body("checksum", skip_tensor_list=["x"])),
        (
            "init_weights_update_group",
            io.InitWeightsUpdateGroupReqInput,
            rq.init_weights_update_group_body("10.0.0.1", 29500, 1, 3, group_name="g", backend="gloo"),
        ),
        (
            "update_weights_from_distributed",
            io.UpdateWeightsFromDistributedReqInput,
            rq.update_weights_from_distributed_body(
                ["model.embed_tokens.weight", "lm_head.weight"],
                ["bfloat16", "torch.float32"],
                [[8, 4], [8, 4]],
                group_name="g",
                weight_version="3",
                flush_cache=True,
                abort_all_requests=False,
                load_format="direct",
            ),
        ),
        (
            "update_weights_from_disk",
            io.UpdateWeightFromDiskReqInput,
            rq.update_weights_from_disk_body(
                "/ckpt/v3",
                weight_version="3",
                flush_cache=True,
                abort_all_requests=False,
                load_format="auto",
                keep_pause=False,
            ),
        ),
        (
            "destroy_weights_update_group",
            io.DestroyWeightsUpdateGroupReqInput,
            rq.destroy_weights_update_group_body("g"),
        ),
        ("load_lora_adapter", io.LoadLoRAAdapterReqInput, rq.load_lora_adapter_body("a", "/lora/a", pinned=True)),
        ("unload_lora_adapter", io.UnloadLoRAAdapterReqInput, rq.unload_lora_adapter_body("a")),
    ]
    for label, cls, body in control:
        check(f"{label} body -> {cls.__name__} {sorted(body)}", lambda c=cls, b=body: strict(c, b))

    def routes_check() -> None:
        from sglang.srt.entrypoints import http_server
        from sglang.srt.utils.auth import AuthLevel

        routes = {}
        for route in http_server.app.routes:
            for method in getattr(route, "methods", None) or ():
                routes[(method, getattr(route, "path", ""))] = route
        problems = []
        for name, ep in vars(rq).items():
            if not isinstance(ep, rq.Endpoint):
                continue
            if ep.path == "/metrics":
                continue  # mounted at start-up, only with --enable-metrics (our launcher passes it)
            route = routes.get((ep.method, ep.path))
            if route is None:
                problems.append(f"{name}: {ep.method} {ep.path} is not a route")
                continue
            level = getattr(route.endpoint, "_auth_level", AuthLevel.NORMAL)
            if ep.admin != (level in (AuthLevel.ADMIN_OPTIONAL, AuthLevel.ADMIN_FORCE)):
                problems.append(f"{name}: admin={ep.admin} but SGLang's level is {level}")
            if VERBOSE:
                print(f"     {ep.method} {ep.path}: {level}")
        params = inspect.signature(http_server.flush_cache).parameters
        if set(rq.flush_cache_query(1.0)) - set(params):
            problems.append(f"/flush_cache query {rq.flush_cache_query(1.0)} vs handler params {list(params)}")
        if problems:
            raise ValueError("; ".join(problems))

    check("endpoints exist with our method and auth level (http_server.app)", routes_check)

    def launcher_check() -> None:
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "api_key").write_text("plain-secret\n")
            (Path(tmp) / "admin_api_key").write_text("admin-secret\n")
            spec = SGLangLaunchSpec(
                model_path="/models/qwen3-moe",
                tp_size=4,
                dp_size=2,
                ep_size=4,
                host="0.0.0.0",
                port=31000,
                api_key_file=f"{tmp}/api_key",
                admin_api_key_file=f"{tmp}/admin_api_key",
                mem_fraction_static=0.8,
                page_size=4,
                enable_return_routed_experts=True,
                enable_lora=True,
                max_lora_rank=16,
                lora_target_modules=("q_proj", "v_proj"),
                base_gpu_id=4,
                nnodes=2,
                node_rank=1,
                dist_init_addr="node0:5000",
                enable_metrics=True,
                random_seed=7,
                weight_version="0",
                python="/venv/bin/python",
                extra_args=("--log-level", "warning"),
            )
            spec.write_secrets_config()
            cmd = spec.command()
            assert cmd[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"], cmd[:3]
            assert not any("secret" in a for a in cmd), "a key is on the command line"
            parser = argparse.ArgumentParser()
            ServerArgs.add_cli_args(parser)
            argv = ConfigArgumentMerger(parser).merge_config_with_args(cmd[3:])
            args = parser.parse_args(argv)
        expected = {
            "model_path": spec.model_path,
            "tp_size": 4,
            "dp_size": 2,
            "ep_size": 4,
            "host": "0.0.0.0",
            "port": 31000,
            "mem_fraction_static": 0.8,
            "page_size": 4,
            "enable_return_routed_experts": True,
            "enable_lora": True,
            "max_lora_rank": 16,
            "lora_target_modules": ["q_proj", "v_proj"],
            "base_gpu_id": 4,
            "nnodes": 2,
            "node_rank": 1,
            "dist_init_addr": "node0:5000",
            "enable_metrics": True,
            "random_seed": 7,
            "weight_version": "0",
            "log_level": "warning",
            "api_key": "plain-secret",
            "admin_api_key": "admin-secret",
        }
        wrong = {k: (getattr(args, k, "<absent>"), v) for k, v in expected.items() if getattr(args, k, None) != v}
        if wrong:
            raise ValueError(f"parsed (got, want): {wrong}")
        if VERBOSE:
            print("     " + " ".join(cmd))

    check("launcher command parses with ServerArgs.add_cli_args; keys arrive via --config", launcher_check)

    def minimal_launcher_check() -> None:
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = parser.parse_args(SGLangLaunchSpec(model_path="/m").command()[3:])
        assert (args.model_path, args.port, args.tp_size) == ("/m", 30000, 1)

    check("minimal launcher command parses", minimal_launcher_check)

    def launcher_environment_check() -> None:
        # The variable the launcher sets is the one SGLang's sampler reads (its log-probs at temperature 1): read
        # from the installed source, since importing the sampler needs its GPU stack.
        import importlib.util

        env = SGLangLaunchSpec(model_path="/m").environment({})
        assert env == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}, env
        spec = importlib.util.find_spec("sglang.srt.layers.sampler")
        assert spec is not None and spec.origin is not None
        source = Path(spec.origin).read_text()
        for name in env:
            assert f'get_bool_env_var("{name}")' in source, f"sglang's sampler does not read {name}"

    check("launcher environment: variables SGLang's sampler reads", launcher_environment_check)
    check("every architecture preflight lets SGLang serve is an EntryClass of sglang.srt.models", archs_check)
    print(f"{len(FAILURES)} failed" if FAILURES else "all checks passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
