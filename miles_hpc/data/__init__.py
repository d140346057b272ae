"""Data (stage: data; docs/formats.md): the `Sample` record, prompt datasets and tasks, HDF5 trajectory shards.

`sample`, `schema` (the shard layout, a contract), `store` (writer), `reader`, `inspect` (``miles-hpc inspect``),
`prompts`, `tasks` (built-in tasks), `terminal_env` (the reference multi-turn environment). Imports nothing of ours
but ``miles_hpc.config``.
"""

from miles_hpc.data.inspect import format_summary, summarize
from miles_hpc.data.reader import TrajectoryReader
from miles_hpc.data.sample import SCHEMA_VERSION, Sample, SampleError, SampleStatus, token_hash
from miles_hpc.data.schema import TrajectoryFileError
from miles_hpc.data.store import TrajectoryWriter

__all__ = [
    "SCHEMA_VERSION",
    "Sample",
    "SampleError",
    "SampleStatus",
    "TrajectoryFileError",
    "TrajectoryReader",
    "TrajectoryWriter",
    "format_summary",
    "summarize",
    "token_hash",
]
