# Launchers for the built-in synthetic task. Every GPU through torchrun when there are GPUs,
# else 2 CPU processes with gloo. Extra trainer flags: make train-free-fsdp ARGS="--max-steps 50";
# the run directory: make train-free-fsdp RUN=runs/mine (see run_dir below).
PYTHON ?= python3
NGPU := $(shell nvidia-smi -L 2>/dev/null | grep -c GPU)
NPROC := $(if $(filter 0,$(NGPU)),2,$(NGPU))
TASK := --config configs/synthetic.toml
STAMP := $(shell date +%Y%m%d-%H%M%S)
TORCHRUN := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC)

.PHONY: train-free-fsdp train-baseline-fsdp train-free train-baseline kappa-sweep plot export sample bench test lint clean

# Each training target ends with the synthetic-task demonstration (sample.py --demo), which
# reads the same run directory: RUN given on the command line (not --out-dir in ARGS), else a
# new one per launch (an exported RUN in the environment is not taken).
run_dir = $(if $(filter command line,$(origin RUN)),$(RUN),runs/$(1)-$(STAMP))

train-free-fsdp:
	$(TORCHRUN) train_fsdp.py $(TASK) --arch free --out-dir $(call run_dir,free-fsdp) $(ARGS)
	$(PYTHON) sample.py --ckpt $(call run_dir,free-fsdp) --demo

train-baseline-fsdp:
	$(TORCHRUN) train_fsdp.py $(TASK) --arch baseline --out-dir $(call run_dir,baseline-fsdp) $(ARGS)
	$(PYTHON) sample.py --ckpt $(call run_dir,baseline-fsdp) --demo

train-free:
	$(PYTHON) train_fsdp.py $(TASK) --strategy none --arch free --out-dir $(call run_dir,free) $(ARGS)
	$(PYTHON) sample.py --ckpt $(call run_dir,free) --demo

train-baseline:
	$(PYTHON) train_fsdp.py $(TASK) --strategy none --arch baseline --out-dir $(call run_dir,baseline) $(ARGS)
	$(PYTHON) sample.py --ckpt $(call run_dir,baseline) --demo

# Free-bits sweep on the synthetic task: kappa in bits per token (converted to nats). Ends with
# the table (runs/kappa-sweep-STAMP.md) and the plot beside it (.png; needs matplotlib).
KAPPA_BITS ?= 0.015625 0.125 0.5 2 4
kappa-sweep:
	@$(PYTHON) -c "import matplotlib" 2>/dev/null || { echo "error: make kappa-sweep ends with a plot: pip install matplotlib" >&2; exit 2; }
	@for k in $(KAPPA_BITS); do \
	  nats=$$($(PYTHON) -c "import math; print($$k * math.log(2))"); \
	  $(TORCHRUN) train_fsdp.py $(TASK) --arch free --kappa $$nats --out-dir runs/kappa-$$k-$(STAMP) $(ARGS) || exit 1; \
	  $(PYTHON) sample.py --ckpt runs/kappa-$$k-$(STAMP) --demo || exit 1; \
	done; \
	$(PYTHON) runs_report.py $(foreach k,$(KAPPA_BITS),runs/kappa-$(k)-$(STAMP)) --table | tee runs/kappa-sweep-$(STAMP).md
	$(PYTHON) runs_report.py $(foreach k,$(KAPPA_BITS),runs/kappa-$(k)-$(STAMP)) -o runs/kappa-sweep-$(STAMP).png

# One PNG of runs' metrics.jsonl, overlaid (needs matplotlib): make plot RUNS="runs/a runs/b" [PLOT=cmp.png]
PLOT ?= runs/plot.png
plot:
	$(PYTHON) runs_report.py $(RUNS) -o $(PLOT)

# Consolidate a sharded checkpoint into one file: make export CKPT=runs/RUN/checkpoints/step_N
export:
	$(PYTHON) train_fsdp.py --export $(CKPT)

# Sample from a run: make sample CKPT=runs/free-fsdp-... [SAMPLE_ARGS="--fixed-z --prompt K>"]
sample:
	$(PYTHON) sample.py --ckpt $(CKPT) $(SAMPLE_ARGS)

# GPU benchmarks (bench.py's docstring lists the suites): make bench SUITE=multi [BENCH_ARGS="--memory-cap-gib 78"]
SUITE ?= single
bench:
	$(PYTHON) bench.py --suite $(SUITE) $(BENCH_ARGS)

# Two workers (pytest-xdist), each test file on one of them, so that its module fixtures run once; the longest
# files first (tests/conftest.py).
test:
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

# ruff's settings are in pyproject.toml; CI runs this before the tests.
lint:
	@$(PYTHON) -m ruff --version >/dev/null 2>&1 || { echo "error: make lint needs ruff: pip install ruff" >&2; exit 2; }
	$(PYTHON) -m ruff check .

clean:
	rm -rf runs data_cache .pytest_cache __pycache__ tests/__pycache__

# Plants each bug of tools/mutants.py in a scratch copy, one at a time, and reports which ones the tests
# catch (by hand, not part of make test): make mutants [MUTANTS_ARGS="--only ID,... --baseline --cpu 1"]
.PHONY: mutants
mutants:
	$(PYTHON) tools/mutants.py $(MUTANTS_ARGS)
