"""Static cost of the weight-sync checksum kernels: compile them for a GPU target without a GPU (Triton's bundled
ptxas and nvdisasm) and count machine instructions per 8-byte word. One JSON line per kernel variant.

A count is not a timing: it bounds the issue time (instructions x words / the GPU's issue rate) and shows whether
loads and stores are vectorised, which is what decides if a pass over the weights can run at memory speed.

    python benchmarks/sass_count.py                 # sm_90 (H100/H200)
    python benchmarks/sass_count.py --arch 100      # another compute capability
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton

from miles_hpc.sync.wire import checksum_kernels


def sass_ops(cubin: bytes) -> collections.Counter[str]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    args = ap.parse_args()
    words_per_thread = checksum_kernels.BLOCK * checksum_kernels.ROWS / (checksum_kernels.WARPS * 32)
    for copy in (False, True):
        for aligned in (False, True):
            kernel = checksum_kernels.compile_for(args.arch, copy, aligned)
            ops = sass_ops(kernel.asm["cubin"])
            ptx = collections.Counter(re.findall(r"((?:ld|st)\.global(?:\.v\d)?)\.b64", kernel.asm["ptx"]))
            print(
                json.dumps(
                    {
                        "bench": "sass_count",
                        "kernel": "checksum_kernels._lane_sums_by_position",
                        "copy": copy,
                        "aligned_16": aligned,
                        "arch": args.arch,
                        "block_words": checksum_kernels.BLOCK,
                        # static counts: the multipliers (made once per program), the whole-block loop
                        # and the masked one, per word of one step; the loop alone is a part of it
                        "instructions_per_word": round(sum(ops.values()) / words_per_thread, 1),
                        "imad_per_word": round(ops["IMAD"] / words_per_thread, 1),
                        "global_memory_ops": dict(ptx),
                        "triton": triton.__version__,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
