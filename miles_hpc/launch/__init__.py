"""Launch: where the processes of a run come from and how they are supervised (not the algorithm: that is `loop/`).

`controller` (trainer rank 0 drives the loop; `run_local` = `miles-hpc run`), `workers` (what srun / mpirun /
torchrun start: `miles-hpc prepare` and `miles-hpc worker --role ...`), `local` (engine servers and trainer ranks
as local subprocesses, GPU placement), `trainer_ranks` (the controller's fan-out of trainer verbs to every rank),
`submitit_jobs`, `run_dir`, `smoke`, `export`. Everything started here is stopped by handle, never by name.
"""
