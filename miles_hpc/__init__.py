"""miles-hpc: RL post-training of LLMs, native to HPC batch schedulers (Slurm, MPI), no Ray."""

__version__ = "0.1.0"
