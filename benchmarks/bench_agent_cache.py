"""The agents' prefix-cache hit rate against its ceiling (issue 27): multi-turn terminal-agent runs of
`configs/tiny_agent_cpu.yaml` (CPU, one embedded engine) at several `rollout.max_turns`, engine page sizes
(`rollout.page_size`) and run modes, the measured hit rate (cached / prompt tokens the engine reported, over all
stored conversations) beside the rate a perfect cache would give on the same requests.

The measured rate is SGLang's account (`cached_tokens` / `prompt_tokens` of every request sent, a request's hits
those of its first admission): with `sync.pause_mode=abort` a turn cut by a weight update is continued by a second
request (prompt + the tokens so far, recomputed after the update's cache flush); with `retract` / `in_place` the
engine re-prefills the request itself, a cost this account (like SGLang's) leaves out.

The ceiling is computed from the run's own trajectories. Every turn of a stored conversation is one request whose
prompt is the conversation up to that turn's first generated token (in pause mode abort, a turn whose tokens carry
two versions is two: the continuation's prompt holds the first part's tokens). A request can be served from the cache for the
longest prefix it shares with what was computed before it under the same weights (the engine flushes its cache on
every update): every earlier request's prompt and its generated tokens but the last, whose KV no one computes.
Requests are taken version by version, turn by turn within one (every conversation's turn 1, then every turn 2, ...),
an order that lets each hit all that any order could; in fully async mode a request whose first token came after an
update may have been admitted before it (the stored samples do not say when), so it may also hit what the previous
version computed. The ceiling is an upper bound, reached only by a cache of one-token pages that keeps everything. What never hits: each version's first request's whole prompt, the part of each
first turn that is the episode's own task, what each later turn adds (the tool message, its markup, the last
generated token), and in fully async mode every conversation's whole context after an update.
`ceiling_without_flush` is the same with the cache kept across updates (what the flush costs).

Prints one JSON line per run: ``{"mode", "turns", "page_size", "hit_rate", "ceiling", "of_ceiling",
"ceiling_without_flush", "never_hit_first_turns", "never_hit_later_turns" (the ceiling's misses: shares of the
prompt tokens), "hit_rate_per_step", "turns_played", "requests", "prompt_tokens",
"engine_prompt_tokens"}`` (the last two differ when a request was paused before its first token: it is not in the
stored turns, and the ceiling leaves it out).

    python benchmarks/bench_agent_cache.py                              # 4, 8, 16 turns x pages 16, 4, 1; sync
    python benchmarks/bench_agent_cache.py --turns 8 --page-sizes 1 --modes fully_async -- rollout.max_new_tokens=8
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from miles_hpc.data.reader import TrajectoryReader
from miles_hpc.data.sample import Sample

ROOT = Path(__file__).resolve().parents[1]


def requests_of(sample: Sample, split: bool = True) -> list[tuple[int, list[int], list[int]]]:
    """The requests that made it, as (weights version, prompt, generated): a turn is a run of loss_mask 1 (generated
    ids); `split` (pause mode abort): a turn whose ids carry two versions was aborted by a weight update and
    continued, one request each part (other pause modes keep one request, which the engine re-prefills itself)."""
    out: list[tuple[int, list[int], list[int]]] = []
    i, n = 0, len(sample.tokens)
    while i < n:
        if not sample.loss_mask[i]:
            i += 1
            continue
        j = i
        while j < n and sample.loss_mask[j] and (not split or sample.policy_version[j] == sample.policy_version[i]):
            j += 1
        out.append((int(sample.policy_version[i]), sample.tokens[:i], sample.tokens[i:j]))
        i = j
    return out


class PrefixSet:
    """Every prefix of every sequence added, by digest: `longest(ids)` is the longest prefix of ids held."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()

    @staticmethod
    def _digests(ids: list[int]) -> list[bytes]:
        h = hashlib.blake2b(digest_size=16)
        out = []
        for t in ids:
            h.update(t.to_bytes(4, "little"))
            out.append(h.copy().digest())
        return out

    def add(self, ids: list[int]) -> None:
        self.held.update(self._digests(ids))

    def longest(self, ids: list[int]) -> int:
        n = 0
        for d in self._digests(ids):
            if d not in self.held:
                break
            n += 1
        return n


