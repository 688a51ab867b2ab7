# Two entry points on a fresh machine: `make run` (set up + default experiment), `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= config/config.yaml
MODEL ?= $(shell $(PY) -c "import yaml;print(yaml.safe_load(open('$(CONFIG)'))['model'])" 2>/dev/null || echo gemma3)

.PHONY: setup run test lint report clean

$(BIN)/segback: pyproject.toml
	@if [ "$$(uname -s)" = Linux ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && apt-get install -y -qq libopenblas0-pthread; fi
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[experiment,dev]"
	@touch $@

setup: $(BIN)/segback

# Snakemake reads --configfile files before the Snakefile runs and names no file for a YAML
# syntax error: segback's check names the file, line and column first.
run: setup
	$(BIN)/python -m segback.experiment.config_check $(CONFIG)
	$(BIN)/snakemake results/$(MODEL)_chunk_score.json --cores all --rerun-incomplete --configfile $(CONFIG)

report: setup
	$(BIN)/python -m segback.experiment.config_check $(CONFIG)
	$(BIN)/snakemake results/$(MODEL)_chunk_score.json --cores all --report results/report.html --configfile $(CONFIG)

test: setup
	$(BIN)/ruff check segback tests
	LD_PRELOAD=$$(ls /usr/lib/*/openblas-pthread/libblas.so.3 2>/dev/null | head -n1) \
		$(BIN)/python -m pytest -q tests

lint: setup
	$(BIN)/ruff check segback tests

clean:
	rm -rf results/* .snakemake
