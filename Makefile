# meshplan: `make demo` runs the main job, `make test` the test suite, `make bench` the benchmarks.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the project metadata changes. torch 2.13.0 first: on a CPU machine that is the
# CPU wheel, while a looser range may resolve to a multi-GB CUDA build. The engines extra (the
# engines' config loaders for the export tests) with torchtitan 0.2.2, the last with TOML job
# files, installed without its training dependencies (pyproject.toml says why); torchtitan 0.3.0,
# whose job is a Python config function, beside it in $(VENV)/torchtitan-0.3 with the one package its
# config modules import (spmd_types), for the test that loads the Python export with 0.3's ConfigManager.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.5,<2.14"
	$(PY) -m pip install -q -e ".[dev,hf,engines]"
	$(PY) -m pip install -q --no-deps "torchtitan==0.2.2"
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/torchtitan-0.3 "torchtitan==0.3.0" "spmd_types==0.2.3"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/meshplan demo --out-dir demo-out

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra tests

bench: $(STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; OMP_NUM_THREADS=1 $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) demo-out .pytest_cache build *.egg-info
