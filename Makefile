# One command to set up and run the demo, one to set up and run the tests.
# torch==2.13.0 is installed first: that CPU build lies on this machine's disk,
# while a bare `torch` requirement would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP_FLAGS ?= -q

.PHONY: demo test test-core lint setup bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install $(PIP_FLAGS) torch==2.13.0
	$(BIN)/pip install $(PIP_FLAGS) -e '.[dev,dashboard,optuna,metrics]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/python examples/quickstart.py

# The Ray tests and the Ray-free tests at once, in two pytests (tests/run_suite.sh says why);
# PYTEST_ARGS go to both.
test: setup lint
	PY=$(BIN)/python bash tests/run_suite.sh $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

# The fast inner loop: every test that runs no Ray (the core, the Ray-free rules of the Tune layer).
test-core: setup
	$(BIN)/python -m pytest -q -m "not ray" $(PYTEST_ARGS)

# The fault loop (docs/design.md "Faults"): seeds 0..SEEDS-1, each a seeded fault in a seeded
# sweep on a local Ray; CHAOS_CLUSTER=1 runs them on a fake cluster (node loss too; minutes a seed).
SEEDS ?= 50
.PHONY: chaos
chaos: setup
	CHAOS_SEEDS=$(SEEDS) $(BIN)/python -m pytest -q -m chaos -k "many_seeds or fake_cluster" tests/test_chaos.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info

# chorus-torch 0.1.0 declares Python 3.13 but imports on 3.11: it goes into a
# folder of its own that only benchmarks/vs_chorus.py puts on sys.path, never
# into the package's dependencies.
CHORUS_TORCH_SITE := .bench-venv/site

$(CHORUS_TORCH_SITE)/chorus/__init__.py: $(BIN)/python
	$(BIN)/pip install $(PIP_FLAGS) --no-deps --ignore-requires-python --upgrade --target $(CHORUS_TORCH_SITE) chorus-torch==0.1.0

.PHONY: bench-chorus bench-step bench-tune bench-startup bench-overhead bench-mnist bench-cpu
bench-chorus: setup $(CHORUS_TORCH_SITE)/chorus/__init__.py
	mkdir -p benchmarks/results
	$(BIN)/python benchmarks/vs_chorus.py --threads 1 --json benchmarks/results/vs_chorus.json

bench-step: setup
	mkdir -p benchmarks/results
	$(BIN)/python benchmarks/fused_step.py --json benchmarks/results/fused_step.json

# docs/benchmarks.md's plain-Tune comparison, issue 18's rows in one invocation (32 width-64 MLPs on the
# synthetic set, the Tune way on both sides: a stop dict, no max_iterations; plain Tune, chorus_tune,
# the fused core; a warm-up per way, then 3 repeats interleaved, in rotated order, medians). The
# cheap ASHA row goes first: the warm-ups run on it. Then issue 19's mixed sweep (widths x dropout x
# lr x wd, ASHA). Writes JSON, a Markdown table and a PNG to benchmarks/reported/.
BENCH_TUNE_ROWS = asha:10:16,asha:10:32,stock-asha:10:16,fifo:10:16,fifo:10:32,fifo:40:16,fifo:40:32
bench-tune: setup
	$(BIN)/python benchmarks/vs_tune.py --workload synth-mlp64 --ways plain,chorus,fused \
	    --rows $(BENCH_TUNE_ROWS) --repeats 3 --warmup 1 --out benchmarks/reported --name vs_tune-synth-tune-way
	$(BIN)/python benchmarks/vs_tune.py --workload synth-mixed --ways plain,chorus,fused \
	    --rows asha:10:16 --repeats 3 --warmup 1 --out benchmarks/reported \
	    --name vs_tune-synth-mixed

# Ray's own tune/examples/mnist_pytorch.py, plain and ported (issue 39): as shipped (reuse_actors off) and
# with reuse_actors=True, each way a warm-up then 2 repeats interleaved (about 12 minutes on 2 cores).
bench-mnist: setup
	$(BIN)/python benchmarks/ray_mnist.py --repeats 2 --warmup 1 --out benchmarks/reported --name ray_mnist

# Tune's own cost per result, with and without its TensorBoard logger.
bench-overhead: setup
	mkdir -p benchmarks/results
	$(BIN)/python benchmarks/tune_overhead.py --json benchmarks/results/tune_overhead.json

# Where a sweep's CPU goes (docs/benchmarks.md "What Tune itself costs"): CPU-seconds per process role,
# plain Tune beside chorus_tune, on the 128-trial ChorusASHA row; another sweep: CPU_SWEEP="...".
CPU_SWEEP = --workload synth-mlp64 --trials 128 --rows asha:16:16
bench-cpu: setup
	mkdir -p benchmarks/results
	$(BIN)/python benchmarks/cpu_share.py --repeats 2 --json benchmarks/results/cpu_share.json \
	    --md benchmarks/results/cpu_share.md -- $(CPU_SWEEP)

bench-startup: setup
	mkdir -p benchmarks/results
	$(BIN)/python benchmarks/trial_startup.py --json benchmarks/results/trial_startup.json

# The guide's picture of Ray's dashboard (docs/dashboard-actors.png): the browser test's
# screenshot of the Actors page with a live bucket. Needs Chromium (apt-get install chromium).
.PHONY: screenshot
screenshot: setup
	@$(BIN)/python -c "import sys; sys.path.insert(0, 'tests'); from dashboard_support import find_chromium; \
	    sys.exit(find_chromium() is None and 'no Chromium binary: apt-get install chromium (or set CHROMIUM)')"
	rm -f docs/dashboard-actors.png
	CHORUS_SCREENSHOT=$(CURDIR)/docs/dashboard-actors.png $(BIN)/python -m pytest -q tests/test_dashboard_browser.py
	test -s docs/dashboard-actors.png
