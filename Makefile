# Launchers for the built-in synthetic task. Every GPU through torchrun when there are GPUs,
# else 2 CPU processes with gloo. Extra trainer flags: make train-free-fsdp ARGS="--max-steps 50"
PYTHON ?= python3
NGPU := $(shell nvidia-smi -L 2>/dev/null | grep -c GPU)
ifeq ($(NGPU),0)
  NPROC := 2
  TASK := --config configs/synthetic_cpu.toml
else
  NPROC := $(NGPU)
  TASK := --config configs/synthetic_gpu.toml
endif
STAMP := $(shell date +%Y%m%d-%H%M%S)
TORCHRUN := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC)

.PHONY: train-free-fsdp train-baseline-fsdp train-free train-baseline test clean

train-free-fsdp:
	$(TORCHRUN) train_fsdp.py $(TASK) --arch free --out-dir runs/free-fsdp-$(STAMP) $(ARGS)

train-baseline-fsdp:
	$(TORCHRUN) train_fsdp.py $(TASK) --arch baseline --out-dir runs/baseline-fsdp-$(STAMP) $(ARGS)

train-free:
	$(PYTHON) train_fsdp.py $(TASK) --strategy none --arch free --out-dir runs/free-$(STAMP) $(ARGS)

train-baseline:
	$(PYTHON) train_fsdp.py $(TASK) --strategy none --arch baseline --out-dir runs/baseline-$(STAMP) $(ARGS)

test:
	$(PYTHON) -m pytest -q tests

clean:
	rm -rf runs data_cache .pytest_cache __pycache__ tests/__pycache__
