"""Data (stage: data; docs/formats.md): the `Sample` record, prompt datasets and tasks, HDF5 trajectory shards.

`sample`, `schema` (the shard layout, a contract), `store` (writer), `reader`, `inspect` (``miles-hpc inspect``),
`verify` (content checks, ``inspect --verify``), `reconcile` (exactly-once shards at start-up), `prompts`, `tasks`
(built-in tasks), `terminal_env` (the reference multi-turn environment). Imports nothing of ours but
``miles_hpc.config``.
"""

from miles_hpc.data.inspect import format_summary, summarize
from miles_hpc.data.reader import TrajectoryReader
from miles_hpc.data.reconcile import Quarantined, ReconcileReport, reconcile_trajectories
from miles_hpc.data.sample import SCHEMA_VERSION, Sample, SampleError, SampleStatus, token_hash
from miles_hpc.data.schema import TrajectoryFileError
from miles_hpc.data.store import TrajectoryWriter
from miles_hpc.data.verify import Problem, verify_shards

__all__ = [
    "SCHEMA_VERSION",
    "Problem",
    "Quarantined",
    "ReconcileReport",
    "Sample",
    "SampleError",
    "SampleStatus",
    "TrajectoryFileError",
    "TrajectoryReader",
    "TrajectoryWriter",
    "format_summary",
    "reconcile_trajectories",
    "summarize",
    "token_hash",
    "verify_shards",
]
