"""Compile every Triton kernel a CPU check launched, for real GPU targets, on a machine without a GPU.

Triton's interpreter (tests/conftest.run_interpreted) runs a kernel's Python on CPU tensors: it checks the numbers,
but never runs Triton's compiler, so a kernel can pass in CI and still fail to build on the first GPU it meets
(a construct the interpreter accepts and the code generator refuses, a block shape over a target's limits). This
module closes that gap without a GPU: while a check runs in the interpreter, `install_recorder` writes down each
launch (the kernel, its argument types, the constexpr values, which pointers and integers are 16-aligned, the
launch options); `main` then compiles each distinct launch with Triton's own compiler, all the way to the binary
(cubin through ptxas, hsaco through lld), for NVIDIA sm90 (H100/H200) and sm80 (A100), AMD gfx942 (MI300X) and
gfx950 (MI355X). Triton ships both back ends' tools in its wheel, so this runs on CI's CPU-only machine.

The argument types follow the runtime's specialisation closely enough for a compile check: a tensor is a pointer
to its dtype, marked 16-divisible when its address is; an int is i32 (i64 past 2**31) and 16-divisible when it is;
an int equal to 1 is a constexpr, as Triton specialises it; a float is fp32. What it does not prove: that the
compiled kernel runs correctly on the device (the -m gpu tier does that). Besides compiling, each build's shared
memory is held to the target's limit (`SHARED_LIMIT`), which a launch would otherwise fail on.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

RECORD_ENV = "MILES_TRITON_RECORD"
TARGETS = ("cuda:90", "cuda:80", "hip:gfx942", "hip:gfx950")
# Shared memory (LDS) one program may use: NVIDIA's per-block opt-in maximum (CUDA C++ Programming Guide, technical
# specifications per compute capability: 227 KB on 9.0, 163 KB on 8.0); AMD's LDS per CU (64 KB on CDNA3, 160 KB
# on CDNA4).
SHARED_LIMIT = {"cuda:90": 227 * 1024, "cuda:80": 163 * 1024, "hip:gfx942": 64 * 1024, "hip:gfx950": 160 * 1024}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
_DTYPES = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64", "int32": "i32",
    "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
}  # fmt: skip


def _arg(value: Any) -> tuple[str, Any, bool]:
    """(signature type, constexpr value or None, 16-divisible) of one non-constexpr argument."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        name = str(value.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"no Triton pointer type for a {name} tensor")
        return "*" + _DTYPES[name], None, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "i1", None, False
    if isinstance(value, int):
        if value == 1:
            return "constexpr", 1, False
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), None, value % 16 == 0
    if isinstance(value, float):
        return "fp32", None, False
    if value is None:
        return "constexpr", None, False
    raise TypeError(f"cannot type a {type(value).__name__} argument")


