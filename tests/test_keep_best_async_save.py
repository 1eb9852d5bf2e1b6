"""--keep-best (checkpoints/best survives keep-K pruning and resumes, and
sample.py, --init-from and --export accept it), --async-save (a background write killed with
SIGKILL leaves the previous checkpoint as latest and the run resumes exactly; a background write
that fails stops every rank with one line, exit 1), and the flight recorder of --debug and
slurm_submit.sh. The per-epoch text windows are tested on the Dataset in tests/test_data.py.

Runs go through this file's own __main__, which patches the trainer before running it:
`runs SPEC.json` runs several trainings in one process with scripted validation losses (so
that which checkpoint is best is known in advance); `writer MODE ARGS` runs one training
whose background checkpoint writer is slowed, blocked or made to fail.
"""
import errno
import json
import os
import shutil
import signal
import sys
import threading
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import script_runner  # noqa: E402

import ckpt_export  # noqa: E402
import sample  # noqa: E402
import train_fsdp  # noqa: E402
from test_checkpoint import (  # noqa: E402
    Workers,
    ckpt_root,
    latest_name,
    leftovers,
    loss_steps,
    losses_of,
    records,
    resumed_step,
)
from test_distributed import TINY, clean_env  # noqa: E402

THIS = os.path.abspath(__file__)
ASYNC = ["--max-steps", "8", "--save-every", "1", "--async-save", "--eval-every", "0"]


def listing(run_dir):
    root = ckpt_root(run_dir)
    best = open(os.path.join(root, "best")).read().strip() if os.path.exists(os.path.join(root, "best")) else None
    return sorted(n for n in os.listdir(root) if n.startswith("step_")), best


# =============================================================================================
# --keep-best


@pytest.fixture(scope="module")
def best_runs(tmp_path_factory):
    """One process, four trainings: a run whose validation loss is lowest at step 2, kept past
    pruning (keep 2); its resume to step 7 (worse: step 2 stays best); its resume to step 8 (a
    new best); a --debug run. The checkpoint listing is recorded after each."""
    tmp = tmp_path_factory.mktemp("best")
    run, dbg = str(tmp / "run"), str(tmp / "debug")
    base = TINY + ["--cache-dir", str(tmp / "cache"), "--synthetic-val-samples", "16"]
    keep = ["--out-dir", run, "--save-every", "1", "--keep-checkpoints", "2", "--keep-best"]
    spec = [
        {"argv": base + keep + ["--max-steps", "6"], "val": {1: 5.0, 2: 3.0, 3: 4.0, 4: 6.0, 5: 7.0, 6: 8.0},
         "copy": str(tmp / "after6")},
        {"argv": base + keep + ["--max-steps", "7"], "val": {7: 9.0}, "copy": str(tmp / "after7")},
        {"argv": base + keep + ["--max-steps", "8"], "val": {8: 1.5}},
        {"argv": base + ["--out-dir", dbg, "--max-steps", "1", "--debug"], "val": None},
    ]
    spec_file = tmp / "spec.json"
    spec_file.write_text(json.dumps(spec))
    proc = script_runner.run(THIS, ["runs", spec_file], ROOT, clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"run": run, "after6": str(tmp / "after6"), "after7": str(tmp / "after7"), "debug": dbg,
            "env": json.loads((tmp / "debug_env.json").read_text())}


def test_best_checkpoint_survives_pruning_and_resume(best_runs):
    # Validation loss lowest at step 2: kept beside the newest 2 (5 and 6), named by `best`.
    assert listing(best_runs["after6"]) == (["step_0000002", "step_0000005", "step_0000006"], "step_0000002")
    assert latest_name(best_runs["after6"]) == "step_0000006"
    # Resumed, step 7 is worse: step 2 is still kept and best, step 5 has gone by keep-K.
    assert resumed_step(best_runs["after7"]) == 6
    assert listing(best_runs["after7"]) == (["step_0000002", "step_0000006", "step_0000007"], "step_0000002")
    # Resumed again, step 8 is the new best: it is named, and step 2 goes like any old checkpoint.
    assert listing(best_runs["run"]) == (["step_0000007", "step_0000008"], "step_0000008")


def test_every_save_is_evaluated_and_its_loss_recorded(best_runs):
    """Under --keep-best with --eval-every 0, each save's step is validated first, and meta.json
    holds that step's validation loss; the summary says how many rows an evaluation reads."""
    vals = {r["step"]: r["val_loss"] for r in records(best_runs["run"]) if "val_loss" in r}
    assert vals == {1: 5.0, 2: 3.0, 3: 4.0, 4: 6.0, 5: 7.0, 6: 8.0, 7: 9.0, 8: 1.5}
    for name in ("step_0000007", "step_0000008"):
        meta = train_fsdp.check_checkpoint(os.path.join(ckpt_root(best_runs["run"]), name))
        assert meta["val_loss"] == vals[meta["step"]]
    with open(os.path.join(best_runs["run"], "training_log.txt")) as fh:
        log = fh.read()
    assert "evaluation: at the end and at each save (--keep-best) | 16 validation rows each, the whole split" in log
    assert "keep the newest 2 and the best" in log


