# Thin wrappers; the scripts are the source of truth (they also work where make is not installed).
.PHONY: demo test test-fast lint test-gpu test-sglang bench-gpu bench-multi-gpu
demo:
	./scripts/demo.sh
test:
	./scripts/test.sh
test-fast:
	./scripts/test.sh --fast
lint:
	./scripts/lint.sh
# GPU targets use the python3 on PATH, which must have a CUDA/ROCm torch (the .venv holds the CPU build).
test-gpu:
	PYTHONPATH=. python3 -m pytest -q -m gpu
test-sglang:
	./scripts/test_sglang.sh
# One JSON line per result, each with its peer or physical reference measured in the same run (docs/benchmarks.md).
bench-gpu:
	PYTHONPATH=. python3 benchmarks/bench_rollout.py --device cuda --batches 64,1,8,256
	PYTHONPATH=. python3 benchmarks/bench_decode_attn.py --batches 1,8,64,256
	PYTHONPATH=. python3 benchmarks/bench_rollout.py --device cuda --shape qwen3-30b-a3b-12l --skip-hf --skip-prefix --batches 1,8,64 --new-tokens 128
	PYTHONPATH=. python3 benchmarks/bench_rollout.py --device cuda --shape qwen3-30b-a3b-12l --skip-hf --skip-prefix --batches 1,8,64 --new-tokens 128 --fused-moe
	PYTHONPATH=. python3 benchmarks/bench_prefill.py --device cuda
	PYTHONPATH=. python3 benchmarks/bench_train.py --steps 10
	PYTHONPATH=. python3 benchmarks/bench_zero_kl.py
	PYTHONPATH=. python3 benchmarks/bench_invariant_gemm.py --rows 64,8192
	PYTHONPATH=. python3 benchmarks/bench_weight_sync.py --only delta --device cuda --size 1b --steps 2 --lrs 1e-6 --group-mb 1024
	PYTHONPATH=. python3 benchmarks/bench_weight_sync.py --only codec --device cuda --codec-mb 1024
	PYTHONPATH=. python3 benchmarks/bench_weight_sync.py --only transfer --device cuda --strategies colocated \
		--engines 1 --transfer-size 7b --reps 3
	PYTHONPATH=. python3 benchmarks/bench_scan_kernels.py
# Issue 10's runs on a machine with 2 GPUs (4 for the last test and the last loop line); docs/benchmarks.md,
# "Across GPUs". Each line also prints its reference: NCCL all-reduce bus bandwidth, one-GPU tokens/s.
bench-multi-gpu:
	PYTHONPATH=. python3 -m pytest -q -m gpu tests/test_multi_gpu.py
	PYTHONPATH=. python3 benchmarks/collective_bw.py --ranks 2 --device cuda --mb 1024
	for size in 1.5b 7b; do PYTHONPATH=. python3 benchmarks/bench_weight_sync.py --only transfer --device cuda \
		--strategies broadcast,p2p,delta --engines 1 --transfer-size $$size --reps 3; done
	PYTHONPATH=. python3 benchmarks/bench_train.py --ranks 1 --sides eager,compiled --skip-hf
	PYTHONPATH=. python3 benchmarks/bench_train.py --ranks 2 --sides eager,compiled
	PYTHONPATH=. python3 benchmarks/bench_loop_sync.py --device cuda --trainer-ranks 1 --engines 1 --size 1.5b
	PYTHONPATH=. python3 benchmarks/bench_loop_sync.py --device cuda --trainer-ranks 2 --engines 2 --size 1.5b
