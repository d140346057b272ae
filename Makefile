# Thin wrappers; the scripts are the source of truth (they also work where make is not installed).
.PHONY: demo test test-gpu test-sglang bench-gpu
demo:
	./scripts/demo.sh
test:
	./scripts/test.sh
# GPU targets use the python3 on PATH, which must have a CUDA/ROCm torch (the .venv holds the CPU build).
test-gpu:
	PYTHONPATH=. python3 -m pytest -q -m gpu
test-sglang:
	./scripts/test_sglang.sh
# One JSON line per result, each with its peer or physical reference measured in the same run (docs/benchmarks.md).
bench-gpu:
	PYTHONPATH=. python3 benchmarks/bench_rollout.py --device cuda
	PYTHONPATH=. python3 benchmarks/bench_train.py --steps 10
	PYTHONPATH=. python3 benchmarks/bench_zero_kl.py
	PYTHONPATH=. python3 benchmarks/bench_weight_sync.py --only delta --device cuda --size 1b --steps 2 --lrs 1e-6 --group-mb 1024
	PYTHONPATH=. python3 benchmarks/bench_weight_sync.py --only codec --device cuda --codec-mb 1024
	PYTHONPATH=. python3 benchmarks/bench_weight_sync.py --only transfer --device cuda --strategies colocated \
		--engines 1 --transfer-size 7b --reps 3
