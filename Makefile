# flexrt: the two commands a new machine needs are `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
TORCH := torch==2.13.0
STAMP := $(VENV)/.flexrt-installed
DEMO_OUT ?= demo_out
PYTEST_LOG := .pytest-last.txt
PYTEST_WORKERS ?= 3

.PHONY: install demo test test-all test-busy sync-check nbtest pytest bench screenshots ds-tests gpu-check clean

install: $(STAMP)

# torch is installed first and pinned (a CPU build on these machines); setup.py keeps a range for users elsewhere.
$(STAMP): setup.py settings.ini
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# Executes examples/quickstart.ipynb headless (2 CPU ranks, the engine, the live dashboard) with nbclient; writes the
# executed notebook, the dashboard's plots (PNG) and its history (CSV) to $(DEMO_OUT)/; then examples/autotune.ipynb
# (the autotune widget searching ZeRO stage x micro-batch on 2 CPU ranks): its plots, trials and best config too.
demo: install
	OUT=$(DEMO_OUT) $(PY) examples/run_quickstart.py
	OUT=$(DEMO_OUT) $(PY) examples/run_autotune.py

# The last line says how much was skipped (pytest prints each skip's and expected failure's reason with -rsx; not
# -rs -rx: pytest keeps only the last -r). The generated config cases (tests/test_config_fuzz.py) run as a sample that
# keeps every field, block and wrong-type kind, the rest drawn with a new seed each run, printed (FLEXRT_FUZZ_SEED=<n>
# repeats a run).
test: install sync-check nbtest pytest
	@echo "make test: $$(grep -Eo '[0-9]+ skipped' $(PYTEST_LOG) | tail -1 || echo '0 skipped') and $$(grep -Eo '[0-9]+ xfailed' $(PYTEST_LOG) | tail -1 || echo '0 xfailed') in pytest (reasons listed above); nbtest runs notebook cells without the 'slow' flag"

# Nightly: `make test` with every generated config case (FLEXRT_FUZZ_ALL=1) instead of the sample.
test-all: export FLEXRT_FUZZ_ALL := 1
test-all: test

# `make test` three times in a row with a one-core busy loop running (CI machines are not always idle): each run's
# exit code, minutes and pytest summary (bench/busy_test.py; --runs N for another count).
test-busy: install
	$(PY) bench/busy_test.py --runs 3

# Notebooks are the source: cleaning and exporting them must change nothing in nbs/ or flexrt/.
sync-check: install
	$(PY) tools/check_sync.py

nbtest: install
	$(BIN)/nbdev_test --flags multiproc --n_workers 2 --timing

# pytest exits 5 when it collects nothing; make treats that as a failure, as it should. The 20 slowest tests are listed
# (the suite must stay under 15 minutes on a quiet 2-core machine). Three pytest-xdist workers take whole files
# (--dist loadfile: a file's module fixtures are built once), longest first (tests/conftest.py's SLOW_FILES): much of
# the suite waits (ranks on each other, subprocesses, kernels, servers, a browser): one worker left about 40 % of two
# cores idle; on a fresh clone two took pytest 939 s, three 796 and 749 s with 14 % of the cores still idle.
# PYTEST_WORKERS=0 runs in one process.
# tests/test_browser.py installs Debian's Chromium with apt-get on first use (root), or skips saying why it cannot.
# tests/test_deepspeed_parity.py runs the pinned DeepSpeed (dev extra) on CPU next to flexrt.
pytest: install
	DS_ACCELERATOR=cpu $(PY) -m pytest tests -q -rsx -p no:cacheprovider --durations=20 -n $(PYTEST_WORKERS) --dist loadfile | tee $(PYTEST_LOG)

# On a machine with a GPU (CI has none): flexrt's CUDA paths on one GPU, one rank over NCCL (tools/gpu_check.py): the
# engine at every stage and precision against plain torch, fp16 overflow, the non-finite watch, checkpoints across
# devices, the memory model against the measured CUDA peak, the comms logger's CUDA timing. Prints a table.
gpu-check: install
	$(PY) tools/gpu_check.py

# The README's pictures are the browser tests' screenshots of real pages (JupyterLab and Voila in Chromium), taken
# while two ranks train (`*_live.png`), after Stop (`*_dashboard.png`) and after an autotune search (`*_autotune.png`),
# and the step anatomy of a saved dashboard page naming a planted slow rank (`step_anatomy.png`); this refreshes them
# in docs/images/.
screenshots: install
	FLEXRT_ARTIFACTS=docs/images $(PY) -m pytest tests/test_browser.py tests/test_browser_autotune.py \
		tests/test_anatomy.py::test_the_dashboard_names_the_slowed_rank_on_the_page_a_browser_shows -q -p no:cacheprovider

# The documentation site, built into _docs/ without Quarto (tools/docs.py: nbdev's processors, then nbconvert; of the
# cells, only exported ones, show_doc calls and imports run): a page per notebook with its API entries, its demos'
# saved outputs (`make outputs`) and folded tests, getting started, architecture, contents by wing.
# Open _docs/index.html. Fails naming notebook and cell.
.PHONY: docs outputs format
docs: install
	$(PY) tools/docs.py

# The demos' outputs the site shows are saved in the notebooks: this runs every notebook as nbtest does and saves what
# each demo cell (not exported, not a test) printed or displayed; every other cell's outputs are cleared
# (tools/outputs.py; NBS="nbs/65_engine.ipynb ..." for some). Run it after changing a demo, and commit the notebooks.
NBS ?=
outputs: install
	$(PY) tools/outputs.py $(NBS)

# Notebooks are formatted with ruff (ruff.toml: 120 columns, one statement per line); run it after editing, then export.
format: install
	$(BIN)/ruff format nbs
	$(BIN)/nbdev_export

# The peers (DeepSpeed) come with the `bench` extra; each script prints ratios measured in one run.
bench: install
	$(PY) -m pip install -q -e ".[bench]"
	for b in bench/*.py; do echo "== $$b"; DS_ACCELERATOR=cpu $(PY) $$b; done

# DeepSpeed's own unit tests (the 17 files of tools/ds_tests.py) on CPU, gloo: make ds-tests DS=/path/to/DeepSpeed.
# Nothing is fetched. By default each file runs under the installed DeepSpeed and under flexrt in its place and a
# markdown table compares them (DS_ARGS="--ranks 2 --compare --markdown"); DS_ARGS=--real: DeepSpeed only; DS_ARGS=: flexrt only.
DS_ARGS ?= --ranks 2 --compare --markdown
ds-tests: install
	@test -n "$(DS)" || { echo "usage: make ds-tests DS=/path/to/a/DeepSpeed/checkout [DS_ARGS='--ranks 2 --compare --markdown']"; exit 2; }
	PYTHONPATH=$(CURDIR) $(PY) tools/ds_tests.py $(DS) $(DS_ARGS)

clean:
	rm -rf $(VENV) _proc _docs .pytest_cache $(DEMO_OUT) $(PYTEST_LOG)