def test_init_from_export_and_sample_accept_the_best_marker(best_runs, tmp_path):
    run = shutil.copytree(best_runs["after7"], tmp_path / "run")
    best = os.path.join(ckpt_root(run), "best")
    step2 = os.path.join(ckpt_root(run), "step_0000002")
    assert train_fsdp.checkpoint_weights(best) == ("sharded", os.path.join(step2, "dcp"))  # --init-from
    with pytest.raises(FileNotFoundError, match="--export"):  # sharded: sample.py says how to export it
        sample.find_checkpoint(best)
    assert ckpt_export.export(best, train_fsdp) == os.path.join(step2, "model.pt")
    assert sample.find_checkpoint(best) == os.path.join(step2, "model.pt")
    assert torch.load(os.path.join(step2, "model.pt"), weights_only=True)["step"] == 2


# =============================================================================================
# --async-save


def writer_run(mode, args, log_prefix, nproc=1):
    """`python THIS writer MODE ARGS` on nproc ranks, forked, in one new process group (Workers)."""
    return Workers(nproc, ["writer", mode, *args], log_prefix, script=THIS)


def test_async_save_killed_mid_write_leaves_the_previous_checkpoint_and_resumes_exactly(tmp_path):
    """The background write of step 4 is held after its data files (DCP's finish never returns):
    training goes on meanwhile (step 5 is logged while step 4 is unwritten), then SIGKILL. The
    previous checkpoint (3) is latest and complete; the same command resumes from it and
    reproduces steps 4 and 5 bit for bit. Every background write is also held until the next
    step has trained, so a checkpoint that was not copied at its step would hold later weights."""
    run_dir = tmp_path / "run"
    args = TINY + ["--out-dir", run_dir, "--cache-dir", tmp_path / "cache"] + ASYNC
    workers = writer_run("hold4", args, str(tmp_path / "killed"))
    tmp4 = os.path.join(ckpt_root(run_dir), ".tmp-step_0000004", "dcp")

    def mid_write():
        try:
            written = any(f.endswith(".distcp") for f in os.listdir(tmp4))
        except OSError:
            return False
        return written and 5 in loss_steps(run_dir)
    try:
        deadline = time.monotonic() + 180
        while not (mid_write() or not workers.alive() or time.monotonic() > deadline):
            threading.Event().wait(0.01)  # poll the files while the trainer runs: a pace, not a sync
    finally:
        workers.kill()
    assert mid_write(), workers.output()
    assert workers.procs[0].returncode == -signal.SIGKILL, workers.output()
    assert not os.path.exists(os.path.join(tmp4, ".metadata"))  # killed before DCP's last file
    assert latest_name(run_dir) == "step_0000003"
    train_fsdp.check_checkpoint(os.path.join(ckpt_root(run_dir), "step_0000003"))
    killed = dict(zip(loss_steps(run_dir), losses_of(run_dir)))

    proc = script_runner.run("train_fsdp.py", args, ROOT, clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resumed_step(run_dir) == 3
    resumed = dict(zip(loss_steps(run_dir), losses_of(run_dir)))
    assert sorted(resumed) == list(range(1, 9))
    assert [resumed[s] for s in (4, 5)] == [killed[s] for s in (4, 5)]  # bit-identical
    assert latest_name(run_dir) == "step_0000008" and not leftovers(run_dir)
    with open(os.path.join(run_dir, "training_log.txt")) as fh:
        assert "in the background (--async-save)" in fh.read()


def test_failed_background_write_stops_every_rank_with_one_line(tmp_path):
    """Rank 1's background write of step 4 fails (a full disk): at the next step boundary both
    ranks stop with exit 1, rank 0 says so in one line, the staging directory is gone and the
    previous checkpoint is latest and intact."""
    run_dir = tmp_path / "run"
    args = TINY + ["--out-dir", run_dir, "--cache-dir", tmp_path / "cache"] + ASYNC
    workers = writer_run("fail4rank1", args, str(tmp_path / "failed"), nproc=2)
    assert workers.wait(timeout=240) == [train_fsdp.EXIT_FAILED] * 2, workers.output()
    stderr = workers.stderr(0)
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert errors[0].startswith("error: saving the checkpoint of step 4 failed (rank 1: OSError: [Errno 28] No space "
                                "left on device"), errors[0]  # the cause, not only DCP's list of failed ranks
    assert errors[0].endswith("the previous checkpoint is intact"), errors[0]
    assert loss_steps(run_dir) == [1, 2, 3, 4, 5]  # found at the boundary after step 5
    assert latest_name(run_dir) == "step_0000003" and not leftovers(run_dir)
    train_fsdp.check_checkpoint(os.path.join(ckpt_root(run_dir), "step_0000003"))


def test_async_save_needs_sharded_checkpoints(tmp_path):
    proc = script_runner.run("train_fsdp.py", ["--async-save", "--checkpoint-type", "full", "--out-dir",
                                               tmp_path / "run"], ROOT, clean_env())
    assert proc.returncode == train_fsdp.EXIT_BAD_INPUT
    assert proc.stderr.strip() == ("error: --async-save needs --checkpoint-type sharded (a full checkpoint is one "
                                   "file that rank 0 writes with torch.save)")
    assert not os.path.exists(tmp_path / "run")


# =============================================================================================
# Flight recorder


def test_debug_sets_the_flight_recorder_before_the_process_group(best_runs):
    dumps = os.path.join(os.path.abspath(best_runs["debug"]), "flight_recorder", "rank_")
    assert best_runs["env"] == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": dumps,
                                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dumps}
    assert os.path.isdir(os.path.dirname(dumps))
    with open(os.path.join(best_runs["debug"], "training_log.txt")) as fh:
        assert f"flight recorder: the last 2000 collectives per rank, dumped on a collective timeout (NCCL) to " \
               f"{dumps}<rank>" in fh.read()


