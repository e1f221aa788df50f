# Convenience targets; the scripts do the work.
#   make run                      set up, then the demo: the real-weights testbed MoE (built once, cached in
#                                 models/testbed/) answers a prompt from a memory budget that leaves most of
#                                 its experts in the file; ends with the tier split and hit/miss statistics
#   make run DEMO_ARGS='-p "Write a haiku about the sea." --expert-share 0.5'
.PHONY: setup run test fixtures clean
DEMO_ARGS ?=
setup:
	bash scripts/setup.sh
run: setup
	.venv/bin/python -m pyvis.demo $(DEMO_ARGS)
test:
	bash scripts/test.sh
fixtures: setup
	.venv/bin/pyvis fixtures
clean:
	rm -rf build build-cuda build-jetson models/fixtures
