"""A stand-in for `python -m sglang.launch_server` in tests of OUR launcher (launch/workers.py, backend sglang): it
takes the command line SGLangLaunchSpec renders (SGLang's own argparse checks that line in the sglang tier) and
serves the model with our embedded engine, which speaks the same HTTP API. It tests process management (keys via
--config, waiting for /health, the rendezvous record, shutdown), not SGLang.

    sglang_standin.py -m sglang.launch_server --model-path M --host H --port P [--config F] [...]
    sglang_standin.py -c CODE    # preflight's probe of the interpreter: CODE runs with a stand-in `sglang` module

The stand-in's `sglang.__version__` is the release our schemas are checked against, marked as a stand-in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import types

if sys.argv[1:2] == ["-c"]:
    from miles_hpc.launch.preflight import SGLANG_MIN

    sys.modules["sglang"] = types.SimpleNamespace(__version__=".".join(map(str, SGLANG_MIN)) + "+standin")  # type: ignore[assignment]
    exec(sys.argv[2])
    sys.exit(0)

ap = argparse.ArgumentParser()
ap.add_argument("-m", dest="module", required=True)
ap.add_argument("--model-path", required=True)
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--config")
args, _rest = ap.parse_known_args()
assert args.module == "sglang.launch_server", args.module
# Our engine reports log-probs at temperature 1; SGLang does so only with this set (rollout/sglang.py, environment).
assert os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB") == "1", "launched without SGLANG_RETURN_ORIGINAL_LOGPROB=1"
argv = [sys.executable, "-m", "miles_hpc.cli", "serve", args.model_path, "--host", args.host, "--port", str(args.port)]
if args.config:  # SGLang's --config YAML: "api-key: <json string>" lines (rollout/sglang.py writes them)
    keys = dict(line.split(": ", 1) for line in open(args.config).read().splitlines() if line)
    tmp = tempfile.mkdtemp(prefix="standin-keys-")
    for flag in ("api-key", "admin-api-key"):
        if flag in keys:
            path = os.path.join(tmp, flag)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(json.loads(keys[flag]) + "\n")
            argv += [f"--{flag}-file", path]
os.execv(sys.executable, argv)