def test_slurm_submit_turns_the_flight_recorder_on_into_the_run_directory():
    with open(os.path.join(ROOT, "slurm_submit.sh")) as fh:
        script = fh.read()
    srun = script.index("\nsrun ")
    for line in ('export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}',
                 'export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}',
                 'FR_PREFIX="$(realpath -m "${RUN_DIR}")/flight_recorder/rank_"',
                 'export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-${FR_PREFIX}}'):
        assert 0 < script.index(line) < srun, line
    assert script.index("RUN_DIR=${RUN_DIR:-") < script.index("FR_PREFIX=")


# =============================================================================================
# The patched trainer (run as a script by the tests above)


def scripted_runs(spec_file):
    """Each run of the spec in turn, in this process: the real evaluation runs (a collective),
    but the validation loss it reports is the spec's for the step just trained."""
    from torch.distributed.checkpoint import filesystem  # noqa: F401  (imported before the runs)
    with open(spec_file) as fh:
        spec = json.load(fh)
    now = {"step": 0, "val": None}
    real_lr_at, real_evaluate, real_init = train_fsdp.lr_at, train_fsdp.evaluate, train_fsdp.dist.init_process_group

    def lr_at(step, *args):  # called once per step, with the step about to be trained
        now["step"] = step + 1
        return real_lr_at(step, *args)

    def evaluate(*args):
        val = real_evaluate(*args)
        return val if now["val"] is None else {**val, "loss": now["val"][str(now["step"])]}

    def init_process_group(*args, **kwargs):  # what the flight recorder reads, as the group is made
        names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        if "--debug" in now["argv"]:
            out = os.path.join(os.path.dirname(now["argv"][now["argv"].index("--out-dir") + 1]), "debug_env.json")
            with open(out, "w") as fh:
                json.dump({n: os.environ.get(n) for n in names}, fh)
        return real_init(*args, **kwargs)
    train_fsdp.lr_at, train_fsdp.evaluate, train_fsdp.dist.init_process_group = lr_at, evaluate, init_process_group
    for run in spec:
        now["val"], now["argv"] = run["val"], run["argv"]
        train_fsdp.main(run["argv"])
        if run.get("copy"):
            shutil.copytree(run["argv"][run["argv"].index("--out-dir") + 1], run["copy"])


def patched_writer(mode):
    """hold4: every background write waits until a later step has trained, and DCP's last step
    of the write of step 4 never returns. fail4rank1: rank 1's write of step 4 fails (ENOSPC)."""
    from torch.distributed.checkpoint import filesystem
    Writer = filesystem._FileSystemWriter
    real_write, real_finish, real_start, real_step = (Writer.write_data, Writer.finish,
                                                     train_fsdp.Checkpointer.start_async_save, train_fsdp.train_step)
    trained = threading.Condition()
    state = {"steps": 0, "armed": {}}

    def train_step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        with trained:
            state["steps"] += 1
            trained.notify_all()
        return out

    def start_async_save(self, path, *args, **kwargs):
        state["armed"][os.path.basename(path)] = state["steps"]
        return real_start(self, path, *args, **kwargs)

    def write_data(self, plan, planner):
        name = os.path.basename(os.path.dirname(str(self.path))).removeprefix(".tmp-")
        if threading.current_thread() is not threading.main_thread() and mode == "hold4":
            with trained:
                trained.wait_for(lambda: state["steps"] > state["armed"][name])
        if mode == "fail4rank1" and name == "step_0000004" and os.environ.get("RANK") == "1":
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real_write(self, plan, planner)

    def finish(self, metadata, results):
        if mode == "hold4" and str(self.path).endswith(os.path.join(".tmp-step_0000004", "dcp")):
            threading.Event().wait()  # held until the test kills the process
        return real_finish(self, metadata, results)
    Writer.write_data, Writer.finish = write_data, finish
    train_fsdp.Checkpointer.start_async_save, train_fsdp.train_step = start_async_save, train_step


if __name__ == "__main__":
    if sys.argv[1] == "runs":
        scripted_runs(sys.argv[2])
        train_fsdp.leave(0)  # see leave(): avoids a gloo teardown race at interpreter exit
    elif sys.argv[1] == "writer":
        patched_writer(sys.argv[2])
        sys.argv = ["train_fsdp.py", *sys.argv[3:]]
        train_fsdp.run()
