"""--tensorboard and --wandb (the real packages, W&B offline) and the demonstration's
figure: what the trackers hold is what metrics.jsonl holds, also across a resume that replays
steps a stopped attempt had logged; a tracker that fails mid-run costs one line, not the run; a
missing optional package is one error line and nothing written."""
import glob
import json
import os
import shutil
import struct
import sys

import pytest
import torch.distributed.run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import script_runner  # noqa: E402

import train_fsdp  # noqa: E402
from test_distributed import TINY, clean_env, run_ranks  # noqa: E402

pytest.importorskip("tensorboard", reason="pip install tensorboard (.ci/run does)")
pytest.importorskip("wandb", reason="pip install wandb (.ci/run does)")
pytest.importorskip("matplotlib", reason="pip install matplotlib (.ci/run does)")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

# 6 steps, all logged, validation every 2; the checkpoint of step 4 is the latest: a second
# attempt resumes there and logs steps 5 and 6 again, as after a stop between two saves.
TRACKED = TINY + ["--max-steps", "6", "--eval-every", "2", "--save-every", "4", "--no-save-final", "--tensorboard",
                  "--wandb", "tests"]


def wandb_env(tmp):
    env = clean_env()
    env.update(WANDB_MODE="offline", WANDB_CONFIG_DIR=str(tmp / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp / "wandb-cache"), WANDB_DATA_DIR=str(tmp / "wandb-data"))
    return env


def drive(tmp, name, argv, nproc):
    """Run train_fsdp.main(argv) through tests/dist_driver.py on nproc ranks (run_ranks())."""
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps({name: argv}))
    for res in run_ranks("tests/dist_driver.py", [spec], nproc, wandb_env(tmp), timeout=300):
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))  # the synthetic data, made once


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, cache):
    """A run on 2 processes (rank 0 alone writes to the trackers), resumed on one."""
    tmp = tmp_path_factory.mktemp("trackers")
    run = tmp / "run"
    argv = TRACKED + ["--out-dir", str(run), "--cache-dir", cache]
    drive(tmp, "first", argv, nproc=2)
    drive(tmp, "resumed", argv, nproc=1)
    assert "resumed from" in (run / "training_log.txt").read_text()
    return run