def launch_record(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """One launch of the Python kernel `fn` as a JSON-able record (module docstring)."""
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    params = inspect.signature(fn).parameters
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    aligned: list[int] = []
    for i, (name, value) in enumerate(bound.arguments.items()):
        note = params[name].annotation
        if "constexpr" in str(note):
            signature[name], constexprs[name] = "constexpr", value
            continue
        signature[name], const, divisible = _arg(value)
        if signature[name] == "constexpr":
            constexprs[name] = const
        elif divisible:
            aligned.append(i)
    return {
        "module": fn.__module__,
        "kernel": fn.__qualname__,
        "signature": signature,
        "constexprs": constexprs,
        "aligned": aligned,
        "options": options,
    }


def install_recorder(path: str | None = None) -> None:
    """Append every interpreted launch from now on to `path` (default $MILES_TRITON_RECORD) as a JSON line."""
    from triton.runtime.interpreter import InterpretedFunction

    out = path or os.environ[RECORD_ENV]
    run = InterpretedFunction.run

    def recording(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        rec = launch_record(self.fn, args, dict(kwargs))
        with open(out, "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording  # type: ignore[method-assign]


def _target(spec: str) -> Any:
    from triton.backends.compiler import GPUTarget

    backend, arch = spec.split(":")
    return GPUTarget("cuda", int(arch), 32) if backend == "cuda" else GPUTarget(backend, arch, 64)


def compile_record(rec: dict[str, Any], target: str) -> None:
    """Compile one recorded launch for `target` ("cuda:90", "hip:gfx942"), to the binary; raises on failure."""
    import triton
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(rec["module"]), rec["kernel"])
    attrs = {(i,): [["tt.divisibility", 16]] for i in rec["aligned"]}
    src = ASTSource(fn, signature=rec["signature"], constexprs=rec["constexprs"], attrs=attrs)
    kernel = triton.compile(src, target=_target(target), options=rec["options"])
    shared = int(kernel.metadata.shared)
    if shared > SHARED_LIMIT[target]:  # the launch would fail with OutOfResources on that GPU
        raise RuntimeError(f"needs {shared} bytes of shared memory; {target} has {SHARED_LIMIT[target]} per block")


def distinct(lines: list[str]) -> list[dict[str, Any]]:
    """One record per kernel, argument types, constexprs and options: of launches that differ only in which
    arguments are 16-aligned, the most aligned (the usual case on a GPU, where allocations are)."""
    best: dict[str, dict[str, Any]] = {}
    for line in lines:
        if not line:
            continue
        rec = json.loads(line)
        key = json.dumps({k: v for k, v in rec.items() if k != "aligned"}, sort_keys=True)
        if key not in best or len(rec["aligned"]) > len(best[key]["aligned"]):
            best[key] = rec
    return list(best.values())


_PRECISIONS = ("tf32", "tf32x3", "ieee", "bf16x3", "bf16x6")


@functools.cache
def _allowed_precisions(target: str) -> tuple[str, ...]:
    from triton.compiler.compiler import make_backend

    backend = make_backend(_target(target))
    return tuple(backend.parse_options({}).allowed_dot_input_precisions)


# Kernels that never run on a back end, and why (the check leaves those builds out).
NOT_BUILT_FOR = {
    ("miles_hpc.engine.triton_gemm", "_skinny_kernel", "hip"): "benchmark-only (bench_decode_gemm.py, not wired into "
    "the engine); its tiles and stages are sized for NVIDIA's shared memory and overflow an AMD CU's LDS",
}


def applies(rec: dict[str, Any], target: str) -> bool:
    """Whether the launch can happen on `target`: not for a kernel NOT_BUILT_FOR that back end, nor when one of
    its constexprs is a tl.dot precision that target's Triton back end refuses (the code picks another there:
    scan_kernels.gdn_precision, whose choice a check records separately)."""
    if (rec["module"], rec["kernel"], target.split(":")[0]) in NOT_BUILT_FOR:
        return False
    allowed = _allowed_precisions(target)
    return not any(v in _PRECISIONS and v not in allowed for v in rec["constexprs"].values() if isinstance(v, str))


def _compile(job: tuple[dict[str, Any], str]) -> str | None:
    rec, target = job
    try:
        compile_record(rec, target)
    except Exception as e:  # every failure is reported, with its launch
        head = " | ".join(str(e).strip().splitlines()[:6])
        return f"{rec['module']}.{rec['kernel']} for {target} {rec['constexprs']}: {type(e).__name__}: {head}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("records", help="the JSON lines install_recorder wrote")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    records = distinct(Path(args.records).read_text().splitlines())
    targets = args.targets.split(",")
    jobs = [(rec, t) for rec in records for t in targets if applies(rec, t)]
    start = time.monotonic()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        failures = [f for f in pool.map(_compile, jobs) if f is not None]
    took = time.monotonic() - start
    print(f"compiled {len(records)} kernel launches for {', '.join(targets)} ({len(jobs)} builds) in {took:.0f} s")
    for f in failures:
        print("FAILED", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
