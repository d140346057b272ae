"""Cluster: what a scheduler gives a run, as pure functions (stage: cluster; imports only ``miles_hpc.config``).

`bootstrap` (rank, world, local rank and master from Slurm, MPI or torchrun variables), `slurm` (the batch script of
a run: hetjob or split, house style), `sweep` (grid points of an array job and their report). Starting processes is
`miles_hpc.launch`'s.
"""
