# Thin wrappers; the scripts are the source of truth (they also work where make is not installed).
.PHONY: demo test test-gpu bench-gpu
demo:
	./scripts/demo.sh
test:
	./scripts/test.sh
test-gpu:
	./scripts/test.sh -m gpu
