"""Data stage: the Sample record, prompt datasets and the HDF5 trajectory store (DESIGN section 7).

Imports nothing of ours but ``miles_hpc.config`` (DESIGN section 2).
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
