"""--compile on the CPU: an evaluation compiles nothing (it runs eager, so its loss is the uncompiled
model's), and the compile cache lives beside the run directory: a resume under another TMPDIR, as a
requeue to another node has, reuses every graph of the first launch; a run of another model beside it
compiles its own. The start-up line says where the start-up went and what the cache gave."""
import json
import os
import re
import subprocess
import sys

import script_runner
import torch

from test_distributed import ROOT, clean_env

sys.path.insert(0, ROOT)
import data as data_lib  # noqa: E402
import model as model_lib  # noqa: E402

TINY = ["--arch", "baseline", "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--global-batch", "8",
        "--log-every", "1", "--eval-every", "1", "--eval-samples", "16", "--param-dtype", "fp32",
        "--warmup-steps", "2", "--strategy", "none", "--compile"]
CACHE_LINE = re.compile(r"compile cache (\S+): (\d+) graphs reused, (\d+) compiled")


def train(run_dir, tmp=None, extra=()):
    """One launch with dynamo's recompilations logged (TORCH_LOGS=recompiles), in TMPDIR tmp (None: this one's,
    where the suite's other compiles left inductor's precompiled C++ header)."""
    env = {k: v for k, v in clean_env().items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(TORCH_LOGS="recompiles")
    if tmp:
        os.makedirs(tmp, exist_ok=True)
        env.update(TMPDIR=str(tmp))
    res = subprocess.run([sys.executable, "train_fsdp.py", *TINY, "--out-dir", str(run_dir), *extra], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "Recompiling" not in res.stdout + res.stderr  # the evaluations (one a step) compiled nothing
    startup = next(line for line in res.stdout.splitlines() if line.startswith("start-up:"))
    for phase in ("setup and data", "model and wrapping", "run directory and checkpoint", "first step"):
        assert re.search(phase + r" \d+\.\d s", startup), startup
    cache, reused, compiled = CACHE_LINE.search(startup).groups()
    return cache, int(reused), int(compiled)


def test_evaluation_compiles_nothing_and_a_resume_reuses_the_compile_cache(tmp_path):
    run_dir = tmp_path / "a"
    cache, reused, compiled = train(run_dir, None, ["--max-steps", "2"])
    assert cache == str(tmp_path / ".compile_cache") and os.path.isdir(cache)
    assert reused == 0 and compiled >= 2  # forward and backward at least
    again = train(run_dir, tmp_path / "tmp", ["--max-steps", "4"])  # resumed from step 2, another TMPDIR
    assert again == (cache, compiled, 0)
    # Another model beside it (one more block: the same kernels, another graph) shares the cache and compiles
    # its own graphs (the loss's may be reused).
    other = train(tmp_path / "b", None, ["--max-steps", "1", "--n-layer", "2"])
    assert other[0] == cache and other[2] >= 2

    # The logged validation loss of step 4 is the uncompiled model's, to fp32 rounding.
    payload = torch.load(run_dir / "checkpoints" / "step_0000004" / "model.pt", weights_only=True)
    model = model_lib.build_model(model_lib.ModelConfig(**payload["config"]["model"])).eval()
    model.load_state_dict(payload["model"])
    x, y = data_lib.open_dataset(data_lib.DataConfig(**payload["config"]["data"]), 1337).val_batch(0, 16)
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).item()
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert abs(ce - logged[-1]["val_loss"]) <= 1e-6 * ce


def test_a_compile_cache_that_cannot_be_made_is_one_line_and_nothing_is_written(tmp_path):
    """--compile-cache under a regular file: one error line and exit 2 before the run directory
    exists, not a traceback at the first step's compile."""
    (tmp_path / "file").write_text("")
    args = [*TINY, "--compile-cache", tmp_path / "file" / "cache", "--out-dir", tmp_path / "run"]
    res = script_runner.run(os.path.join(ROOT, "train_fsdp.py"), args, ROOT, clean_env())
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"error: compile cache {tmp_path / 'file' / 'cache'}: Not a directory; give --compile-cache a "
        "directory this process can create and write"]
    assert sorted(os.listdir(tmp_path)) == ["file"]
