"""The RL loops, read as the algorithm (stage: loop). Start reading at `sync.run`.

`sync` (one step: rollout -> rewards -> advantages -> train -> publish; `LoopContext`, what both loops share: batch
building, publish, metrics, checkpoints), `fully_async` (rollout and training at once) with `async_rollout`
(its producer and buffer), `rollout_step` (a step's groups of samples), `warmup` (supervised warm-up). The loops
start no process: `miles_hpc.launch` builds the context they are given.
"""
