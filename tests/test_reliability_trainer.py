"""Issue 35, the trainer: what a user of another repo meets, and what a run must never lose.

  2. train_fsdp.py alone in another repo: --help is one line pointing at the user's script, and an
     unknown flag names the script that runs
  3. settings that are no dataclass (minGPT's get_default_config): one line naming model_config
  4. a model's decay_filter decides which parameters AdamW decays
  5. --meta-init refuses a model without init_module (its own __init__ init would be lost);
     init_module = None is accepted where reset_parameters() cover every tensor
  7. W&B after a SIGKILL: the resumed run sends what W&B may not hold, so every step has its loss
  8. a bad setting under torchrun: every rank says its error line, rank 0 or not
  9. --lr-decay-steps that contradicts the schedule (cosine, wsd) is refused
 12. an old-format (non-zip) pickle planted as the latest model.pt: refused on resume (no fallback
     to an older checkpoint) and on --init-from, the payload never run
 13a. a NaN loss between two log steps, followed by a save: stopped, nothing of it saved

The own-model runs use tests/test_seams.py's throwaway repo with a glue script of their own
(OWN_GLUE, the model picked by MODEL); the others this project's tiny model (TINY).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import script_runner  # noqa: E402

import train_fsdp  # noqa: E402
from test_checkpoint import cli, error_line, snapshot  # noqa: E402
from test_distributed import TINY, clean_env, rendezvous_store  # noqa: E402
from test_seams import launch, write_repo  # noqa: E402

OWN_GLUE = '''
"""Models of the user's own through train_fsdp.run, picked by MODEL: selfinit initialises in its
__init__ (as minGPT's GPT) and has no init_module; resetonly says init_module = None; decay is the
repo's GPT with a decay_filter; settings passes a function as model_config (minGPT's CfgNode)."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import train_fsdp
from data.tokens import DataConfig, TokenFiles
from model import GPT, Block, GPTConfig


class Tiny(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte, self.ln = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size)

    def forward(self, idx, targets):
        logits = self.head(self.ln(self.wte(idx)))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class SelfInit(Tiny):
    def __init__(self, cfg):
        super().__init__(cfg)
        nn.init.normal_(self.head.weight, 0.0, 0.02)


class ResetOnly(Tiny):
    init_module = None


class Decaying(GPT):
    """Two parameters whose gradient is zero, so that only weight decay moves them: kept (2-D, not
    decayed) and shrinks (1-D, decayed); the embeddings (and the head tied to wte) not decayed."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.kept, self.shrinks = nn.Parameter(torch.ones(4, 4)), nn.Parameter(torch.ones(4))

    def decay_filter(self, name, param):
        return name == "shrinks" or (param.dim() >= 2 and name not in ("kept", "wte.weight", "wpe.weight"))

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        return logits, loss + 0.0 * (self.kept.sum() + self.shrinks.sum())


def build_model(cfg):
    return {"selfinit": SelfInit, "resetonly": ResetOnly, "decay": Decaying}[os.environ["MODEL"]](cfg.model), \\
        {Block}, {Block}


def compute_loss(model, x, y, cfg):
    return model(x, y)[1], {}


def load_dataset(cfg, rank):
    return TokenFiles(cfg.data, cfg.train.seed)


def get_default_config():
    return GPTConfig()


if __name__ == "__main__":
    train_fsdp.run(build_model=build_model, compute_loss=compute_loss, load_dataset=load_dataset,
                   model_config=get_default_config if os.environ.get("MODEL") == "settings" else GPTConfig,
                   data_config=DataConfig)
'''


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """tests/test_seams.py's throwaway repo (its model.py, data/ and train.py glue, a copy of
    train_fsdp.py) with own.py, the glue of this file's models."""
    path = tmp_path_factory.mktemp("repo")
    write_repo(path)
    (path / "own.py").write_text(OWN_GLUE)
    return path


