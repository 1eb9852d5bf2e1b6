"""Issue 12, a hostile try-out: never lose a run, and bad input writes nothing.

  1. every checkpoint of a run damaged in size: the trainer refuses (exit 2), never retrains over it
  2. SIGUSR1 to torchrun: its workers stop at the next step, save, write stopped.json and exit;
     and no rank exits before that file is written (a stop is complete on every node)
  3. data errors found before or during tokenising leave no --cache-dir entry behind
  4. --tokenizer that is not a SentencePiece model: one line naming the flag, exit 2
  5. every float setting refuses inf and nan
  6. --export on a directory that is not a checkpoint: exit 2, "no meta.json"
  7. sample.py: one `error:` line for bad types and values (--temperature < 0), exit 2
  8. --resume PATH that does not exist names --resume

Issue 24, a second try-out:

  9. a corpus edited, or a file added to a directory corpus, after a run: its resume is refused
 10. a second launch into a run directory in use is refused, naming the holder; once the holder is
     killed, the same command resumes
 11. a disk that fills during a background save: one line naming it, exit 1 on every rank, the
     latest checkpoint intact and no staging directory left
 12. --init-from a damaged checkpoint: the size check of a resume, before anything is written
 13. sample.py on a damaged model.pt that --export wrote: one line; the export records its size
 14. --resume CHECKPOINT with another config names that checkpoint and what differs
 15. a damaged best checkpoint is no longer named best at the next save (said)

One short one-process run serves as the damaged run and as sample.py's checkpoint; the other
command lines stop before training, two at a time.
"""
import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import script_runner  # noqa: E402

import ckpt_export  # noqa: E402
import data as data_lib  # noqa: E402
import sample  # noqa: E402
import train_fsdp  # noqa: E402
from test_checkpoint import (  # noqa: E402
    Workers,
    cli,
    error_line,
    latest_name,
    leftovers,
    n_loss_records,
    snapshot,
)
from test_data import english  # noqa: E402
from test_distributed import TINY, clean_env  # noqa: E402

ONE = TINY + ["--strategy", "none", "--max-steps", "2", "--save-every", "1"]  # checkpoints 1 and 2


def tree(path):
    """Every file and directory under path (empty when path does not exist)."""
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, ds, fs in os.walk(path) for n in ds + fs)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished one-process run with two sharded checkpoints (the last with model.pt)."""
    tmp = tmp_path_factory.mktemp("hostile")
    run_dir = tmp / "run"
    proc = cli(ONE + ["--out-dir", run_dir, "--cache-dir", tmp / "cache"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def refusals(run, tmp_path_factory):
    """Command lines that must stop with bad input, run two at a time: {name: (process, paths)}."""
    tmp = tmp_path_factory.mktemp("refusals")
    jobs = {}

    def damaged(name, drop_config):
        d = shutil.copytree(run, tmp / name)
        for step in ("step_0000001", "step_0000002"):  # truncate -s -100 on a shard of each checkpoint
            shard = os.path.join(d, "checkpoints", step, "dcp", "__0_0.distcp")
            os.truncate(shard, os.path.getsize(shard) - 100)
        if drop_config:
            os.remove(os.path.join(d, "config.json"))
        before = snapshot(d)
        return lambda: (cli(ONE + ["--out-dir", d, "--cache-dir", tmp / "cache"]), before)

    jobs["damaged"] = damaged("damaged", False)
    jobs["damaged_no_config"] = damaged("damaged_no_config", True)
    jobs["lr_inf"] = lambda: cli(ONE + ["--lr", "inf", "--out-dir", tmp / "lr_inf", "--cache-dir", tmp / "c1"])
    (tmp / "corpus.txt").write_text(english(200))
    (tmp / "bad.model").write_text("hello, I am not a model\n")
    jobs["tokenizer"] = lambda: cli(ONE + ["--dataset", tmp / "corpus.txt", "--tokenizer", tmp / "bad.model",
                                           "--out-dir", tmp / "tok", "--cache-dir", tmp / "c2"])
    init = shutil.copytree(run, tmp / "init_src")
    shard = os.path.join(init, "checkpoints", "step_0000001", "dcp", "__0_0.distcp")
    os.truncate(shard, os.path.getsize(shard) // 5)
    with open(os.path.join(init, "checkpoints", "best"), "w") as fh:
        fh.write("step_0000001\n")
    jobs["init_damaged"] = lambda: cli(ONE + ["--init-from", os.path.join(init, "checkpoints", "best"),
                                              "--out-dir", tmp / "init", "--cache-dir", tmp / "c4"])
    jobs["resume_other"] = lambda: cli(ONE + ["--resume", os.path.join(run, "checkpoints", "step_0000001"),
                                              "--n-layer", "4", "--out-dir", tmp / "new1", "--cache-dir", tmp / "c5"])
    jobs["resume_missing"] = lambda: cli(ONE + ["--resume", tmp / "other", "--out-dir", tmp / "res",
                                                "--cache-dir", tmp / "c3"])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}, tmp


# =============================================================================================
# 1. Every checkpoint damaged


@pytest.mark.parametrize("name", ["damaged", "damaged_no_config"])
def test_a_run_whose_checkpoints_are_all_damaged_is_refused_not_trained_over(refusals, name):
    results, tmp = refusals
    proc, before = results[name]
    line = error_line(proc, train_fsdp.EXIT_BAD_INPUT, alone=True)
    assert "none of its checkpoints is complete" in line and "__0_0.distcp has" in line, line
    assert "--init-from" in line and "--overwrite" in line, line
    assert snapshot(tmp / name) == before  # metrics, config, the damaged checkpoints: untouched


# =============================================================================================
# 2. SIGUSR1 to torchrun; every rank stays until the stop is complete

# Rank 0 writes stopped.json 1 s late, as on a slow shared filesystem; every rank records at its
# exit whether the file was there.
SLOW_STOP = """
import os, sys, time
sys.path.insert(0, {root!r})
import train_fsdp
write, leave = train_fsdp.write_text_atomic, train_fsdp.leave
run_dir, rank = sys.argv[sys.argv.index("--out-dir") + 1], os.environ["RANK"]
def slow_write(path, text):
    if path.endswith(train_fsdp.STOPPED_FILE):
        time.sleep(1)
    write(path, text)
