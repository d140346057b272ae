"""Weight sync: the trainer's weights into the rollout engines, verified (stage: sync).

- `protocol` (`WeightSync`, errors, checksum verification), `publish` (pause -> push -> verify -> continue,
  failed engines dropped and re-admitted), `factory` (`sync.strategy` -> a strategy, `strategy_traits`).
- `strategies/`: one module per strategy (broadcast, p2p, delta, colocated, lora); each says what it sends, what
  its engines need at launch, which placement it requires, and its metrics (`strategies/base.py`).
- `codec/`: the BF16 delta codec and its file format, shared by trainer and engine.
- `wire/`: checksums, tensor handles, process groups (torch.distributed, MPI): the pieces the engine and the
  trainer both use. `wire` imports nothing of ours outside it, `codec` only `wire`; the engine imports these two
  sub-packages and nothing else of `sync` (tests/test_layout.py).
"""
