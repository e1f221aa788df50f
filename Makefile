# Convenience targets; the scripts do the work.
.PHONY: setup run test fixtures clean
setup:
	bash scripts/setup.sh
run: setup
	.venv/bin/pyvis generate
test:
	bash scripts/test.sh
fixtures: setup
	.venv/bin/pyvis fixtures
clean:
	rm -rf build build-cuda build-jetson models/fixtures