def recording_leave(code):
    with open(os.path.join(run_dir, "..", "exit_rank" + rank), "w") as fh:
        fh.write(str(os.path.exists(os.path.join(run_dir, train_fsdp.STOPPED_FILE))))
    leave(code)
train_fsdp.write_text_atomic, train_fsdp.leave = slow_write, recording_leave
train_fsdp.run()
"""


def children(pid):
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):  # a child belongs to the thread that started it
        with open(f"/proc/{pid}/task/{tid}/children") as fh:
            found += [int(p) for p in fh.read().split()]
    return found


def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_usr1_to_torchrun_stops_its_workers_with_a_saved_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    wrapper = tmp_path / "slow_stop.py"
    wrapper.write_text(SLOW_STOP.format(root=ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", str(wrapper),
           *map(str, TINY + ["--max-steps", "200", "--out-dir", run_dir, "--cache-dir", tmp_path / "cache"])]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        torchrun = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=out, stderr=err, start_new_session=True)
    workers = []
    try:
        deadline = time.monotonic() + 120
        while n_loss_records(run_dir) < 2:
            assert torchrun.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()[-3000:]
            time.sleep(0.01)
        workers = children(torchrun.pid)
        assert len(workers) == 2, workers
        os.kill(torchrun.pid, signal.SIGUSR1)
        assert torchrun.wait(timeout=30) == -signal.SIGUSR1  # torchrun does not handle USR1: it dies
        deadline = time.monotonic() + 120
        while any(map(running, workers)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(map(running, workers)), "the workers went on without their launcher"
    finally:
        for pid in [torchrun.pid] + workers:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        torchrun.wait()
    log = (tmp_path / "err").read_text()
    stopped = run_dir / train_fsdp.STOPPED_FILE
    assert stopped.exists(), log[-3000:]
    step = json.loads(stopped.read_text())["step"]
    assert step < 200 and f"launcher gone (torchrun exited and left its workers running) at step {step}: " \
        "checkpoint saved, exiting with code 3" in log, log[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:07d}"
    assert train_fsdp.check_checkpoint(str(run_dir / "checkpoints" / f"step_{step:07d}"))["step"] == step
    # Rank 1 waited for rank 0's late stopped.json: no process left before the stop was complete.
    assert [(tmp_path / f"exit_rank{r}").read_text() for r in (0, 1)] == ["True", "True"]


# =============================================================================================
# 3, 4. Data errors write nothing

GOOD = json.dumps({"text": english(60)}) + "\n"


@pytest.mark.parametrize("name, files, kw, match", [
    ("empty corpus", {"c.txt": "\n  \n"}, {}, r"--dataset \S*c\.txt: the corpus is empty"),
    ("line not JSON", {"c.jsonl": GOOD + "{not json\n"}, {}, r"c\.jsonl line 2: not a JSON object"),
    ("line without text", {"c.jsonl": GOOD + '{"title": "x"}\n'}, {}, r"line 2: not a JSON object with a \"text\""),
    ("text a number", {"c.jsonl": GOOD + '{"text": 5}\n'}, {}, r"line 2: not a JSON object with a \"text\""),
    ("empty val path", {"c.jsonl": GOOD, "v.txt": "\n"}, {"val_path": "v.txt"},
     r"--val-path \S*v\.txt: the corpus is empty"),
    ("bad val line", {"c.jsonl": GOOD, "v.jsonl": GOOD + "[1]\n"}, {"val_path": "v.jsonl"}, r"v\.jsonl line 2"),
    ("seq-len over the data", {"c.jsonl": GOOD}, {"seq_len": 100000},
     r"split has \d+ tokens, fewer than --seq-len 100000"),
    ("not a tokenizer", {"c.jsonl": GOOD, "t.model": "not a model"}, {"tokenizer": "t.model"},
     r"--tokenizer \S*t\.model: not a SentencePiece model; give a \.model file written by SentencePiece"),
])
def test_bad_data_writes_no_cache(tmp_path, name, files, kw, match):
    for fname, text in files.items():
        (tmp_path / fname).write_text(text)
    kw = {k: str(tmp_path / v) if k in ("val_path", "tokenizer") else v for k, v in kw.items()}
    cfg = data_lib.DataConfig(dataset=str(tmp_path / next(iter(files))), tokenizer_type="char",
                              cache_dir=str(tmp_path / "deep" / "data_cache"), **kw)
    with pytest.raises(data_lib.DataError, match=match) as err:
        data_lib.prepare_data(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "deep").exists(), tree(tmp_path / "deep")


def test_a_failed_rebuild_leaves_the_old_cache_as_it_was(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(GOOD)
    cfg = data_lib.DataConfig(dataset=str(corpus), tokenizer_type="char", seq_len=8, cache_dir=str(tmp_path / "cache"))
    data_lib.prepare_data(cfg)
    before = snapshot(tmp_path / "cache")
    corpus.write_text(GOOD + "not json\n")  # edited: the cache is stale and the rebuild fails
    with pytest.raises(data_lib.DataError, match="line 2: not a JSON object"):
        data_lib.prepare_data(cfg)
    assert snapshot(tmp_path / "cache") == before
    corpus.write_text(GOOD + GOOD)  # fixed: rebuilt in place of the old one
    data_lib.prepare_data(cfg)
    assert len(data_lib.open_dataset(cfg, seed=0).train_tokens) > len(english(60))
    (entry,) = os.listdir(tmp_path / "cache")  # no temporary or set-aside directory left
    assert sorted(os.listdir(tmp_path / "cache" / entry)) == [
        "manifest.json", "tokenizer.model", "tokenizer.vocab", "train.bin", "val.bin"]


def test_trainer_with_a_bad_tokenizer_writes_nothing(refusals):
    results, tmp = refusals
    line = error_line(results["tokenizer"], train_fsdp.EXIT_BAD_INPUT, alone=True)
    assert line.startswith(f"error: --tokenizer {tmp / 'bad.model'}: not a SentencePiece model"), line
    assert not (tmp / "tok").exists() and not (tmp / "c2").exists()


# =============================================================================================
# 5. inf and nan


def test_every_float_setting_refuses_inf_and_nan():
    accepted = []
    for section, obj in train_fsdp.sections(train_fsdp.Config()).items():
        for f in dataclasses.fields(obj):
            if f.type not in (float, "float"):
                continue
            for value in ("inf", "-inf", "nan"):
                flag = train_fsdp.flag_name(f.name)
                try:
                    train_fsdp.check_config(train_fsdp.parse_config([f"{flag}={value}"]))
                    accepted.append(f"{flag} {value}")
                except train_fsdp.BadInput as e:
                    assert str(e).startswith(f"{flag} {float(value)}: must be a finite number"), str(e)
    assert not accepted


def test_lr_inf_is_refused_before_anything_is_written(refusals):
    results, tmp = refusals
    line = error_line(results["lr_inf"], train_fsdp.EXIT_BAD_INPUT, alone=True)
    assert line == "error: --lr inf: must be a finite number > 0", line
    assert not (tmp / "lr_inf").exists() and not (tmp / "c1").exists()


# =============================================================================================
# 6. --export on something that is not a checkpoint


def test_export_of_a_directory_without_meta_json_is_bad_input(run, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(train_fsdp.BadInput, match=r"--export \S*empty: not a checkpoint directory \(no meta\.json\)"):
        train_fsdp.main(["--export", str(tmp_path / "empty")])
    with pytest.raises(train_fsdp.BadInput, match=r"is a run directory, not a checkpoint directory \(no meta\.json\); "
                                                  r"give one of its checkpoints, e\.g\. \S*step_0000002"):
        train_fsdp.main(["--export", str(run)])
    with pytest.raises(train_fsdp.BadInput, match="no such directory"):
        train_fsdp.main(["--export", str(tmp_path / "missing")])
    assert tree(tmp_path) == ["empty"]


# =============================================================================================
# 7. sample.py


@pytest.mark.parametrize("argv, message", [
    (["--top-k", "abc"], "error: argument --top-k: invalid int value: 'abc'"),
    (["--temperature", "-1"], "error: --temperature -1.0: must be a finite number >= 0"),
    (["--temperature", "nan"], "error: --temperature nan: must be a finite number >= 0"),
    (["--num-samples", "0", "--demo"], "error: --num-samples 0: must be >= 1"),
    (["--max-new-tokens", "-5"], "error: --max-new-tokens -5: must be >= 0"),
    (["--prompt", "hello"], "error: --prompt 'hello': characters"),
])
def test_sample_bad_input_is_one_error_line(run, capsys, argv, message):
    before = snapshot(run)
    with pytest.raises(SystemExit) as exit_:
        sample.main(["--ckpt", str(run), "--device", "cpu", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(message), err
    assert snapshot(run) == before  # no demo.json


# =============================================================================================
# 8. --resume PATH that does not exist


def test_resume_from_a_missing_path_names_resume(refusals):
    results, tmp = refusals
    line = error_line(results["resume_missing"], train_fsdp.EXIT_BAD_INPUT, alone=True)
    assert line.startswith(f"error: --resume {tmp / 'other'}: no such directory; valid: auto, never or a "
                           "checkpoint directory"), line
    assert not (tmp / "res").exists()


# =============================================================================================
# 9. The data changed under a run


def test_a_resume_on_changed_data_is_refused_with_a_list(tmp_path):
    """A run on a directory corpus (character tokenizer); then its file is edited (the same
    characters, other counts: the retrained tokenizer has the same size and other ids) and a file
    is added. The same command is refused, naming each change, and writes nothing."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = english(200)
    (corpus / "a.txt").write_text(text)
    args = ONE + ["--dataset", corpus, "--tokenizer-type", "char", "--seq-len", "16", "--out-dir", tmp_path / "run",
                  "--cache-dir", tmp_path / "cache"]
    proc = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (corpus / "a.txt").write_text(text.replace("the", "eee"))  # sed -i s/the/eee/g
    (corpus / "b.txt").write_text(text[:2000])
    before = snapshot(tmp_path / "run")
    line = error_line(cli(args), train_fsdp.EXIT_BAD_INPUT, alone=True)
    assert f"--out-dir {tmp_path / 'run'} already holds a run with other data (" in line, line
    for change in (f"corpus {corpus / 'a.txt'} changed", f"corpus {corpus / 'b.txt'} added", "tokenizer changed"):
        assert f"data: {change}" in line, line
    assert snapshot(tmp_path / "run") == before  # nothing written