def ceiling(
    samples: list[Sample], flush: bool = True, split: bool = True, straddle: bool = False
) -> tuple[int, int, int, int]:
    """(prompt tokens, of them a perfect cache could serve, of the misses those of first turns, requests) over these
    conversations' requests. Each weight version's requests are taken after the previous version's, turn by turn
    within a version. `flush`: each version's cache starts empty, as the engines flush it on every update. A request
    is known by the version of its first generated token; `straddle` (fully async: updates land while requests run)
    it may have been admitted before that update, so it may hit the previous version's cache too. Without `flush`
    one cache holds all."""
    reqs = [(r[0], turn, r) for s in samples for turn, r in enumerate(requests_of(s, split))]
    reqs.sort(key=lambda x: (x[0], x[1]))
    caches: dict[int, PrefixSet] = {}
    prompt = hit = first_miss = 0
    for version, turn, (_, ids, generated) in reqs:
        key = version if flush else 0
        mine = caches.setdefault(key, PrefixSet())
        earlier = caches.get(key - 1) if straddle else None
        got = max(mine.longest(ids), earlier.longest(ids) if earlier is not None else 0)
        prompt += len(ids)
        hit += got
        first_miss += len(ids) - got if turn == 0 else 0
        mine.add(ids + generated[:-1])
    return prompt, hit, first_miss, len(reqs)


def run(mode: str, turns: int, page: int, steps: int, extra: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "miles_hpc.cli", "run", str(ROOT / "configs" / "tiny_agent_cpu.yaml"), f"mode={mode}"]
    cmd += [f"steps={steps}", f"rollout.max_turns={turns}", f"rollout.page_size={page}", f"run_dir={out}", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    rates = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "prefix_cache_hit_rate" in m:
            rates[int(m["step"])] = float(m["prefix_cache_hit_rate"])
    samples = list(TrajectoryReader(out / "trajectories"))
    split = "pause_mode: abort" in (out / "config.yaml").read_text()  # continuations are requests of their own
    straddle = mode == "fully_async"
    prompt, hit, first_miss, requests = ceiling(samples, split=split, straddle=straddle)
    _, hit_kept, _, _ = ceiling(samples, flush=False, split=split)
    stored = sum(int(s.metadata["prompt_tokens"]) for s in samples)
    rate = sum(int(s.metadata["cached_tokens"]) for s in samples) / stored
    return {
        "mode": mode,
        "turns": turns,
        "page_size": page,
        "hit_rate": round(rate, 4),
        "ceiling": round(hit / prompt, 4),
        "of_ceiling": round(rate / (hit / prompt), 4),
        "ceiling_without_flush": round(hit_kept / prompt, 4),
        "never_hit_first_turns": round(first_miss / prompt, 4),
        "never_hit_later_turns": round((prompt - hit - first_miss) / prompt, 4),
        "hit_rate_per_step": [round(rates[k], 4) for k in sorted(rates)],
        "turns_played": round(sum(int(s.metadata["turns"]) for s in samples) / len(samples), 2),
        "requests": requests,
        "prompt_tokens": prompt,
        "engine_prompt_tokens": stored,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 4, 1])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["sync"], help="run modes (sync, fully_async)")
    ap.add_argument("overrides", nargs="*", help="more config overrides (after --)")
    args = ap.parse_args()
    extra = args.overrides or ["rollout.max_tool_output_chars=20", "rollout.max_new_tokens=8"]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            for turns in args.turns:
                for page in args.page_sizes:
                    row = run(mode, turns, page, args.steps, extra, Path(tmp) / f"{mode}_t{turns}_p{page}")
                    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
