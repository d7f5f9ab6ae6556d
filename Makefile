# The two commands of the README. Both build the virtual environment from nothing (idempotent:
# pip only runs again when requirements.lock or pyproject.toml change).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Offline hygiene: nothing may phone home or fetch from a model hub.
export HF_HUB_OFFLINE=1
export DO_NOT_TRACK=1
export MLFLOW_DISABLE_TELEMETRY=true
export PREFECT_SERVER_ANALYTICS_ENABLED=false
# llama-cpp-python ships no wheel: pip builds it from source (~5 min on 2 cores, cached per machine).
# Portable CPU code and no multimodal helper keep the build short and the wheel runnable anywhere.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF

.PHONY: demo test install clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is named explicitly so pip takes the CPU build instead of a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0 -c requirements.lock
	$(BIN)/pip install --quiet -c requirements.lock -e '.[test]'
	touch $@

demo: install
	$(BIN)/dxr demo

# Two pytest workers (pytest-xdist), each given whole test files so that a module's fixtures are built once: on 2
# cores the suite took 13-19 min on 2026-12-07, by how busy the host was, against 23-26 min in one process the same
# day. The suite is CPU-bound: a third worker took 1,329 s against two's 1,397 s back to back, within the noise.
# Files go in collection order (alphabetical): xdist's default hands out the files with the most tests first, which
# leaves test_demo.py (with its one long test) to run alone at the end: replaying one run's per-file times on two
# workers gave 1,173 s in xdist's order against 1,083 s in this one.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV)