# =============================================================================================
# 10. One writer per run directory


def test_a_second_launch_into_a_run_directory_in_use_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    args = TINY + ["--strategy", "none", "--max-steps", "100000", "--save-every", "5", "--out-dir", run_dir,
                   "--cache-dir", tmp_path / "cache"]
    first = script_runner.start("train_fsdp.py", args, ROOT, clean_env(), os.devnull, os.devnull)
    try:
        deadline = time.monotonic() + 120
        while n_loss_records(run_dir) < 10:  # training, with a checkpoint saved
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        config = (run_dir / "config.json").stat().st_mtime_ns
        line = error_line(cli(args), train_fsdp.EXIT_BAD_INPUT, alone=True)
        holder = f"host {socket.gethostname()} pid {first.pid}"
        assert line == (f"error: --out-dir {run_dir} is in use by {holder}: a run directory takes one run at a time; "
                        "wait for it to end or stop it, or choose another --out-dir"), line
        assert first.poll() is None  # the first run trains on, its files untouched by the second launch
        assert (run_dir / "config.json").stat().st_mtime_ns == config
        assert (run_dir / "run.lock").read_text() == holder + "\n"
    finally:
        first.kill()
        first.wait()
    # Killed, the first run holds nothing: the same command (ending sooner) resumes its checkpoint.
    proc = cli(args + ["--max-steps", "5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout, proc.stdout[-3000:]


# =============================================================================================
# 11. The disk fills during a background save

# A stub of a disk that fills: once the save of step 10 has begun, the writes of this process
# into RUN_DIR (or RUN_DIR/checkpoints) have `space` bytes left, then fail as on a full disk, whose
# file system has no space left. (Files torch.save writes by name are written in C++, unseen by
# the stub: the RNG states.)
FULL_DISK = """
import builtins, errno, io, os, shutil, sys
sys.path.insert(0, {root!r})
run_dir = os.path.abspath(sys.argv[sys.argv.index("--out-dir") + 1])
full_under = os.path.join(run_dir, {under!r})
left, real_open, real_usage = [None], io.open, shutil.disk_usage
def space_left():  # None until the save of step 10 begins
    if left[0] is None and os.path.exists(os.path.join(run_dir, "checkpoints", ".tmp-step_0000010")):
        left[0] = {space}
    return left[0]
class FullDisk:
    def __init__(self, f):
        self.f = f
    def write(self, data):
        size = len(data) if isinstance(data, str) else memoryview(data).nbytes
        if space_left() is not None:
            if size > left[0]:
                left[0] = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            left[0] -= size
        return self.f.write(data)
    def __getattr__(self, name):
        return getattr(self.f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
def full_open(file, mode="r", *args, **kw):
    f = real_open(file, mode, *args, **kw)
    named = isinstance(file, (str, os.PathLike)) and os.path.abspath(file).startswith(full_under)
    return FullDisk(f) if named and set(mode) & set("wax+") else f
def disk_usage(path):
    return real_usage(path) if space_left() is None else real_usage(path)._replace(free=left[0])
builtins.open = io.open = full_open
shutil.disk_usage = disk_usage
sys.argv[0] = "train_fsdp.py"
import train_fsdp
train_fsdp.run()
"""


@pytest.mark.parametrize("under, space, message", [
    ("", 0, r"error: writing \S+/(metrics\.jsonl|training_log\.txt) failed on rank 0 \(OSError: \[Errno 28\] No "
            r"space left on device\); the latest checkpoint is intact"),
    ("checkpoints", 2048, r"error: saving the checkpoint of step 10 failed \(rank \d: RuntimeError: .* unexpected "
                          r"pos \d+ vs \d+ \(its file system is full: 0 bytes free\)\); the previous checkpoint is "
                          r"intact")], ids=["log", "save"])
def test_a_disk_full_during_a_background_save_stops_every_rank_with_one_line(tmp_path, under, space, message):
    """The disk fills while step 10 is written in the background: with `under` "", the run's log
    fails first (the issue's rank 0 traceback in the metrics flush); with "checkpoints", the save."""
    wrapper = tmp_path / "full_disk.py"
    wrapper.write_text(FULL_DISK.format(root=ROOT, under=under, space=space))
    run_dir = tmp_path / "run"
    args = TINY + ["--max-steps", "30", "--save-every", "5", "--async-save", "--out-dir", run_dir,
                   "--cache-dir", tmp_path / "cache"]
    workers = Workers(2, args, str(tmp_path / "log"), script=wrapper)
    assert workers.wait(timeout=120) == [train_fsdp.EXIT_FAILED] * 2, workers.output()
    assert not any("Traceback" in workers.stderr(rank) for rank in (0, 1)), workers.output()
    errors = [line for line in workers.stderr(0).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.fullmatch(message, errors[0]), workers.output()
    assert latest_name(run_dir) == "step_0000005" and not leftovers(run_dir)
    assert train_fsdp.check_checkpoint(str(run_dir / "checkpoints" / "step_0000005"))["step"] == 5


# =============================================================================================
# 12. --init-from a damaged checkpoint


def test_init_from_a_damaged_checkpoint_is_refused_before_anything_is_written(refusals):
    results, tmp = refusals
    line = error_line(results["init_damaged"], train_fsdp.EXIT_BAD_INPUT, alone=True)
    step = tmp / "init_src" / "checkpoints" / "step_0000001"
    assert line.startswith(f"error: --init-from {step}: checkpoint {step} is incomplete or corrupted: "
                           "dcp/__0_0.distcp has "), line
    assert not (tmp / "init").exists()


# =============================================================================================
# 13. A damaged export


def test_sample_on_a_damaged_export_is_one_line_and_the_export_records_its_size(run, tmp_path, capsys):
    step = shutil.copytree(os.path.join(run, "checkpoints", "step_0000001"), tmp_path / "step_0000001")
    saved = os.stat(step / "meta.json").st_mtime_ns
    model_pt = ckpt_export.export(str(step), train_fsdp)
    # meta.json lists model.pt's size (its mtime, by which checkpoints are ordered, unchanged)
    assert train_fsdp.check_checkpoint(str(step))["files"]["model.pt"] == os.path.getsize(model_pt)
    assert os.stat(step / "meta.json").st_mtime_ns == saved
    os.truncate(model_pt, os.path.getsize(model_pt) // 5)
    with pytest.raises(train_fsdp.RunFailed, match=r"model\.pt has \d+ bytes, \d+ expected"):
        train_fsdp.check_checkpoint(str(step))  # what --init-from, --resume and --export see now
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        sample.main(["--ckpt", str(step), "--device", "cpu"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --ckpt {model_pt} cannot be read ("), err
    assert "the checkpoint is damaged" in err, err


# =============================================================================================
# 14. --resume CHECKPOINT with another config


def test_resume_of_a_checkpoint_with_another_config_names_the_checkpoint(run, refusals):
    results, tmp = refusals
    line = error_line(results["resume_other"], train_fsdp.EXIT_BAD_INPUT, alone=True)
    step = os.path.join(run, "checkpoints", "step_0000001")
    assert line == (f"error: --resume {step} was saved with another config (model.n_layer: 2 -> 4); resuming would "
                    "silently change its run: resume it with its own settings, or start a new run from its weights "
                    "with --init-from"), line
    assert not (tmp / "new1").exists()


# =============================================================================================
# 15. A damaged best checkpoint


def test_a_damaged_best_checkpoint_gives_way_at_the_next_save(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    root.mkdir()
    cfg = train_fsdp.Config()

    def save(step, val_loss):  # a checkpoint of one file, published as a run's save is
        tmp = root / f".tmp-step_{step:07d}"
        tmp.mkdir()
        (tmp / "rng_rank0.pt").write_bytes(b"x" * 100)
        meta = train_fsdp.checkpoint_meta(cfg, step, 0, "", None, 1, val_loss=val_loss)
        train_fsdp.publish_checkpoint(str(root / f"step_{step:07d}"), meta, 2, keep_best=True)
    save(1, 1.0)
    save(2, 2.0)
    assert (root / "best").read_text() == "step_0000001\n"
    os.truncate(root / "step_0000001" / "rng_rank0.pt", 20)
    save(3, 3.0)
    assert (root / "best").read_text() == "step_0000002\n"  # the lowest loss of the intact ones
    assert f"{root / 'step_0000001'} is incomplete or corrupted: rng_rank0.pt has 20 bytes, 100 expected " \
        f"(truncated?): {root / 'best'} no longer names it" in capsys.readouterr().out
    assert sorted(os.listdir(root)) == ["best", "latest", "step_0000002", "step_0000003"]  # pruned like any other


def test_a_full_stdout_is_kept_not_raised_on_rank_0(tmp_path, monkeypatch):
    """stdout redirected to a full disk (a Slurm log): rank 0's log line keeps the error, as a
    failed metrics write does, and main() stops every rank on it at the next step; raising there
    would stop rank 0 alone and leave the others waiting in a collective."""
    def full(msg):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(train_fsdp.tqdm, "write", full)
    log = train_fsdp.RunLog(str(tmp_path), 0)
    log.line("step 1")
    log.close()
    assert "writing stdout failed on rank 0" in log.error and "No space left" in log.error
    assert (tmp_path / "training_log.txt").read_text() == "step 1\n"

