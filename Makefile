# The README's two commands: `make demo` and `make test`. Both set up .venv themselves.
# `make test-legacy` runs the suite on the peer stack (TF 2.15 + tensorflow-privacy) in .venv-legacy,
# where the peer tests must run, not skip; CI (.ci/run) runs both.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LEGACY_VENV := .venv-legacy
LEGACY_STAMP := $(LEGACY_VENV)/.installed
DEMO_DIR ?= demo_out


.PHONY: demo test lint test-faults test-legacy install clean docs bazel

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip wheel setuptools
	$(PY) -m pip install -q -e ".[test,kerasrs]"
	touch $(STAMP)

$(LEGACY_STAMP): setup.py
	test -x $(LEGACY_VENV)/bin/python || $(PYTHON) -m venv $(LEGACY_VENV)
	$(LEGACY_VENV)/bin/python -m pip install -q --upgrade pip wheel setuptools
	$(LEGACY_VENV)/bin/python -m pip install -q -e ".[tfp,test]"
	touch $(LEGACY_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dprec demo --out $(DEMO_DIR)

# ruff (ruff.toml: pyflakes and pycodestyle at 100 columns) first, then the suite. Three xdist
# workers on two cores: with two, the suite kept the CPU 155% busy (its tests wait on the
# processes, clusters and Beam jobs they start).
test: lint
	$(PY) -m pytest -n 3 --maxschedchunk 2 -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Parameter-server fault tests alone (processes killed mid-run; minutes each).
test-faults: $(STAMP)
	$(PY) -m pytest -p no:xdist -q -m faults tests

# The legacy leg runs the library's tests on TF 2.15, the peer tests among them (required there);
# what drives dprec's commands end to end, the clusters and the fault tests run on the default leg.
test-legacy: $(LEGACY_STAMP)
	DPREC_REQUIRE_PEERS=1 $(LEGACY_VENV)/bin/python -m pytest -n 2 --maxschedchunk 2 -q \
	  -m "not faults and not commands and not multiprocess" tests

# The API reference from the docstrings (warnings are errors; tests/test_api_docs.py builds it too).
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -E -q -b html docs/api build/api

clean:
	rm -rf $(VENV) $(LEGACY_VENV) $(DEMO_DIR) build *.egg-info

# Bazel (Debian's bazel-bootstrap, offline: see WORKSPACE): every BUILD target builds, and the
# privacy and DP-core tests run under `bazel test` with this venv's interpreter first on PATH.
bazel: $(STAMP)
	bazel build //...
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bazel test --local_test_jobs=2 //tests/privacy/... //tests/dp_core/...
