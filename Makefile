# The README's two commands: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo_out

.PHONY: demo test install clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip wheel setuptools
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dprec demo --out $(DEMO_DIR)

test: $(STAMP)
	$(PY) -m pytest -n 2 -q tests

clean:
	rm -rf $(VENV) $(DEMO_DIR) build *.egg-info