def own(repo, model, args):
    """python own.py --config run.toml ARGS in the throwaway repo, with MODEL=model."""
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    env["MODEL"] = model
    return script_runner.run("own.py", ["--config", "run.toml", *args], repo, env)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # this project's synthetic data, made once


def tiny(run_dir, cache, *extra):
    return TINY + ["--strategy", "none", "--out-dir", str(run_dir), "--cache-dir", str(cache), *map(str, extra)]


# ---------------------------------------------------------------------------------------------
# 2, 3: the trainer in another repo


def test_help_in_another_repo_points_at_the_users_script(repo, tmp_path):
    """train_fsdp.py copied alone (no model.py here): --help is one line, exit 2, that says to run
    the user's script; that script's --help lists its flags and an unknown flag names it."""
    shutil.copy(os.path.join(ROOT, "train_fsdp.py"), tmp_path)
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    res = script_runner.run("train_fsdp.py", ["--help"], tmp_path, env)
    assert res.returncode == train_fsdp.EXIT_BAD_INPUT and res.stdout == "", (res.stdout, res.stderr[-3000:])
    assert res.stderr == ("error: this project's model.py cannot be imported here (No module named 'model'): in your "
                          "own repo, run your script that calls train_fsdp.run(...) with your seams (its --help lists "
                          "its flags)\n")
    assert os.listdir(tmp_path) == ["train_fsdp.py"]
    # A repo with a model.py of its own (nanoGPT's layout): not this project's, the same line.
    (tmp_path / "model.py").write_text("from dataclasses import dataclass\n\n\n@dataclass\nclass GPTConfig:\n"
                                       "    n_layer: int = 2\n")
    res = script_runner.run("train_fsdp.py", ["--help"], tmp_path, env)
    assert res.returncode == train_fsdp.EXIT_BAD_INPUT and res.stderr == (
        "error: this project's model.py cannot be imported here (module 'model' has no attribute 'ModelConfig'): in "
        "your own repo, run your script that calls train_fsdp.run(...) with your seams (its --help lists its flags)\n")
    bad = own(repo, "decay", ["--n-embd", "32", "--bogus", "1"])
    assert error_line(bad, train_fsdp.EXIT_BAD_INPUT, alone=True) == (
        "error: unrecognized arguments: --bogus 1 (python own.py --help lists the valid flags)")
    flags = own(repo, "decay", ["--help"])
    assert flags.returncode == 0 and "--n-embd" in flags.stdout and "--seq" in flags.stdout, flags.stderr[-2000:]


def test_settings_that_are_no_dataclass_name_model_config(repo):
    """A function (minGPT's GPT.get_default_config), an instance or a plain class as the settings:
    one line naming model_config and what to pass, before anything runs."""
    class Settings:
        n_layer = 2

    here = "test_settings_that_are_no_dataclass_name_model_config.<locals>"
    cases = ((Settings, f"'{here}.Settings'"), (nn.Linear, "'Linear'"), (lambda: None, f"'{here}.<lambda>'"),
             (train_fsdp.TrainConfig(), repr(train_fsdp.TrainConfig())))  # an instance is not the class
    for given, shown in cases:
        with pytest.raises(train_fsdp.BadInput) as e:  # before anything is set up
            train_fsdp.main([], build_model=train_fsdp.build_model, compute_loss=train_fsdp.compute_loss,
                            model_config=given)
        assert str(e.value) == (f"model_config={shown} is not a dataclass: pass the class of your settings, "
                                "decorated with @dataclass, each field an int, float, str or bool")
    res = own(repo, "settings", ["--out-dir", "settings"])
    assert error_line(res, train_fsdp.EXIT_BAD_INPUT, alone=True) == (
        "error: model_config='get_default_config' is not a dataclass: pass the class of your settings, decorated "
        "with @dataclass, each field an int, float, str or bool")
    assert not (repo / "settings").exists()


# ---------------------------------------------------------------------------------------------
# 4: weight decay follows the model


