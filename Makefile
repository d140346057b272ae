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
bench-gpu:
	PYTHONPATH=. python3 benchmarks/bench_rollout.py --device cuda
