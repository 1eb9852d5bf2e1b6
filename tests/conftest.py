"""The suite's environment, inherited by the processes its tests start: one compile cache for the whole suite
(the trainer's default puts it beside each run directory, which in tests is a fresh temporary directory, so every
compiled test would compile cold; tests/test_compile_cache.py removes it to test the default), inductor's CPU
kernels without SIMD, and one thread per process. Then the order in which make test's workers take the files."""
import os
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "torchinductor_suite"))
# Inductor's CPU kernels without SIMD: g++ builds them with about a quarter less CPU, and the kernels are the same on
# AVX2 and AVX-512 machines. The tests check what is compiled, when, and its losses; not the kernels' speed.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# One thread per process: make test's two workers and the runs they start share 2 cores, and a second OpenMP thread
# only spins against the other worker (torch reads this when it loads, after conftest).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# make test's two workers (pytest-xdist, a file each, --no-loadscope-reorder) take the files in this order, the
# longest first, so that neither is left running a long one alone at the end (xdist's default order, by number of
# tests, puts the single 90-second tests last).
LONGEST_FIRST = ["test_checkpoint.py", "test_free_eval.py", "test_free_training.py", "test_train_misc.py",
                 "test_compile_cache.py", "test_slurm.py", "test_distributed.py", "test_seams.py", "test_fsdp2.py",
                 "test_multinode.py", "test_model.py", "test_hostile.py", "test_trackers.py",
                 "test_reliability_trainer.py", "test_generate.py", "test_latent_use.py",
                 "test_keep_best_async_save.py", "test_convert_to_hf.py", "test_muon.py", "test_config.py"]


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: a file's tests keep their order