class Filtered(nn.Module):
    """Decays its 1-D gain and its linear weight, not its embedding."""

    def __init__(self):
        super().__init__()
        self.emb, self.proj, self.gain = nn.Embedding(8, 4), nn.Linear(4, 4), nn.Parameter(torch.ones(4))

    def decay_filter(self, name, param):
        return not name.startswith("emb.") and name != "proj.bias"


def test_decayed_names_follow_the_models_decay_filter():
    assert train_fsdp.decayed_names(Filtered()) == {"proj.weight", "gain"}
    plain = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.LayerNorm(4))  # no filter: the >= 2-D weights
    assert train_fsdp.decayed_names(plain) == {"0.weight", "1.weight"}


def test_a_run_decays_exactly_what_decay_filter_names(repo):
    """FSDP (one process), weight decay 0.5: `kept` (2-D, filtered out) and `shrinks` (1-D, filtered
    in) have zero gradients, so only decay moves them: kept stays all ones, shrinks shrinks by
    prod(1 - lr_t * 0.5) over the steps, as the logged rates give."""
    res = own(repo, "decay", ["--strategy", "fsdp", "--checkpoint-type", "full", "--weight-decay", "0.5",
                              "--max-steps", "4", "--out-dir", "decay"])
    assert res.returncode == 0, res.stderr[-3000:]
    state = torch.load(repo / "decay" / "checkpoints" / "step_0000004" / "model.pt", weights_only=True)["model"]
    assert torch.equal(state["kept"], torch.ones(4, 4))
    with open(repo / "decay" / "metrics.jsonl") as fh:
        rates = [r["lr"] for r in map(json.loads, fh) if "lr" in r]
    assert len(rates) == 4
    expected = torch.ones(4)
    for lr in rates:
        expected = expected * (1 - lr * 0.5)
    assert torch.allclose(state["shrinks"], expected, rtol=1e-6) and expected.max() < 0.999, (state["shrinks"], rates)


# ---------------------------------------------------------------------------------------------
# 5: --meta-init and a model's own initialisation


def test_meta_init_refuses_a_model_without_init_module(repo):
    res = own(repo, "selfinit", ["--strategy", "none", "--meta-init", "--out-dir", "selfinit"])
    assert error_line(res, train_fsdp.EXIT_BAD_INPUT, alone=True) == (
        "error: --meta-init: SelfInit has no init_module(module): whatever its __init__ does to the weights would "
        "run on the meta device and be lost; give it one (or init_module = None when its modules' "
        "reset_parameters() are its whole initialisation), or drop --meta-init")
    assert not (repo / "selfinit").exists()
    ok = own(repo, "resetonly", ["--strategy", "none", "--meta-init", "--max-steps", "2", "--out-dir", "resetonly"])
    assert ok.returncode == 0, ok.stderr[-3000:]
    state = torch.load(repo / "resetonly" / "checkpoints" / "step_0000002" / "model.pt", weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for v in state.values()) and state["head.weight"].std() > 0


# ---------------------------------------------------------------------------------------------
# 7: W&B after a SIGKILL

KILLER = '''
"""train_fsdp.py whose training step KILL_AT is killed (SIGKILL) in its forward pass."""
import os
import signal
import sys

sys.path.insert(0, sys.argv.pop(1))
import train_fsdp

inner, calls = train_fsdp.compute_loss, [0]


def compute_loss(model, x, y, cfg):
    if model.training:
        calls[0] += 1
        if calls[0] == int(os.environ.get("KILL_AT", "0")):
            os.kill(os.getpid(), signal.SIGKILL)
    return inner(model, x, y, cfg)


train_fsdp.compute_loss = compute_loss
train_fsdp.run()
'''


