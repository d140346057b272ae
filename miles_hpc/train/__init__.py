"""Training (stage: train): the `Trainer` protocol and its two backends. Never imports `rollout`.

`protocol` (the verbs the loop and weight sync use), `fsdp` (torch FSDP2, the default) and `megatron` with
`mcore_*` (megatron-core's GPTModel on our HF weights: TP/PP/EP, dist checkpoints), `batch`, `packing`,
`logprobs` and `logprob_kernels`, `losses`, `advantages`, `optim`, `step`, `checkpoint`, `dist` (the trainer
world), `shards` (what each rank holds, for p2p sync).
"""
