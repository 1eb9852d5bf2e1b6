"""Checkpoints of train_fsdp.py on CPU with gloo: exact resume, resharding to other world sizes
and strategies, kill -9 during a save, SIGTERM/SIGUSR1, corrupted checkpoints, a full disk,
--export, config-change refusal, --init-from, non-finite losses, keep-K, and checkpoints that
hold a pickle which would run code (refused by every load path; nothing runs).

An interruption is simulated deterministically: a reference run of 10 steps saves at 3, 6, 9
and 10; a copy of its run directory loses the checkpoints after step 6 (latest -> step 6) and
the same command is run again on the copy. It must resume at step 6 and reproduce steps 7-10.

Runs that end with exit 0 share a few launches of tests/dist_driver.py (torch starts once per
process, not once per run): `ref2` (2 processes, the references), `four` (4 processes),
`res2` (2 processes, resumes) and `one` (1 process). Signals and kills need real processes: those
start train_fsdp.py directly; the resumes after them run forked, as launch()'s ranks do (run_ranks()).
"""
import collections
import concurrent.futures
import copyreg
import json
import math
import os
import pickle
import re
import shutil
import signal
import sys
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import script_runner  # noqa: E402

import ckpt_export  # noqa: E402
import data as data_lib  # noqa: E402
import model as model_lib  # noqa: E402
import train_fsdp  # noqa: E402
from test_distributed import TINY, assert_same, clean_env, launch, rank_envs, run_ranks  # noqa: E402

R = ["--max-steps", "10", "--save-every", "3", "--keep-checkpoints", "4"]  # checkpoints 3, 6, 9, 10
VARIANTS = {  # test 1: every one resumed at the same world size must be bit-identical
    "FULL_SHARD": [],
    "SHARD_GRAD_OP": ["--sharding-strategy", "SHARD_GRAD_OP"],
    "NO_SHARD": ["--sharding-strategy", "NO_SHARD"],
    "HYBRID_SHARD": ["--sharding-strategy", "HYBRID_SHARD"],
    "_HYBRID_SHARD_ZERO2": ["--sharding-strategy", "_HYBRID_SHARD_ZERO2"],
    "accum_no_sync": ["--micro-batch", "2", "--grad-accum-mode", "no_sync"],
    "accum_sync": ["--micro-batch", "2", "--grad-accum-mode", "sync"],
    "full": ["--checkpoint-type", "full"],
    "ddp": ["--strategy", "ddp"],
    "free": ["--arch", "free", "--latent-bits", "4"],
    "fp16": ["--param-dtype", "fp16", "--reduce-dtype", "fp16"],  # with ShardedGradScaler's state
    "fsdp2": ["--strategy", "fsdp2"],
    "fsdp2_fp16": ["--strategy", "fsdp2", "--param-dtype", "fp16", "--reduce-dtype", "fp16"],  # amp GradScaler
}
STRATEGY_ARGS = {s: ["--strategy", s] for s in ("fsdp", "ddp", "fsdp2", "none")}
# Cross-backend resumes: (run, where it runs, the backend that saved the checkpoint); every
# checkpoint of none / ddp / fsdp / fsdp2 resumes under every other one, at other world sizes too.
CROSS = [(f"{to}_from_{saver}", "res2", saver) for saver in ("fsdp", "ddp", "fsdp2", "none")
         for to in ("fsdp", "ddp", "fsdp2") if to != saver]
CROSS += [("none_from_fsdp", "one", "fsdp"), ("none_from_ddp", "one", "ddp"), ("none_from_fsdp2", "one", "fsdp2"),
          ("fsdp2_from_fsdp", "four", "fsdp"), ("fsdp2_from_full", "res2", "full")]
KILL_ARGS = ["--max-steps", "12", "--save-every", "1"]   # test 3
SIGNAL_ARGS = ["--max-steps", "20"]                      # test 4
NONFINITE = ["--lr", "1e6", "--grad-clip", "0", "--save-every", "1", "--max-steps", "20"]  # test 10


# =============================================================================================
# Helpers


def ckpt_root(run_dir):
    return os.path.join(str(run_dir), "checkpoints")


def latest_name(run_dir):
    with open(os.path.join(ckpt_root(run_dir), "latest")) as fh:
        return fh.read().strip()