def metric_records(run):
    with open(run / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


def scalars_by_key(records):
    """{key: {step: value}} of every scalar of metrics.jsonl; a step twice fails (but tokens_seen,
    which a validation at a log step repeats)."""
    out = {}
    for r in records:
        for key, value in r.items():
            if key != "step":
                assert out.setdefault(key, {}).get(r["step"], value) == value and (
                    r["step"] not in out[key] or key == "tokens_seen"), (key, r["step"])
                out[key][r["step"]] = value
    return out


def tensorboard_scalars(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)  # no step twice
        out[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return out, acc


def wandb_records(path):
    """The records of a .wandb file, decoded with W&B's own protobuf. The file is a LevelDB-style
    log (W&B ships no Python reader for it): a 7-byte header, then blocks of 32 KiB of chunks,
    each with a 7-byte header (crc, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    raw, pos, chunks = open(path, "rb").read(), 7, b""
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the padding at the end of a block
            pos += left
            continue
        chunks += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""


def wandb_history(run):
    """{step: {key: value}} over every W&B file of the run (one per attempt), the run ids, the
    config each attempt sent."""
    history, ids, configs = {}, set(), []
    for path in sorted(glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                configs.append({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "history":
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                step = record.history.step.num
                assert step not in history, f"W&B step {step} twice"
                history[step] = {k: v for k, v in row.items() if not k.startswith("_")}
    return history, ids, configs


def test_tensorboard_holds_what_metrics_jsonl_holds_across_a_resume(tracked):
    """Every scalar of metrics.jsonl, at its step, once: the resumed attempt's steps 5 and 6
    replace the first attempt's (purge_step), as in metrics.jsonl; the config is there too."""
    expected = scalars_by_key(metric_records(tracked))
    assert sorted(expected["loss"]) == [1, 2, 3, 4, 5, 6] and sorted(expected["val_loss"]) == [2, 4, 6]
    assert sorted(expected["tokens_seen"]) == [1, 2, 3, 4, 5, 6]  # validation records carry it too
    got, acc = tensorboard_scalars(tracked / "tensorboard")
    assert set(got) == set(expected)
    for key, by_step in expected.items():
        assert got[key] == pytest.approx(by_step, rel=1e-6), key  # TensorBoard stores float32
    assert len(glob.glob(str(tracked / "tensorboard" / "events.out.tfevents.*"))) == 2  # rank 0, two attempts
    config = {e.step: json.loads(e.tensor_proto.string_val[0]) for e in acc.Tensors("config/text_summary")}
    assert config == {0: json.loads((tracked / "config.json").read_text()), 4: config[0]}  # each attempt's


def test_wandb_offline_run_holds_the_history(tracked):
    """The same W&B run (its id kept in wandb_run.json) in two offline files; every step once,
    with the values of metrics.jsonl. W&B takes no step twice: steps 5 and 6 stay the first
    attempt's, equal to the resumed ones but for timing (losses: one process vs two, 1e-5)."""
    expected = scalars_by_key(metric_records(tracked))
    history, ids, configs = wandb_history(tracked)
    state = json.loads((tracked / "wandb_run.json").read_text())
    assert ids == {state["id"]} and state["step"] == 6
    assert len(configs) == 2 and configs[0]["train"]["wandb"] == "tests" and configs[0]["model"]["n_layer"] == 2
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    for key, by_step in expected.items():
        for step, value in by_step.items():
            if step <= 4:
                assert history[step][key] == value, (key, step)
            elif key in ("loss", "val_loss", "lr", "tokens_seen"):
                assert history[step][key] == pytest.approx(value, rel=1e-5), (key, step)
    assert set(history[6]) == {k for k, v in expected.items() if 6 in v}


def test_the_demonstration_reaches_both_trackers(tracked, tmp_path):
    """sample.py --demo logs its shares and its figure (runs_report.demo_to_trackers) to the run's
    TensorBoard (at the checkpoint's step) and W&B run (after its last step); the figure is a real image."""
    run = tmp_path / "run"
    shutil.copytree(tracked, run)
    summary = {"arch": "baseline", "batches": 2, "batch_size": 4,
               "block_starts": {"fixed_z": [[3, 3, 3, 9], [0, 0, 0, 0]], "fresh_z": [[1, 2, 3, 4], [5, 6, 7, 56]]}}
    for name, share in (("fixed_z", 0.875), ("fresh_z", 0.25)):
        summary[name] = {"same_start_share": share, "well_formed_share": 1.0, "start_entropy": 1.0,
                         "same_noise_share": 0.1}
    code = (f"import json, runs_report, sample; s = json.loads({json.dumps(json.dumps(summary))}); "
            f"runs_report.demo_to_trackers({str(run)!r}, {{'tensorboard': True, 'wandb': 'tests'}}, 6, s, "
            "sample.block_start_figure(s))")
    res = script_runner.run("-c", [code], ROOT, wandb_env(tmp_path), timeout=120)
    assert res.returncode == 0 and "failed" not in res.stdout, res.stdout + res.stderr
    got, acc = tensorboard_scalars(run / "tensorboard")
    assert got["demo/fixed_z/same_start_share"] == {6: 0.875}
    assert [(e.step, e.width, e.height) for e in acc.Images("demo/block_starts")] == [(6, 1000, 320)]
    assert got["loss"] == pytest.approx(tensorboard_scalars(tracked / "tensorboard")[0]["loss"])  # not purged
    history, ids, _ = wandb_history(run)
    assert len(ids) == 1 and sorted(history) == [1, 2, 3, 4, 5, 6, 7]
    assert history[7]["demo/fresh_z/same_start_share"] == 0.25
    assert history[7]["demo/block_starts/_type"] == "image-file"
    image = glob.glob(str(run / "wandb" / "offline-run-*" / "files" / history[7]["demo/block_starts/path"]))
    assert len(image) == 1 and png_size(image[0]) == (1000, 320)
    assert json.loads((run / "wandb_run.json").read_text())["step"] == 7


def png_size(path):
    with open(path, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_a_tracker_that_fails_mid_run_costs_one_line(tmp_path, monkeypatch, cache):
    """A full disk under TensorBoard from step 3 on: one line in the log, every step still in
    metrics.jsonl, the run finishes."""
    from torch.utils.tensorboard import SummaryWriter
    original = SummaryWriter.add_scalar

    def add_scalar(self, tag, value, step=None, *args, **kwargs):
        if step >= 3:
            raise OSError(28, "No space left on device")
        return original(self, tag, value, step, *args, **kwargs)

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    run = tmp_path / "run"
    val = train_fsdp.main(TINY + ["--strategy", "none", "--tensorboard", "--out-dir", str(run), "--cache-dir", cache])
    assert val["loss"] > 0
    log = (run / "training_log.txt").read_text()
    failed = [line for line in log.splitlines() if "TensorBoard" in line]
    assert failed == ["TensorBoard failed at step 3 (OSError: [Errno 28] No space left on device); "
                      "training goes on without it"], failed
    assert [r["step"] for r in metric_records(run) if "loss" in r] == [1, 2, 3, 4, 5]
    assert sorted(tensorboard_scalars(run / "tensorboard")[0]["loss"]) == [1, 2]


def missing_packages(tmp_path, *packages):
    """An environment in which each of `packages` is missing: a package of its name first on the path
    raises what Python's import raises for one that is not installed (ModuleNotFoundError, its name)."""
    shadow = tmp_path / "shadow"
    for package in packages:
        (shadow / package).mkdir(parents=True)
        (shadow / package / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{package}'\", name='{package}')\n")
    return dict(clean_env(), PYTHONPATH=str(shadow))


@pytest.mark.parametrize("flag, package", [(["--tensorboard"], "tensorboard"), (["--wandb", "p"], "wandb")])
def test_a_missing_tracker_package_is_bad_input(tmp_path, flag, package):
    """--tensorboard imports torch.utils.tensorboard, whose own first line imports the tensorboard
    package: missing there, deeper than the module asked for, it is still one line."""
    out = tmp_path / "run"
    res = script_runner.run("train_fsdp.py", TINY + flag + ["--out-dir", str(out)], ROOT,
                            missing_packages(tmp_path, package))
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip() == (f"error: {flag[0]} needs the {package} package, which is not installed: "
                                  f"pip install {package}")
    assert not out.exists()


def test_a_missing_package_on_two_ranks_is_one_line(tmp_path):
    """Under torchrun, the flag in a TOML file and the package missing on every rank: each rank says the
    same one `error:` line before the process group exists, so the user reads it whichever rank stops
    first (torchrun then ends the others); exit 2 and nothing written."""
    config, out = tmp_path / "tb.toml", tmp_path / "run"
    config.write_text("[train]\ntensorboard = true\n")
    torchrun = torch.distributed.run.__file__
    res = script_runner.run(torchrun, ["--standalone", "--nproc_per_node", "2", "train_fsdp.py", *TINY, "--config",
                                       str(config), "--out-dir", str(out)], ROOT, missing_packages(tmp_path, "tensorboard"))
    errors = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("error:")]
    assert 1 <= len(errors) <= 2 and set(errors) == {
        "error: --tensorboard needs the tensorboard package, which is not installed: pip install tensorboard"}, \
        res.stderr[-3000:]
    assert res.returncode != 0 and not out.exists()


def test_missing_optional_packages_on_the_command_line(tmp_path):
    """Each command that takes an optional package, with the package missing: one `error:` line
    naming what to install, exit code 2, nothing written."""
    env = missing_packages(tmp_path, "wandb", "matplotlib")
    out = tmp_path / "out"
    commands = {("train_fsdp.py", "--wandb", "p", "--out-dir", str(out)): "--wandb needs the wandb package",
                ("sample.py", "--ckpt", str(out), "--demo", "--figure"): "--figure needs the matplotlib package"}
    for argv, message in commands.items():
        res = script_runner.run(argv[0], argv[1:], ROOT, env)
        assert res.returncode == 2 and res.stderr.startswith(f"error: {message}"), (argv, res.stderr)
        assert len(res.stderr.splitlines()) == 1 and res.stderr.rstrip().endswith(f"pip install {message.split()[3]}")
        assert not out.exists()