def test_wandb_holds_every_step_after_a_sigkill_and_resume(tmp_path, cache):
    """Killed at step 7 (checkpoint 4, steps 1-6 logged), resumed to step 8: W&B's offline files
    of both attempts hold every step's loss, the one metrics.jsonl holds. W&B writes in blocks, so
    a killed attempt's file may hold none of its steps (it holds none here): the resume must send
    them again from metrics.jsonl, up to its checkpoint, and then its own steps."""
    pytest.importorskip("wandb", reason="pip install wandb (.ci/run does)")
    from test_trackers import wandb_env, wandb_records
    (tmp_path / "killer.py").write_text(KILLER)
    run = tmp_path / "run"
    args = [ROOT, *tiny(run, cache, "--max-steps", "8", "--save-every", "4", "--wandb", "tests")]
    killed = script_runner.run(tmp_path / "killer.py", args, tmp_path, {**wandb_env(tmp_path), "KILL_AT": "7"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    resumed = script_runner.run(tmp_path / "killer.py", args, tmp_path, wandb_env(tmp_path))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with open(run / "metrics.jsonl") as fh:
        losses = {r["step"]: r["loss"] for r in map(json.loads, fh) if "loss" in r}  # the resumed attempt's last
    assert sorted(losses) == list(range(1, 9))
    held = {}
    for path in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                if "loss" in row:
                    held[record.history.step.num] = row["loss"]
    assert held == losses, (held, losses)
    assert json.loads((run / "wandb_run.json").read_text())["step"] == 8


# ---------------------------------------------------------------------------------------------
# 8, 9: a bad setting under torchrun; schedules that contradict themselves


def test_every_rank_says_its_error_before_the_process_group(tmp_path):
    """Rank 1 alone (rank 0 never came, as when torchrun killed it first) still says its line; and
    under torchrun with 2 processes the line is there on every launch, whichever rank exits first."""
    store, rendezvous = rendezvous_store()
    env = {**clean_env(), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", **rendezvous}
    res = script_runner.run("train_fsdp.py", ["--lr", "-1", "--out-dir", tmp_path / "one"], ROOT, env)
    assert error_line(res, train_fsdp.EXIT_BAD_INPUT, alone=True) == "error: --lr -1.0: must be > 0"
    cosine = "error: --lr-decay-steps 3: the cosine decay must end after the warmup (--warmup-steps 6); give a " \
             "larger step, or 0 for --max-steps"
    for args, line in ((["--lr", "-1"], "error: --lr -1.0: must be > 0"),
                       (["--lr-schedule", "cosine", "--warmup-steps", "6", "--lr-decay-steps", "3"], cosine)):
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "train_fsdp.py", *args,
                              "--out-dir", tmp_path / "two"], cwd=ROOT, env=clean_env(), capture_output=True,
                             text=True, timeout=120)
        # A line of its own: each rank writes its message and newline at once, so lines never merge.
        assert res.returncode != 0 and line in res.stderr.splitlines(), res.stderr[-3000:]
    assert not (tmp_path / "one").exists() and not (tmp_path / "two").exists()


def test_lr_decay_steps_that_contradict_the_schedule_are_refused(tmp_path, cache):
    with pytest.raises(train_fsdp.BadInput) as e:
        train_fsdp.main(tiny(tmp_path / "cosine", cache, "--warmup-steps", "6", "--lr-decay-steps", "3"))
    assert str(e.value) == ("--lr-decay-steps 3: the cosine decay must end after the warmup (--warmup-steps 6); "
                            "give a larger step, or 0 for --max-steps")
    res = cli(tiny(tmp_path / "wsd", cache, "--lr-schedule", "wsd", "--warmup-steps", "4", "--lr-decay-steps", "3",
                   "--max-steps", "6"))
    assert error_line(res, train_fsdp.EXIT_BAD_INPUT) == (
        "error: --lr-decay-steps 3: the wsd decay and --warmup-steps 4 do not fit in the run's 6 steps")
    assert not (tmp_path / "cosine").exists() and not (tmp_path / "wsd").exists()


# ---------------------------------------------------------------------------------------------
# 12: an old-format pickle planted in a checkpoint


class Payload:
    """Unpickled, it runs `touch MARKER`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_an_old_format_pickle_planted_as_the_latest_model_is_refused(tmp_path, cache):
    """Full checkpoints 2 and 4; step 4's model.pt replaced by a pickle in torch's old (non-zip)
    format that runs a command (its size put in meta.json). --init-from it and --resume auto on
    the run: one refusal line, exit 2, no fallback to step 2, nothing trained or written, and
    the command never ran."""
    run, marker = tmp_path / "run", tmp_path / "marker"
    first = cli(tiny(run, cache, "--max-steps", "4", "--save-every", "2", "--checkpoint-type", "full"))
    assert first.returncode == 0, first.stderr[-3000:]
    step4 = run / "checkpoints" / "step_0000004"
    with open(step4 / "model.pt", "wb") as fh:
        torch.save({"model": Payload(marker)}, fh, _use_new_zipfile_serialization=False)
    meta = json.loads((step4 / "meta.json").read_text())
    meta["files"]["model.pt"] = os.path.getsize(step4 / "model.pt")
    (step4 / "meta.json").write_text(json.dumps(meta))
    before = snapshot(run)
    line = (f"error: refused to load {step4 / 'model.pt'}: it asks for posix.system, which no checkpoint holds (a "
            "pickle that can run code); nothing in it was run")
    init = cli(tiny(tmp_path / "new", cache, "--max-steps", "6", "--init-from", step4 / "model.pt",
                    "--checkpoint-type", "full"))
    assert error_line(init, train_fsdp.EXIT_BAD_INPUT) == line
    resume = cli(tiny(run, cache, "--max-steps", "6", "--save-every", "2", "--checkpoint-type", "full"))
    assert error_line(resume, train_fsdp.EXIT_BAD_INPUT) == line
    assert "older checkpoint" not in resume.stderr + resume.stdout
    kept = ("checkpoints/", "metrics.jsonl")  # config.json, the log and the lock say the attempt
    assert {k: v for k, v in snapshot(run).items() if k.startswith(kept)} == \
        {k: v for k, v in before.items() if k.startswith(kept)}
    assert not marker.exists() and not (tmp_path / "new" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------
# 13a: a NaN between log steps is never saved


def saved(run_dir):
    root = run_dir / "checkpoints"
    return sorted(n for n in os.listdir(root) if n.startswith("step_")) if root.exists() else []


def test_a_nan_between_log_steps_is_never_saved(repo):
    """The loss turns NaN at step 3; logs every 10 steps. A save at step 4 (--save-every 4), or the
    save of a SIGTERM at step 3 itself: exit 1 with the NaN line, no checkpoint of step 3 or later."""
    line = ("error: the loss or its gradient became NaN/inf at step 3; stopped without saving that state (the "
            "latest checkpoint is still the last good one); lower --lr or pass --skip-nonfinite")
    res = launch(repo, ["--strategy", "none", "--save-every", "4", "--log-every", "10", "--out-dir", "nan"], NAN_AT="3")
    assert error_line(res, train_fsdp.EXIT_FAILED) == line
    assert saved(repo / "nan") == []
    stop = launch(repo, ["--strategy", "none", "--log-every", "10", "--out-dir", "nanstop"], NAN_AT="3", STOP_AT="3")
    assert error_line(stop, train_fsdp.EXIT_FAILED) == line
    assert saved(repo / "nanstop") == [] and not (repo / "nanstop" / "stopped.json").exists()


def test_log_files_that_cannot_be_opened_are_kept_not_raised_on_rank_0(tmp_path):
    """Rank 0 failing to open its log files keeps the error, as a failed write does (every rank
    stops on it at the next step): raising there would stop rank 0 alone while the others wait in
    a collective. The start-up lines, the config among them, go through the same log."""
    (tmp_path / "metrics.jsonl").mkdir()  # open(..., "a") fails: IsADirectoryError
    log = train_fsdp.RunLog(str(tmp_path), 0)
    log.line("the config", file_too=False)
    log.close()
    assert log.error.startswith(f"writing {tmp_path / 'metrics.jsonl'} failed on rank 0"), log.error