def records(run_dir):
    with open(os.path.join(str(run_dir), "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def loss_steps(run_dir):
    return [r["step"] for r in records(run_dir) if "loss" in r]


def losses_of(run_dir):
    return [r["loss"] for r in records(run_dir) if "loss" in r]


def tokens_seen_of(run_dir):
    """(step, tokens_seen) of every step record, and the tokens_seen of every checkpoint's meta."""
    steps = [(r["step"], r["tokens_seen"]) for r in records(run_dir) if "loss" in r]
    metas = {n: train_fsdp.check_checkpoint(os.path.join(ckpt_root(run_dir), n))["tokens_seen"]
             for n in train_fsdp.complete_checkpoints(ckpt_root(run_dir))}
    return steps, metas


def assert_same_tokens_seen(run_dir, ref_dir):
    """Guards issue 13 bug 8: after a resume, tokens_seen (every logged step, and the meta of
    every checkpoint the two runs both hold) equals the uninterrupted run's."""
    steps, metas = tokens_seen_of(run_dir)
    ref_steps, ref_metas = tokens_seen_of(ref_dir)
    assert steps == ref_steps, (steps, ref_steps)
    common = set(metas) & set(ref_metas)
    assert common, (metas, ref_metas)
    assert {n: metas[n] for n in common} == {n: ref_metas[n] for n in common}


def log_text(run_dir):
    with open(os.path.join(str(run_dir), "training_log.txt")) as fh:
        return fh.read()


def resumed_step(run_dir):
    """The step of the last 'resumed from' line of the run's log."""
    found = re.findall(r"resumed from \S*step_(\d{7})", log_text(run_dir))
    assert found, log_text(run_dir)[-3000:]
    return int(found[-1])


def leftovers(run_dir):
    """Temporary or half-swapped directories a save may leave behind."""
    return [n for n in os.listdir(ckpt_root(run_dir)) if n.startswith(".tmp-") or n.endswith(".old")]


def snapshot(run_dir):
    """Every file of a run directory with its bytes."""
    out = {}
    for d, _, files in os.walk(str(run_dir)):
        for f in files:
            path = os.path.join(d, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, str(run_dir))] = fh.read()
    return out


def interrupted_copy(src, dst, at=6):
    """A copy of a finished run as if it had been stopped right after saving step `at`."""
    shutil.copytree(src, dst)
    root = ckpt_root(dst)
    for name in os.listdir(root):
        if name.startswith("step_") and int(name[5:]) > at:
            shutil.rmtree(os.path.join(root, name))
    with open(os.path.join(root, "latest"), "w") as fh:
        fh.write(f"step_{at:07d}\n")
    return str(dst)


def truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def garble(path):
    """Overwrite a file with as many bytes of garbage: its size stays what meta.json says."""
    size = os.path.getsize(path)
    with open(path, "wb") as fh:
        fh.write(bytes(i * 7 % 251 for i in range(size)))


class Pickled:
    """Pickles as the call fn(*args): unpickling it would make that call."""

    def __init__(self, fn, *args):
        self.call = (fn, args)

    def __reduce__(self):
        return self.call


def payload(marker):
    """What a checkpoint from elsewhere could hold: a pickle that runs `touch marker`."""
    return Pickled(os.system, f"touch {marker}")


def pickled(obj):
    """A writer of pickle.dump(obj) to a path (as DCP writes its .metadata)."""
    def write(path):
        with open(path, "wb") as fh:
            pickle.dump(obj, fh)
    return write


def plant(step_dir, rel, write):
    """Replace the checkpoint file `rel` of `step_dir` by write(path), and record its new size in
    meta.json, so the checkpoint passes the size check and only loading can refuse it."""
    path = os.path.join(str(step_dir), rel)
    write(path)
    meta_path = os.path.join(str(step_dir), "meta.json")
    with open(meta_path) as fh:
        meta = json.load(fh)
    meta["files"][rel] = os.path.getsize(path)
    with open(meta_path, "w") as fh:
        json.dump(meta, fh)


def pickle_of_same_size(marker):
    """A plain pickle of payload(marker) padded to the file's size (pickle ignores bytes after STOP):
    the size check passes without touching meta.json."""
    def write(path):
        data = pickle.dumps(payload(marker))
        data += b"\0" * (os.path.getsize(path) - len(data))
        with open(path, "wb") as fh:
            fh.write(data)
    return write


def previous_release_rng(path):
    """Rewrite an RNG file as releases before rng_state() wrote it: numpy's and Python's states
    as np.random.get_state() and random.getstate() return them (a numpy array, tuples)."""
    state = torch.load(path, weights_only=True)
    key, numpy_keys, *numpy_rest = state["numpy"]
    version, python_keys, gauss_next = state["python"]
    torch.save({"torch": state["torch"], "numpy": (key, np.array(numpy_keys, dtype=np.uint32), *numpy_rest),
                "python": (version, tuple(python_keys), gauss_next), "cuda": state["cuda"]}, path)


def cmd_args(run_dir, cache, extra):
    """The command line launch() builds for a run: TINY, its directories, then the extras."""
    return TINY + ["--out-dir", str(run_dir), "--cache-dir", str(cache)] + list(extra)


def cli(args, timeout=300, wrapper=None):
    """python train_fsdp.py ARGS (one process), or through a `python -c WRAPPER` given sys.argv; forked."""
    script, argv = ("-c", [wrapper, *args]) if wrapper else ("train_fsdp.py", args)
    return script_runner.run(script, argv, ROOT, clean_env(), timeout)


def error_line(proc, code, alone=False):
    """The single 'error: ...' line of a run that ended with `code` (no traceback); `alone`: and
    nothing else on stderr (a run stopped before training has no progress bar)."""
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    if alone:
        assert proc.stderr.strip() == errors[0], proc.stderr[-3000:]
    return errors[0]


class Workers:
    """nproc train_fsdp.py processes (or `script`, given the same arguments) started without
    torchrun (RANK, WORLD_SIZE, ... set here), forked from the script server (tests/script_runner.py), all
    in one new process group; stdout/stderr go to files."""

    def __init__(self, nproc, args, log_prefix, script="train_fsdp.py"):
        self.procs, self.logs = [], []
        self.store, envs = rank_envs(nproc)
        for rank, env in enumerate(envs):
            out, err = f"{log_prefix}.rank{rank}.out", f"{log_prefix}.rank{rank}.err"
            self.logs.append((out, err))
            # One new process group, led by rank 0, so that killpg reaches every rank at once.
            self.procs.append(script_runner.start(script, args, ROOT, env, out, err,
                                                  group=0 if rank == 0 else self.procs[0].pid))

    def alive(self):
        return any(p.poll() is None for p in self.procs)

    def kill(self):
        try:
            os.killpg(self.procs[0].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in self.procs:
            p.wait()

    def wait(self, timeout=300):
        try:
            return [p.wait(timeout=timeout) for p in self.procs]
        finally:
            if self.alive():
                self.kill()

    def stderr(self, rank=0):
        with open(self.logs[rank][1]) as fh:
            return fh.read()

    def output(self):
        text = ""
        for out, err in self.logs:
            for path in (out, err):
                with open(path) as fh:
                    text += f"--- {path}\n{fh.read()[-3000:]}\n"
        return text


def wait_until(condition, workers, timeout=120):
    """Poll `condition` while the workers run; True once it holds, False if they all exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if not workers.alive():
            return condition()
        time.sleep(0.002)
    raise AssertionError(f"condition not reached within {timeout} s")


def n_loss_records(run_dir):
    try:
        with open(os.path.join(str(run_dir), "metrics.jsonl")) as fh:
            return sum('"loss"' in line for line in fh)
    except FileNotFoundError:
        return 0


def unwrapped(state, model_cfg):
    model = model_lib.build_model(model_lib.ModelConfig(**model_cfg))
    model.load_state_dict(state, strict=True)
    return model.eval()


def batch_loss(model, run_cfg, step=0):
    """Loss of a plain model on training step `step`'s whole global batch."""
    ds = data_lib.open_dataset(data_lib.DataConfig(**run_cfg["data"]), run_cfg["train"]["seed"])
    gb = run_cfg["train"]["global_batch"]
    x, y = ds.train_batch(step, gb, 0, gb)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the runs (OMP_NUM_THREADS=1): same reduction order
    try:
        with torch.no_grad():
            logits, _ = model(x)
            return model_lib.lm_loss(logits, y)[0].item()
    finally:
        torch.set_num_threads(threads)


def dcp_state(dcp_dir, tmp_path):
    """Everything a DCP checkpoint holds (model and optimizer), as one plain nested dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = os.path.join(str(tmp_path), f"dcp-{abs(hash(dcp_dir))}.pt")
    dcp_to_torch_save(dcp_dir, out)
    return torch.load(out, weights_only=True)


def tensors(obj, prefix=""):
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}.{i}")


# =============================================================================================
# Shared launches (every run in them ends with exit 0)


@pytest.fixture(scope="module")
def ref2(tmp_path_factory):
    """References on 2 processes."""
    tmp = tmp_path_factory.mktemp("ref2")
    runs = {name: R + extra for name, extra in VARIANTS.items()}
    runs.update({
        "keep": ["--max-steps", "5", "--save-every", "1", "--keep-checkpoints", "2"],
        "signal": SIGNAL_ARGS,
        "kill": KILL_ARGS,
    })
    return launch(tmp, 2, runs, "ref2")


@pytest.fixture(scope="module")
def four(tmp_path_factory, ref2):
    """4 processes: resume 2-process checkpoints, and save one to resume on 2."""
    tmp = tmp_path_factory.mktemp("four")
    interrupted_copy(ref2["FULL_SHARD"][2], tmp / "four-from2")
    interrupted_copy(ref2["FULL_SHARD"][2], tmp / "four-fsdp2_from_fsdp")
    return launch(tmp, 4, {
        "fsdp2_from_fsdp": R + ["--micro-batch", "2", "--strategy", "fsdp2"],
        "from2": R + ["--micro-batch", "2"],
        "save4": R + ["--micro-batch", "2"],
        "save4_batch12": R + ["--global-batch", "12"],  # a batch 3 processes can split too
    }, "four")


@pytest.fixture(scope="module")
def three(tmp_path_factory, four):
    """3 processes resume a 4-process checkpoint (DCP reshards 4 -> 3)."""
    tmp = tmp_path_factory.mktemp("three")
    interrupted_copy(four["save4_batch12"][2], tmp / "three-from4")
    return launch(tmp, 3, {"from4": R + ["--global-batch", "12"]}, "three")


def saved_by(saver, ref2, one):
    """The run directory of a 10-step reference run of this backend (checkpoints 3, 6, 9, 10)."""
    if saver == "none":
        return one["none_save"][2]
    return ref2[{"fsdp": "FULL_SHARD"}.get(saver, saver)][2]


@pytest.fixture(scope="module")
def res2(tmp_path_factory, ref2, four, one):
    """Resumes on 2 processes from copies of the references."""
    tmp = tmp_path_factory.mktemp("res2")
    runs = {}
    for name, extra in VARIANTS.items():
        interrupted_copy(ref2[name][2], tmp / f"res2-{name}")
        runs[name] = R + extra
    for name, where, saver in CROSS:
        if where == "res2":
            interrupted_copy(saved_by(saver, ref2, one), tmp / f"res2-{name}")
            runs[name] = R + STRATEGY_ARGS[name.split("_from_")[0]] + (VARIANTS["full"] if saver == "full" else [])
    interrupted_copy(ref2["FULL_SHARD"][2], tmp / "res2-sgo_from_full")
    runs["sgo_from_full"] = R + ["--sharding-strategy", "SHARD_GRAD_OP"]
    interrupted_copy(four["save4"][2], tmp / "res2-from4")
    runs["from4"] = R
    # Corrupted step 6: auto falls back to step 3.
    d = interrupted_copy(ref2["FULL_SHARD"][2], tmp / "res2-corrupt_distcp")
    dcp_dir = os.path.join(ckpt_root(d), "step_0000006", "dcp")
    truncate(os.path.join(dcp_dir, sorted(f for f in os.listdir(dcp_dir) if f.endswith(".distcp"))[-1]))
    runs["corrupt_distcp"] = R
    d = interrupted_copy(ref2["FULL_SHARD"][2], tmp / "res2-corrupt_meta")
    with open(os.path.join(ckpt_root(d), "step_0000006", "meta.json"), "wb") as fh:
        fh.write(b"\x00\xffnot json {{")
    runs["corrupt_meta"] = R
    d = interrupted_copy(ref2["full"][2], tmp / "res2-corrupt_full")
    truncate(os.path.join(ckpt_root(d), "step_0000006", "model.pt"))
    runs["corrupt_full"] = R + VARIANTS["full"]
    # Files with their recorded sizes and the wrong bytes pass the size check and fail to load:
    # on every rank (DCP's metadata) or on rank 1 only (its RNG state).
    for name, rel in (("garbled_metadata", os.path.join("dcp", ".metadata")), ("garbled_rng", "rng_rank1.pt")):
        d = interrupted_copy(ref2["FULL_SHARD"][2], tmp / f"res2-{name}")
        garble(os.path.join(ckpt_root(d), "step_0000006", rel))
        runs[name] = R
    # The previous release's RNG files (numpy's state pickled as an array): resumed exactly.
    d = interrupted_copy(ref2["FULL_SHARD"][2], tmp / "res2-previous_release")
    for rank in (0, 1):
        plant(os.path.join(ckpt_root(d), "step_0000006"), f"rng_rank{rank}.pt", previous_release_rng)
    runs["previous_release"] = R
    # Allowed changes: resumed and logged.
    interrupted_copy(ref2["FULL_SHARD"][2], tmp / "res2-allowed")
    runs["allowed"] = R + ["--max-steps", "12", "--log-every", "2", "--sharding-strategy", "SHARD_GRAD_OP"]
    # --overwrite: the finished run is started afresh with another config.
    shutil.copytree(ref2["FULL_SHARD"][2], tmp / "res2-overwrite")
    runs["overwrite"] = ["--max-steps", "4", "--overwrite"]
    return launch(tmp, 2, runs, "res2")


@pytest.fixture(scope="module")
def one(tmp_path_factory, ref2):
    """1 process: resumes of 2-process checkpoints, --init-from, references for the CLI tests."""
    tmp = tmp_path_factory.mktemp("one")
    src = ref2["FULL_SHARD"][2]
    for name in ("from2_fsdp", "from2_none"):
        interrupted_copy(src, tmp / f"one-{name}")
    interrupted_copy(ref2["full"][2], tmp / "one-from2_full")
    shutil.copytree(src, tmp / "one-rollback")
    for name, where, saver in CROSS:
        if where == "one" and name != "none_from_fsdp":  # that one is from2_none
            interrupted_copy(saved_by(saver, ref2, None), tmp / f"one-{name}")
    runs = launch(tmp, 1, {
        "none_save": R + ["--strategy", "none"],
        "none_from_ddp": R + ["--strategy", "none"],
        "none_from_fsdp2": R + ["--strategy", "none"],
        "from2_fsdp": R,
        "from2_none": R + ["--strategy", "none"],
        "from2_full": R + VARIANTS["full"],
        "init_run": ["--init-from", src, "--max-steps", "2"],
        "init_step": ["--init-from", os.path.join(ckpt_root(src), "step_0000006"), "--max-steps", "2",
                      "--strategy", "none"],
        "init_pt": ["--init-from", os.path.join(ckpt_root(ref2["full"][2]), "step_0000009", "model.pt"),
                    "--max-steps", "2", "--strategy", "none"],
        "kill": KILL_ARGS,
        "signal": SIGNAL_ARGS,
        "disk_good": ["--max-steps", "3"],
        "disk_good_full": ["--max-steps", "3"] + VARIANTS["full"],
        "skip_nonfinite": NONFINITE + ["--max-steps", "6", "--skip-nonfinite"],
        # Roll back to step 6 of a finished run (explicit --resume) and save every step, keeping 2.
        "rollback": R + ["--resume", os.path.join(ckpt_root(tmp / "one-rollback"), "step_0000006"),
                         "--save-every", "1", "--keep-checkpoints", "2", "--max-steps", "8"],
    }, "one")
    runs["none_from_fsdp"] = runs["from2_none"]
    return runs


# =============================================================================================
# 1. Exact resume at the same world size


@pytest.mark.parametrize("name", list(VARIANTS))
def test_resume_same_world_size_is_bit_identical(ref2, res2, name):
    ref_losses, ref_val, ref_dir = ref2[name]
    losses, val, run_dir = res2[name]
    assert resumed_step(run_dir) == 6
    assert "RNG streams re-seeded" not in log_text(run_dir)
    assert losses == ref_losses  # bit-identical, steps 1-6 kept and 7-10 recomputed
    assert val["val_loss"] == ref_val["val_loss"]
    # Each step exactly once in metrics.jsonl; validation only at the end.
    assert loss_steps(run_dir) == list(range(1, 11))
    assert [r["step"] for r in records(run_dir) if "val_loss" in r] == [10]
    assert latest_name(run_dir) == "step_0000010" and not leftovers(run_dir)
    meta = train_fsdp.check_checkpoint(os.path.join(ckpt_root(run_dir), "step_0000010"))
    assert meta["step"] == 10 and meta["world_size"] == 2
    # The fp16 grad scaler resumed where it was (scale, growth tracker), not afresh: powers-of-two
    # scales would leave the losses unchanged, so compare the state itself.
    ref_meta = train_fsdp.check_checkpoint(os.path.join(ckpt_root(ref2[name][2]), "step_0000010"))
    assert meta["scaler"] == ref_meta["scaler"]
    assert (meta["scaler"] is not None) == name.endswith("fp16")
    assert_same_tokens_seen(run_dir, ref_dir)
    assert meta["tokens_seen"] == ref_meta["tokens_seen"] == 10 * 8 * 66  # TINY: 8 rows of 66 tokens a step


def test_free_transformer_resume_restores_the_sampling_rng(ref2, res2):
    """Z is sampled from the torch RNG: without restoring it, steps 7-10 would differ."""
    meta = train_fsdp.check_checkpoint(os.path.join(ckpt_root(ref2["free"][2]), "step_0000006"))
    assert {"rng_rank0.pt", "rng_rank1.pt"} <= set(meta["files"])
    r0 = torch.load(os.path.join(ckpt_root(ref2["free"][2]), "step_0000006", "rng_rank0.pt"), weights_only=True)
    r1 = torch.load(os.path.join(ckpt_root(ref2["free"][2]), "step_0000006", "rng_rank1.pt"), weights_only=True)
    assert not torch.equal(r0["torch"], r1["torch"])  # one stream per rank
    # Sampling moved the stream away from its seed: a resume that only re-seeded would differ.
    assert not torch.equal(r0["torch"], torch.Generator().manual_seed(1337).get_state())
    assert res2["free"][0] == ref2["free"][0]


def test_previous_release_checkpoint_resumes_exactly(ref2, res2):
    """RNG files as releases before rng_state() wrote them (a pickled numpy array, which plain
    weights_only refuses) resume bit-identically: read with numpy's array admitted, nothing else."""
    rng_file = os.path.join(ckpt_root(res2["previous_release"][2]), "step_0000006", "rng_rank1.pt")
    with pytest.raises(pickle.UnpicklingError, match="numpy"):  # the planted file, still there
        torch.load(rng_file, weights_only=True)
    losses, val, run_dir = res2["previous_release"]
    assert resumed_step(run_dir) == 6 and "RNG streams re-seeded" not in log_text(run_dir)
    assert losses == ref2["FULL_SHARD"][0] and val["val_loss"] == ref2["FULL_SHARD"][1]["val_loss"]


# =============================================================================================
# 2. Resume at another world size or sharding strategy (sharded checkpoints reshard)


def test_resume_on_one_process(ref2, one):
    ref = ref2["FULL_SHARD"][0]
    for name in ("from2_fsdp", "from2_none"):
        losses, _, run_dir = one[name]
        assert resumed_step(run_dir) == 6
        assert "saved by 2 processes; RNG streams re-seeded" in log_text(run_dir)
        assert loss_steps(run_dir) == list(range(1, 11))
        assert_same(losses, ref, rel=1e-5)
        assert_same_tokens_seen(run_dir, ref2["FULL_SHARD"][2])


def test_full_checkpoint_resumes_on_one_process(ref2, one):
    losses, _, run_dir = one["from2_full"]
    assert resumed_step(run_dir) == 6
    assert_same(losses, ref2["full"][0], rel=1e-5)


def test_resume_on_four_processes(ref2, four):
    ref = ref2["FULL_SHARD"][0]
    losses, _, run_dir = four["from2"]
    assert resumed_step(run_dir) == 6
    assert "saved by 2 processes; RNG streams re-seeded" in log_text(run_dir)
    assert loss_steps(run_dir) == list(range(1, 11))
    assert_same(losses, ref, rel=1e-5)
    assert_same_tokens_seen(run_dir, ref2["FULL_SHARD"][2])


def test_resume_with_another_sharding_strategy(ref2, res2):
    losses, _, run_dir = res2["sgo_from_full"]
    assert resumed_step(run_dir) == 6
    assert "changed on resume: fsdp.sharding_strategy: 'FULL_SHARD' -> 'SHARD_GRAD_OP'" in log_text(run_dir)
    assert_same(losses, ref2["FULL_SHARD"][0], rel=1e-5)


def test_four_process_checkpoint_resumes_on_two(ref2, four, res2):
    losses, _, run_dir = res2["from4"]
    meta = train_fsdp.check_checkpoint(os.path.join(ckpt_root(four["save4"][2]), "step_0000006"))
    assert meta["world_size"] == 4
    assert resumed_step(run_dir) == 6 and "saved by 4 processes" in log_text(run_dir)
    assert_same(losses, ref2["FULL_SHARD"][0], rel=1e-5)
    assert_same_tokens_seen(run_dir, ref2["FULL_SHARD"][2])


def test_four_process_checkpoint_resumes_on_three(four, three):
    losses, _, run_dir = three["from4"]
    assert resumed_step(run_dir) == 6 and "saved by 4 processes" in log_text(run_dir)
    assert_same(losses, four["save4_batch12"][0], rel=1e-5)


@pytest.mark.parametrize("name,where,saver", CROSS, ids=[c[0] for c in CROSS])
def test_checkpoint_resumes_under_another_backend(ref2, one, res2, four, name, where, saver):
    """A sharded (DCP) checkpoint saved by none, ddp, fsdp (FSDP1, DTensor state dicts through its
    device mesh) or fsdp2 resumes under each other backend, also at another world size (1, 2
    and 4 processes), model and optimizer state: steps 7-10 give the uninterrupted run's losses.
    A fresh optimizer would not (Adam's first steps are larger)."""
    losses, _, run_dir = {"res2": res2, "one": one, "four": four}[where][name]
    to = name.split("_from_")[0]
    assert resumed_step(run_dir) == 6
    meta = train_fsdp.check_checkpoint(os.path.join(ckpt_root(run_dir), "step_0000006"))
    assert meta["config"]["train"]["strategy"] == (saver if saver in ("none", "ddp", "fsdp2") else "fsdp")
    assert f"changed on resume: train.strategy: {meta['config']['train']['strategy']!r} -> {to!r}" in log_text(run_dir)
    assert loss_steps(run_dir) == list(range(1, 11))
    assert_same(losses, ref2["FULL_SHARD"][0], rel=1e-5)


# =============================================================================================
# 3. kill -9 at different moments of a save


def _kill_then_resume(tmp_path, name, nproc, condition):
    run_dir = tmp_path / name
    args = cmd_args(run_dir, tmp_path / "cache", KILL_ARGS)
    workers = Workers(nproc, args, str(tmp_path / f"{name}-killed"))
    try:
        hit = wait_until(lambda: condition(run_dir), workers)
    finally:
        workers.kill()
    assert hit, f"{name}: the run ended before the moment to kill it\n" + workers.output()
    assert [p.returncode for p in workers.procs] == [-signal.SIGKILL] * nproc, workers.output()
    before = sorted(os.listdir(ckpt_root(run_dir)))
    again = run_ranks("train_fsdp.py", args, nproc)  # forked: nothing signals it
    assert [p.returncode for p in again] == [0] * nproc, again[0].stderr[-3000:]
    return run_dir, before


def _step_dirs(run_dir, prefix):
    try:
        names = os.listdir(ckpt_root(run_dir))
    except FileNotFoundError:
        return []
    return [n for n in names if n.startswith(prefix) and int(n[len(prefix):]) >= 4]


def _mid_save(run_dir):          # the .tmp directory of step >= 4 exists: a save is under way
    return bool(_step_dirs(run_dir, ".tmp-step_"))


def _after_save(run_dir):        # latest was just switched to step >= 4 (keep-K deletion may follow)
    try:
        return int(latest_name(run_dir)[5:]) >= 4
    except (OSError, ValueError):
        return False


def _dcp_written(run_dir):       # DCP has written shard files of step >= 4 into the .tmp directory
    for name in _step_dirs(run_dir, ".tmp-step_"):
        try:
            if any(f.endswith(".distcp") for f in os.listdir(os.path.join(ckpt_root(run_dir), name, "dcp"))):
                return True
        except OSError:
            pass
    return False


def test_kill_9_during_save_then_resume(tmp_path, ref2, one):
    scenarios = [("mid_save", 1, _mid_save), ("after_save", 1, _after_save), ("dcp_written_2proc", 2, _dcp_written)]
    with concurrent.futures.ThreadPoolExecutor(len(scenarios)) as pool:
        futures = {name: pool.submit(_kill_then_resume, tmp_path, name, nproc, cond)
                   for name, nproc, cond in scenarios}
        done = {name: f.result() for name, f in futures.items()}
    for name, nproc, _ in scenarios:
        run_dir, before = done[name]
        ref = (one if nproc == 1 else ref2)["kill"]
        assert resumed_step(run_dir) >= 3, (name, before)
        assert not leftovers(run_dir), (name, os.listdir(ckpt_root(run_dir)))
        assert latest_name(run_dir) == "step_0000012"
        train_fsdp.check_checkpoint(os.path.join(ckpt_root(run_dir), "step_0000012"))
        assert len(train_fsdp.complete_checkpoints(ckpt_root(run_dir))) == 3, os.listdir(ckpt_root(run_dir))
        assert loss_steps(run_dir) == list(range(1, 13)), name
        assert losses_of(run_dir) == ref[0], name  # bit-identical to the uninterrupted run
        assert_same_tokens_seen(run_dir, ref[2])


# =============================================================================================
# 4. SIGUSR1 / SIGTERM: save, exit 3, resume


def _stop_with_signal(tmp_path, nproc, sig, ref):
    run_dir = tmp_path / "run"
    args = cmd_args(run_dir, tmp_path / "cache", SIGNAL_ARGS)
    workers = Workers(nproc, args, str(tmp_path / "stopped"))
    try:
        assert wait_until(lambda: n_loss_records(run_dir) >= 2, workers), workers.output()
        os.kill(workers.procs[-1].pid, sig)  # one rank only (the last)
        codes = workers.wait(timeout=120)
    finally:
        if workers.alive():
            workers.kill()
    assert codes == [train_fsdp.EXIT_PREEMPTED] * nproc, workers.output()
    stderr = workers.stderr(0)
    found = re.findall(rf"signal {signal.Signals(sig).name} at step (\d+): checkpoint saved", stderr)
    assert len(found) == 1, stderr[-3000:]
    step = int(found[0])
    assert 2 <= step < 20
    assert latest_name(run_dir) == f"step_{step:07d}"
    meta = train_fsdp.check_checkpoint(os.path.join(ckpt_root(run_dir), f"step_{step:07d}"))
    assert meta["step"] == step and meta["world_size"] == nproc
    assert loss_steps(run_dir) == list(range(1, step + 1))
    assert not leftovers(run_dir)
    with open(os.path.join(run_dir, train_fsdp.STOPPED_FILE)) as fh:  # what slurm_submit.sh reads
        assert json.load(fh) == {"step": step}

    again = run_ranks("train_fsdp.py", args, nproc)
    assert [p.returncode for p in again] == [0] * nproc, again[0].stderr[-3000:]
    assert not os.path.exists(os.path.join(run_dir, train_fsdp.STOPPED_FILE))
    assert resumed_step(run_dir) == step
    assert loss_steps(run_dir) == list(range(1, 21))
    assert losses_of(run_dir) == ref[0]  # bit-identical to the uninterrupted run
    assert latest_name(run_dir) == "step_0000020"
    assert_same_tokens_seen(run_dir, ref[2])


def test_sigusr1_to_one_of_two_ranks_saves_and_exits_3(tmp_path, ref2):
    _stop_with_signal(tmp_path, 2, signal.SIGUSR1, ref2["signal"])


def test_sigterm_single_process_saves_and_exits_3(tmp_path, one):
    _stop_with_signal(tmp_path, 1, signal.SIGTERM, one["signal"])


# =============================================================================================
# 5. Corrupted checkpoints


@pytest.mark.parametrize("name,ref", [("corrupt_distcp", "FULL_SHARD"), ("corrupt_meta", "FULL_SHARD"),
                                      ("corrupt_full", "full"), ("garbled_metadata", "FULL_SHARD"),
                                      ("garbled_rng", "FULL_SHARD")])
def test_corrupted_latest_falls_back_to_the_previous_checkpoint(ref2, res2, name, ref):
    losses, val, run_dir = res2[name]
    text = log_text(run_dir)
    pattern = r"checkpoint \S*step_0000006 is incomplete or corrupted: .*; trying an older checkpoint"
    assert re.search(pattern, text), text
    assert resumed_step(run_dir) == 3
    assert loss_steps(run_dir) == list(range(1, 11))
    assert losses == ref2[ref][0] and val["val_loss"] == ref2[ref][1]["val_loss"]
    # The corrupted step 6 was replaced by a good one when step 6 was saved again.
    train_fsdp.check_checkpoint(os.path.join(ckpt_root(run_dir), "step_0000006"))
    assert latest_name(run_dir) == "step_0000010" and not leftovers(run_dir)


def test_check_checkpoint_rejects_truncation_and_garbage(ref2, tmp_path):
    good = os.path.join(ckpt_root(ref2["FULL_SHARD"][2]), "step_0000009")
    assert train_fsdp.check_checkpoint(good)["step"] == 9
    for i, damage in enumerate([lambda d: truncate(os.path.join(d, "rng_rank1.pt")),
                                lambda d: truncate(os.path.join(d, "dcp", ".metadata")),
                                lambda d: os.remove(os.path.join(d, "dcp", "__0_0.distcp")),
                                lambda d: open(os.path.join(d, "meta.json"), "w").write("{\"step\": 9"),
                                lambda d: os.remove(os.path.join(d, "meta.json"))]):
        bad = shutil.copytree(good, tmp_path / f"bad{i}")
        damage(str(bad))
        with pytest.raises(train_fsdp.RunFailed, match="incomplete or corrupted"):
            train_fsdp.check_checkpoint(str(bad))


def test_latest_is_written_after_the_checkpoint_is_in_place(tmp_path, monkeypatch):
    """Guards issue 13 bug 3, `latest` written before the step directory is renamed into place
    (sample.py and --resume follow `latest` without a fallback): at the moment `latest` is
    replaced, the directory it names is at its final path and complete (meta.json, every file
    of its size), its .tmp- directory is gone; `latest` itself is replaced atomically. Also for
    a step saved again (the swap with the older copy of the same step)."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    real_replace, published = os.replace, []

    def replace(src, dst):
        if os.path.basename(str(dst)) == "latest":
            with open(src) as fh:
                name = fh.read().strip()
            try:
                meta = train_fsdp.check_checkpoint(os.path.join(str(root), name))
                state = (name, meta["step"], f".tmp-{name}" in os.listdir(root))
            except train_fsdp.RunFailed as e:
                state = (name, str(e), None)
            published.append(state)
        return real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    cfg = train_fsdp.Config()
    cfg.checkpoint.keep_checkpoints = 2
    data = types.SimpleNamespace(tokenizer_path=None)
    for i, step in enumerate([1, 2, 2, 3]):
        name = f"step_{step:07d}"
        tmp = root / f".tmp-{name}"
        tmp.mkdir()
        (tmp / "rng_rank0.pt").write_bytes(b"x" * (10 + i))
        meta = train_fsdp.checkpoint_meta(cfg, step, 528 * step, data.tokenizer_path, None, 1)
        train_fsdp.publish_checkpoint(str(root / name), meta, cfg.checkpoint.keep_checkpoints)
        assert published[i:] == [(name, step, False)], published
        assert latest_name(tmp_path) == name and not tmp.exists()
        assert train_fsdp.check_checkpoint(str(root / name))["files"] == {"rng_rank0.pt": 10 + i}
    assert sorted(os.listdir(root)) == ["latest", "step_0000002", "step_0000003"]


def optimizer_groups(step_dir, tmp_path):
    """(parameter name -> number of dimensions, the optimizer's param groups by parameter name)
    of a saved checkpoint, full or sharded."""
    model_pt = os.path.join(step_dir, "model.pt")
    state = torch.load(model_pt, weights_only=True) if os.path.exists(model_pt) else {}
    if "optim" not in state:
        state = dcp_state(os.path.join(step_dir, "dcp"), tmp_path)
    return {k: v.dim() for k, v in state["model"].items()}, state["optim"]["param_groups"]


@pytest.mark.parametrize("name", ["full", "FULL_SHARD", "ddp", "free", "none", "fsdp2"])
def test_weight_decay_only_on_matrices(ref2, one, tmp_path, name):
    """Guards issue 13 bug 2, weight decay applied to every parameter: in the optimizer state a
    run saved (FSDP full and sharded, DDP, one process; the Free Transformer adds a 1-D ζ),
    the >= 2-D weights are decayed by --weight-decay (0.1) and the 1-D ones (norm weights,
    biases, ζ) not at all; every parameter is in exactly one group."""
    run_dir = one["from2_none"][2] if name == "none" else ref2[name][2]
    dims, groups = optimizer_groups(os.path.join(ckpt_root(run_dir), "step_0000010"), tmp_path)
    grouped = [p for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(dims)
    decay = {p: g["weight_decay"] for g in groups for p in g["params"]}
    wrong = {p: (dims[p], decay[p]) for p in dims if decay[p] != (0.1 if dims[p] >= 2 else 0.0)}
    assert not wrong, f"(dims, weight decay) of the parameters decayed wrongly: {wrong}"
    assert 1 in dims.values() and 2 in dims.values()
    if name == "free":
        assert [dims[p] for p in dims if p.endswith(".zeta")] == [1], dims


# =============================================================================================
# Command-line runs that end with an error (exit codes need their own processes), in parallel


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, ref2, one):
    tmp = tmp_path_factory.mktemp("cli")
    cache = tmp / "cache"
    src = ref2["FULL_SHARD"][2]
    jobs, dirs = {}, {}

    def refusal(name, change):
        d = shutil.copytree(src, tmp / name)
        dirs[name] = (d, snapshot(d))
        jobs[name] = lambda: cli(cmd_args(d, cache, R + change))

    refusal("lr", ["--lr", "1e-3"])
    refusal("d_model", ["--d-model", "64"])
    refusal("global_batch", ["--global-batch", "16"])
    refusal("dataset", ["--dataset", "random"])
    refusal("never", ["--resume", "never"])

    bad = shutil.copytree(os.path.join(ckpt_root(src), "step_0000009"), tmp / "bad_step")
    truncate(os.path.join(bad, "dcp", "__1_0.distcp"))
    jobs["resume_corrupted"] = lambda: cli(cmd_args(tmp / "resume_corrupted", cache, R + ["--resume", bad]))

    def init_mismatch():  # the failing command, then the corrected one in the same --out-dir
        out = tmp / "init_mismatch"
        first = cli(cmd_args(out, cache, ["--d-model", "64", "--init-from", src, "--max-steps", "2"]))
        return first, cli(cmd_args(out, cache, ["--init-from", src, "--max-steps", "2"]))
    jobs["init_mismatch"] = init_mismatch

    jobs["nonfinite"] = lambda: cli(cmd_args(tmp / "nonfinite", cache, NONFINITE))
    # fp16: the grad scaler skips steps with non-finite gradients, but a non-finite loss stops the run.
    jobs["nonfinite_fp16"] = lambda: cli(cmd_args(tmp / "nonfinite_fp16", cache, NONFINITE + [
        "--param-dtype", "fp16", "--reduce-dtype", "fp16"]))

    # The final checkpoint without its consolidated model.pt (as a sharded checkpoint of any
    # other step is): exported from dcp/ and compared with the model.pt the run gathered itself.
    exp = shutil.copytree(os.path.join(ckpt_root(src), "step_0000010"), tmp / "export10")
    os.remove(os.path.join(exp, "model.pt"))
    with open(os.path.join(exp, "meta.json")) as fh:
        meta = json.load(fh)
    del meta["files"]["model.pt"]
    with open(os.path.join(exp, "meta.json"), "w") as fh:
        json.dump(meta, fh)
    jobs["export"] = lambda: cli(["--export", exp])

    # Checkpoints with a pickle that would create MARKER (payload) in their RNG file, .metadata or
    # model.pt: resume, --init-from, --export and sample.py each refuse them (REFUSALS).
    marker = tmp / "MARKER"
    rng_run = interrupted_copy(one["none_save"][2], tmp / "refused_rng")  # 1 process: its RNG file is read
    pickle_of_same_size(marker)(os.path.join(ckpt_root(rng_run), "step_0000006", "rng_rank0.pt"))
    dirs["resume_rng"] = (rng_run, snapshot(rng_run))
    jobs["resume_rng"] = lambda: cli(cmd_args(rng_run, cache, R + ["--strategy", "none"]))
    meta_step = shutil.copytree(os.path.join(ckpt_root(src), "step_0000009"), tmp / "refused_metadata")
    plant(meta_step, os.path.join("dcp", ".metadata"), pickled(payload(marker)))
    jobs["resume_metadata"] = lambda: cli(cmd_args(tmp / "resume_metadata", cache, R + ["--resume", meta_step]))
    jobs["init_metadata"] = lambda: cli(cmd_args(tmp / "init_metadata", cache, ["--init-from", meta_step]))
    jobs["export_metadata"] = lambda: cli(["--export", meta_step])
    pt_run = interrupted_copy(ref2["full"][2], tmp / "refused_pt")
    model_pt = os.path.join(ckpt_root(pt_run), "step_0000006", "model.pt")
    plant(os.path.dirname(model_pt), "model.pt", lambda p: torch.save({"model": payload(marker)}, p))
    dirs["resume_pt"] = (pt_run, snapshot(pt_run))
    jobs["resume_pt"] = lambda: cli(cmd_args(pt_run, cache, R + VARIANTS["full"]))
    jobs["init_pt"] = lambda: cli(cmd_args(tmp / "init_pt", cache, ["--init-from", model_pt]))
    jobs["sample_pt"] = lambda: script_runner.run("sample.py", ["--ckpt", pt_run], ROOT, clean_env())

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    return results, dirs, tmp


# =============================================================================================
# 8. Config changes on resume


@pytest.mark.parametrize("name,field", [("lr", "train.lr: 0.003 -> 0.001"), ("d_model", "model.d_model: 32 -> 64"),
                                        ("global_batch", "train.global_batch: 8 -> 16"),
                                        ("dataset", "data.dataset: 'synthetic' -> 'random'")])
def test_resume_refuses_a_config_change(cli_runs, name, field):
    results, dirs, _ = cli_runs
    line = error_line(results[name], train_fsdp.EXIT_BAD_INPUT, alone=True)
    assert "already holds a run with another config" in line and field in line and "--overwrite" in line, line
    run_dir, before = dirs[name]
    assert snapshot(run_dir) == before  # checkpoints, metrics, config.json: byte-identical, nothing added


def test_resume_never_refuses_a_run_directory(cli_runs):
    results, dirs, _ = cli_runs
    line = error_line(results["never"], train_fsdp.EXIT_BAD_INPUT, alone=True)
    assert "already holds a run" in line and "--resume auto" in line and "--overwrite" in line
    assert snapshot(dirs["never"][0]) == dirs["never"][1]


def test_allowed_changes_resume_and_are_logged(ref2, res2):
    _, _, run_dir = res2["allowed"]
    text = log_text(run_dir)
    assert resumed_step(run_dir) == 6
    for change in ("train.max_steps: 10 -> 12", "train.log_every: 1 -> 2",
                   "fsdp.sharding_strategy: 'FULL_SHARD' -> 'SHARD_GRAD_OP'"):
        assert f"changed on resume: {change}" in text, text
    # Steps 1-6 kept from before; after the resume, one record every 2 steps up to the new end.
    assert loss_steps(run_dir) == [1, 2, 3, 4, 5, 6, 8, 10, 12]
    assert losses_of(run_dir)[:6] == ref2["FULL_SHARD"][0][:6]
    assert latest_name(run_dir) == "step_0000012"
    with open(os.path.join(run_dir, "config.json")) as fh:
        assert json.load(fh)["train"]["max_steps"] == 12


def test_overwrite_starts_afresh_and_deletes_old_checkpoints(ref2, res2):
    losses, _, run_dir = res2["overwrite"]
    text = log_text(run_dir)
    assert "--overwrite: starting" in text and "resumed from" not in text
    assert sorted(os.listdir(ckpt_root(run_dir))) == ["latest", "step_0000004"]
    assert loss_steps(run_dir) == [1, 2, 3, 4]
    assert losses[0] == ref2["FULL_SHARD"][0][0]  # step 1 (before any update): a fresh start


REFUSALS = {"resume_rng": "refused_rng/checkpoints/step_0000006/rng_rank0.pt",  # job: the file it names
            "resume_metadata": "refused_metadata/dcp/.metadata", "init_metadata": "refused_metadata/dcp/.metadata",
            "export_metadata": "refused_metadata/dcp/.metadata",
            "resume_pt": "refused_pt/checkpoints/step_0000006/model.pt",
            "init_pt": "refused_pt/checkpoints/step_0000006/model.pt",
            "sample_pt": "refused_pt/checkpoints/step_0000006/model.pt"}


@pytest.mark.parametrize("job", list(REFUSALS))
def test_a_checkpoint_that_would_run_code_is_refused_and_nothing_runs(cli_runs, job):
    results, dirs, tmp = cli_runs
    line = error_line(results[job], train_fsdp.EXIT_BAD_INPUT, alone=True)
    assert f"refused to load {tmp / REFUSALS[job]}: it asks for {os.system.__module__}.system" in line, line
    assert not os.path.exists(tmp / "MARKER")
    assert not os.path.exists(tmp / "refused_metadata" / "model.pt")  # --export wrote nothing
    assert not os.path.exists(tmp / "init_metadata") and not os.path.exists(tmp / "init_pt")
    if job in dirs:  # a refused resume leaves its run directory as it was (but the lock's holder)
        run_dir, before = dirs[job]
        assert {**snapshot(run_dir), "run.lock": None} == {**before, "run.lock": None}


def test_metadata_reader_reads_every_strategys_checkpoints_and_refuses_callables(ref2, four, one, tmp_path):
    """read_dcp_metadata's allow-list: the .metadata of checkpoints of every strategy (fsdp
    with each sharding, fsdp2, ddp, none; fp16 scaler; 1, 2 and 4 processes) reads as DCP's own
    reader reads it; generic callables and containers no DCP metadata holds are refused."""
    runs = [r[2] for r in (*ref2.values(), *four.values(), *one.values())]
    dirs = [os.path.join(ckpt_root(r), n, "dcp") for r in runs for n in train_fsdp.complete_checkpoints(ckpt_root(r))]
    dirs = [d for d in dirs if os.path.isdir(d)]
    assert len(dirs) > 40
    for d in dirs:
        ours, theirs = train_fsdp.read_dcp_metadata(d), dcp.FileSystemReader(d).read_metadata()
        ours.storage_meta.load_id = theirs.storage_meta.load_id  # a fresh id per reader
        assert ours == theirs, d
    for name, obj in [("builtins.eval", Pickled(eval, "1")), ("posix.system", Pickled(os.system, "true")),
                      ("copyreg._reconstructor", Pickled(copyreg._reconstructor, dict, dict, {})),
                      ("collections.OrderedDict", Pickled(collections.OrderedDict)),
                      ("builtins.getattr", Pickled(getattr, "", "upper"))]:
        os.makedirs(tmp_path / name)
        pickled(obj)(tmp_path / name / ".metadata")
        with pytest.raises(train_fsdp.BadInput, match=f"refused to load .*{name}"):
            train_fsdp.read_dcp_metadata(str(tmp_path / name))


def test_a_distcp_entry_that_would_run_code_is_refused(tmp_path):
    """DCP stores a state dict's non-tensor values (the optimizer's param_groups) as pickles inside
    the .distcp files and its own planner loads them with weights_only=False: a checkpoint can
    hold one that runs code (DCP's plain dcp.load runs it). train_fsdp.dcp_load refuses it, and
    reads the plain values every checkpoint holds."""
    marker, ckpt = tmp_path / "MARKER", str(tmp_path / "dcp")
    dcp.save({"lr": 0.1, "kind": "adamw", "evil": payload(marker)}, checkpoint_id=ckpt)
    with pytest.raises(train_fsdp.BadInput, match=r"refused to load the entry evil .*posix\.system"):
        train_fsdp.dcp_load({"evil": None}, ckpt)
    assert not marker.exists()
    state = {"lr": None, "kind": None}
    train_fsdp.dcp_load(state, ckpt)
    assert state == {"lr": 0.1, "kind": "adamw"}
    dcp.load({"evil": None}, checkpoint_id=ckpt)  # what DCP alone does: the code runs
    assert marker.exists()


def test_resume_from_a_corrupted_explicit_path_is_bad_input(cli_runs):
    results, _, tmp = cli_runs
    line = error_line(results["resume_corrupted"], train_fsdp.EXIT_BAD_INPUT, alone=True)
    assert "bad_step is incomplete or corrupted" in line and "__1_0.distcp" in line, line
    assert not os.path.exists(tmp / "resume_corrupted")  # nothing written


# =============================================================================================
# 6. Disk full during a save (RLIMIT_FSIZE: no file may grow beyond LIMIT bytes)

LIMIT = 64 * 1024
FSIZE_WRAPPER = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                 f"resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, {LIMIT})); "
                 "sys.argv = ['train_fsdp.py', *sys.argv[1:]]; runpy.run_path('train_fsdp.py', run_name='__main__')")


def test_save_that_cannot_make_its_directory_stops_both_ranks(one, tmp_path):
    """Rank 0 cannot create the save's temporary directory (a file sits at its path): both ranks
    stop with the same error at once instead of rank 1 waiting for rank 0 until the timeout."""
    run_dir = shutil.copytree(one["disk_good"][2], tmp_path / "run")
    with open(os.path.join(ckpt_root(run_dir), ".tmp-step_0000004"), "w") as fh:
        fh.write("in the way")
    workers = Workers(2, cmd_args(run_dir, tmp_path / "cache", ["--max-steps", "6", "--save-every", "2"]),
                      str(tmp_path / "log"))
    assert workers.wait(timeout=120) == [train_fsdp.EXIT_FAILED] * 2, workers.output()
    line = [x for x in workers.stderr(0).splitlines() if x.startswith("error: ")]
    assert len(line) == 1 and "saving the checkpoint of step 4 failed" in line[0], workers.output()
    assert "the previous checkpoint is intact" in line[0]
    assert latest_name(run_dir) == "step_0000003" and loss_steps(run_dir) == [1, 2, 3, 4]


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_failed_save_keeps_the_previous_checkpoint(one, tmp_path, kind):
    run_dir = shutil.copytree(one["disk_good_full" if kind == "full" else "disk_good"][2], tmp_path / "run")
    step3 = os.path.join(ckpt_root(run_dir), "step_0000003")
    meta = train_fsdp.check_checkpoint(step3)
    assert meta["type"] == kind
    assert max(os.path.getsize(os.path.join(step3, f)) for f in meta["files"]) > LIMIT
    extra = ["--max-steps", "6", "--save-every", "2"] + (VARIANTS["full"] if kind == "full" else [])
    args = cmd_args(run_dir, tmp_path / "cache", extra)
    limited = cli(args, wrapper=FSIZE_WRAPPER)
    assert limited.returncode == train_fsdp.EXIT_FAILED, limited.stderr[-3000:]
    assert latest_name(run_dir) == "step_0000003"
    assert train_fsdp.complete_checkpoints(ckpt_root(run_dir)) == ["step_0000003"]
    assert train_fsdp.check_checkpoint(step3)["step"] == 3
    assert loss_steps(run_dir) == [1, 2, 3, 4]  # step 4 was trained, its save failed
    # One clear line, and nothing half-written left behind.
    line = error_line(limited, train_fsdp.EXIT_FAILED)
    assert line.startswith("error: saving the checkpoint of step 4 failed (rank 0: "), line
    assert "the previous checkpoint is intact" in line
    assert not leftovers(run_dir)
    # Without the limit the same command resumes from step 3 and finishes.
    proc = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resumed_step(run_dir) == 3
    assert loss_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    assert latest_name(run_dir) == "step_0000006" and not leftovers(run_dir)


# =============================================================================================
# 7. --export


def test_export_equals_the_final_consolidated_model(ref2, cli_runs):
    results, _, tmp = cli_runs
    proc = results["export"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = os.path.join(tmp, "export10", "model.pt")
    assert f"wrote {exported}" in proc.stdout
    ours = torch.load(exported, weights_only=True)
    theirs = torch.load(os.path.join(ckpt_root(ref2["FULL_SHARD"][2]), "step_0000010", "model.pt"), weights_only=True)
    assert ours["model"].keys() == theirs["model"].keys()
    for k in theirs["model"]:
        assert torch.equal(ours["model"][k], theirs["model"][k]), k
    for key in ("step", "tokens_seen", "config", "tokenizer"):
        assert ours[key] == theirs[key], key
    assert not os.path.exists(os.path.join(tmp, "export10", "export.tmp"))


def test_exported_checkpoint_equals_a_full_checkpoint_of_the_same_step(ref2, tmp_path):
    """A sharded run's step 6 (no model.pt), exported, loads strictly into a plain model whose
    weights and logits equal those of a full-type run's step 6 (same config otherwise)."""
    step6 = shutil.copytree(os.path.join(ckpt_root(ref2["FULL_SHARD"][2]), "step_0000006"), tmp_path / "step6")
    assert not os.path.exists(os.path.join(step6, "model.pt"))
    path = ckpt_export.export(str(step6), train_fsdp)
    payload = torch.load(path, weights_only=True)
    full = torch.load(os.path.join(ckpt_root(ref2["full"][2]), "step_0000006", "model.pt"), weights_only=True)
    assert payload["step"] == full["step"] == 6
    assert payload["model"].keys() == full["model"].keys()
    assert all(torch.equal(payload["model"][k], full["model"][k]) for k in full["model"])
    a = unwrapped(payload["model"], payload["config"]["model"])
    b = unwrapped(full["model"], full["config"]["model"])
    ds = data_lib.open_dataset(data_lib.DataConfig(**payload["config"]["data"]), payload["config"]["train"]["seed"])
    x, _ = ds.val_batch(0, 8)
    with torch.no_grad():
        assert torch.equal(a(x)[0], b(x)[0])
    # A full checkpoint already is one file: exporting it changes nothing.
    full_dir = os.path.join(ckpt_root(ref2["full"][2]), "step_0000006")
    before = open(os.path.join(full_dir, "model.pt"), "rb").read()
    assert ckpt_export.export(full_dir, train_fsdp) == os.path.join(full_dir, "model.pt")
    assert open(os.path.join(full_dir, "model.pt"), "rb").read() == before


def test_export_in_place_keeps_the_final_checkpoint_valid(ref2, tmp_path):
    step10 = shutil.copytree(os.path.join(ckpt_root(ref2["FULL_SHARD"][2]), "step_0000010"), tmp_path / "step10")
    assert "model.pt" in train_fsdp.check_checkpoint(str(step10))["files"]
    ckpt_export.export(str(step10), train_fsdp)
    train_fsdp.check_checkpoint(str(step10))


# =============================================================================================
# 9. --init-from


def test_init_from_run_dir_step_dir_and_model_pt(ref2, one, tmp_path):
    src, full = ref2["FULL_SHARD"][2], ref2["full"][2]
    sources = {  # run: the weights it must start from
        "init_run": torch.load(os.path.join(ckpt_root(src), "step_0000010", "model.pt"), weights_only=True),
        "init_step": {"model": dcp_state(os.path.join(ckpt_root(src), "step_0000006", "dcp"), tmp_path)["model"]},
        "init_pt": torch.load(os.path.join(ckpt_root(full), "step_0000009", "model.pt"), weights_only=True),
    }
    fresh = one["disk_good"][0][0]  # the same model from its own init
    for name, source in sources.items():
        losses, _, run_dir = one[name]
        text = log_text(run_dir)
        assert "initialised the weights from" in text and "resumed from" not in text, text
        assert loss_steps(run_dir) == [1, 2]  # starts at step 0 in its own run directory
        assert sorted(os.listdir(ckpt_root(run_dir))) == ["latest", "step_0000002"]
        with open(os.path.join(run_dir, "config.json")) as fh:
            cfg = json.load(fh)
        expected = batch_loss(unwrapped(source["model"], cfg["model"]), cfg)
        assert losses[0] == expected, name  # exact: same weights, batch and kernels
        assert losses[0] < fresh - 0.3, (name, losses[0], fresh)  # trained weights, not a fresh init


def test_init_from_shape_mismatch_is_bad_input(cli_runs):
    first, _ = cli_runs[0]["init_mismatch"]
    line = error_line(first, train_fsdp.EXIT_BAD_INPUT, alone=True)
    assert "shapes do not match" in line
    assert "tok_emb.weight: checkpoint (32, 32) vs model (32, 64)" in line, line


def test_init_from_shape_mismatch_leaves_no_run_behind(cli_runs):
    _, second = cli_runs[0]["init_mismatch"]
    assert second.returncode == 0, second.stderr[-2000:]


# =============================================================================================
# 10. Non-finite loss


@pytest.mark.parametrize("name", ["nonfinite", "nonfinite_fp16"])
def test_nonfinite_loss_stops_with_exit_1(cli_runs, name):
    _, _, tmp = cli_runs
    line = error_line(cli_runs[0][name], train_fsdp.EXIT_FAILED)
    found = re.findall(r"the loss or its gradient became NaN/inf at step (\d+);", line)
    assert found, line
    bad = int(found[0])
    run_dir = tmp / name
    names = train_fsdp.complete_checkpoints(ckpt_root(run_dir))
    assert names and all(int(n[5:]) < bad for n in names), (bad, names)
    assert latest_name(run_dir) == names[0] and not leftovers(run_dir)
    train_fsdp.check_checkpoint(os.path.join(ckpt_root(run_dir), names[0]))


def test_nonfinite_run_leaves_a_finite_latest_checkpoint(cli_runs, tmp_path):
    run_dir = cli_runs[2] / "nonfinite"
    state = dcp_state(os.path.join(ckpt_root(run_dir), latest_name(run_dir), "dcp"), tmp_path)
    bad = [k for k, t in tensors(state) if t.is_floating_point() and not torch.isfinite(t).all()]
    assert not bad, bad[:5]


def test_skip_nonfinite_skips_steps_and_finishes(one, tmp_path):
    _, _, run_dir = one["skip_nonfinite"]
    text = log_text(run_dir)
    assert re.search(r"step \d+: gradient norm nan, optimizer step skipped", text), text
    assert loss_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    assert any(not math.isfinite(r["grad_norm"]) for r in records(run_dir) if "grad_norm" in r)
    state = dcp_state(os.path.join(ckpt_root(run_dir), "step_0000006", "dcp"), tmp_path)
    assert all(torch.isfinite(t).all() for _, t in tensors(state["model"]))


# =============================================================================================
# 11. keep-checkpoints


def test_keep_checkpoints(ref2):
    _, _, run_dir = ref2["keep"]
    assert sorted(os.listdir(ckpt_root(run_dir))) == ["latest", "step_0000004", "step_0000005"]
    assert latest_name(run_dir) == "step_0000005"
    for name in ("step_0000004", "step_0000005"):
        train_fsdp.check_checkpoint(os.path.join(ckpt_root(run_dir), name))


def test_keep_checkpoints_after_rolling_back_keeps_the_new_saves(one):
    _, _, run_dir = one["rollback"]
    assert resumed_step(run_dir) == 6
    latest = latest_name(run_dir)
    assert latest == "step_0000008"
    train_fsdp.check_checkpoint(os.path.join(ckpt_root(run_dir), latest))
    # Kept by save time: the two new saves, not steps 9 and 10 of the abandoned branch.
    assert sorted(os.listdir(ckpt_root(run_dir))) == ["latest", "step_0000007", "step_0000008"]


# =============================================================================================
# Resume bookkeeping


def test_keep_metric_lines_tolerates_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.9}\n{"step": 3, "lo')
    train_fsdp.keep_metric_lines(str(path), 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_keep_metric_lines_drops_records_after_the_resume_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 8))
                    + json.dumps({"step": 7, "val_loss": 0.5}) + "\n")
    train_fsdp.keep_metric_lines(str(path), 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_rerunning_a_finished_run_trains_nothing_and_reports_its_validation(tmp_path):
    """The same command again on a finished run: exit 0, no step trained, one line that says why,
    and the final validation of the saved model (the same numbers as at the end of the run)."""
    args = TINY + ["--strategy", "none", "--max-steps", "2", "--out-dir", tmp_path / "run"]
    first = cli(args)
    assert first.returncode == 0, first.stderr
    again = cli(args)
    assert again.returncode == 0, again.stderr
    assert f"{tmp_path / 'run'} already finished at step 2 (max_steps 2): nothing to train" in again.stdout
    finals = [line for p in (first, again) for line in p.stdout.splitlines() if line.startswith("final validation")]
    assert len(finals) == 2 and finals[0] == finals[1] and "ce " in finals[1], finals
    assert loss_steps(tmp_path / "run") == [1, 2]


def test_resume_from_weights_only_checkpoints_is_refused_not_treated_as_corrupted(tmp_path):
    """Full checkpoints saved with --no-full-optimizer load, but cannot be resumed: one error
    line pointing to --init-from, no fallback through the older ones, the metrics untouched."""
    run_dir = tmp_path / "run"
    args = TINY + ["--strategy", "none", "--checkpoint-type", "full", "--no-full-optimizer", "--save-every", "2",
                   "--out-dir", run_dir]
    first = cli(args + ["--max-steps", "4"])
    assert first.returncode == 0, first.stderr
    again = cli(args + ["--max-steps", "6"])
    line = error_line(again, train_fsdp.EXIT_FAILED)
    assert "holds no optimizer state" in line and "--init-from" in line, line
    assert "corrupted" not in again.stdout + again.stderr
    assert loss_steps(run_dir) == [1, 2, 3, 4]


def test_only_a_sharding_fsdp1_on_a_gpu_offloads_the_state_of_a_sharded_save():
    """FSDP1 builds each shard of a sharded state dict as a copy when it shards (a second copy of
    the rank's weights and AdamW state on the GPU during a save): on a GPU it is moved to the host
    as it is made. FSDP1 unsharded (NO_SHARD, one process), FSDP2, DDP and one device: left alone."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")

    def offloads(device, strategy, sharding="FULL_SHARD", world=2):
        cfg = train_fsdp.parse_config(["--strategy", strategy, "--sharding-strategy", sharding])
        topo = train_fsdp.Topology(rank=0, world=world, local_world=world, device=device, backend="gloo")
        return train_fsdp.Checkpointer(cfg, topo, None, None, None, None).sharded.cpu_offload

    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        assert offloads(cuda, "fsdp", sharding), sharding
    assert not offloads(cuda, "fsdp", "NO_SHARD") and not offloads(cuda, "fsdp", world=1)
    for device, strategy in [(cuda, "fsdp2"), (cuda, "ddp"), (cuda, "none"), (cpu, "fsdp"), (cpu, "fsdp2")]:
        assert not offloads(device, strategy), (device, strategy)


def test_fsdp1_sharded_state_offloaded_to_the_host_is_the_same_and_loads(tmp_path):
    """What a GPU run's FSDP1 saves write (the sharded state built with cpu_offload) holds the
    same DTensor shards and optimizer state as the state left in place, and a checkpoint written
    from it loads back exactly into another model. And the reason: FSDP1's sharded state shares
    no storage with its weights or AdamW moments (a copy), FSDP2's is those very tensors, and
    FSDP1 under NO_SHARD hands out the moments themselves (2 gloo processes,
    tests/sharded_state_offload.py)."""
    res = run_ranks(os.path.join("tests", "sharded_state_offload.py"), [tmp_path / "ck"], 2)
    assert [r.returncode for r in res] == [0, 0], res[0].stderr[-3000:] + res[1].stderr[-3000:]
    assert "OK 16 tensors" in res[0].stdout, res[0].stdout[-2000:]
