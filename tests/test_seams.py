"""train_fsdp.py copied alone into another repo: one whose model.py, data/ package (with and without
__init__.py), utils.py and config.py clash with this project's names, with a GPT of its own (a tied
embedding and LM head, a LayerNorm without reset_parameters, the loss computed inside the model).
Its glue script passes its seams and settings to train_fsdp.run. One throwaway repo and a few short
runs serve every assertion (CI budget); the seams' tie rules run in-process on all strategies."""
import importlib.util
import json
import os
import re
import shutil
import sys
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import script_runner  # noqa: E402

import train_fsdp  # noqa: E402
from test_distributed import clean_env, run_ranks  # noqa: E402

REPO_MODEL = '''
"""Another repo's GPT: its own names, nanoGPT's LayerNorm (no reset_parameters) and tied head."""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    n_layer: int = 2
    n_embd: int = 32
    vocab_size: int = 16
    block_size: int = 12
    norm: str = "layer"  # layer, or rms: a norm that init_module does not cover


class LayerNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln = (LayerNorm if cfg.norm == "layer" else RMSNorm)(cfg.n_embd)
        self.fc, self.proj = nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self.init_module)

    def init_module(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss
'''

REPO_DATA = '''
"""The repo's token files (train.bin / val.bin, uint16), served by row index."""
import os
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DataConfig:
    dir: str = "data"
    seq: int = 12


class TokenFiles:
    vocab_size, tokenizer_path = 16, ""

    def __init__(self, cfg, seed):
        self.seq_len, self.seed = cfg.seq, seed
        self.train, self.val = (np.fromfile(os.path.join(cfg.dir, f), np.uint16) for f in ("train.bin", "val.bin"))
        self.n_train, self.n_val = (len(self.train) - 1) // cfg.seq, (len(self.val) - 1) // cfg.seq

    def rows(self, tokens, ids):
        x = torch.stack([torch.from_numpy(tokens[i * self.seq_len:(i + 1) * self.seq_len + 1].astype(np.int64))
                         for i in ids])
        return x[:, :-1], x[:, 1:]

    def train_batch(self, step, global_batch, start, count):
        order = np.random.default_rng([self.seed, step]).permutation(self.n_train)
        return self.rows(self.train, order[start:start + count])

    def val_batch(self, start, count):
        return self.rows(self.val, range(start, start + count))

    def steps_per_epoch(self, global_batch):
        return self.n_train // global_batch
'''

REPO_GLUE = '''
"""The repo's training script: its GPT and token files through train_fsdp's seams. STOP_AT /
NAN_AT (tests): rank 1 (or the only rank) sends itself SIGTERM / returns a NaN loss at that step."""
import os
import signal

import train_fsdp
from data.tokens import DataConfig, TokenFiles
from model import GPT, Block, GPTConfig

steps = 0


def build_model(cfg):
    return GPT(cfg.model), {Block}, {Block}


def compute_loss(model, x, y, cfg):
    global steps
    logits, loss = model(x, y)
    if model.training:
        steps += 1
        last_rank = int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1
        if last_rank and steps == int(os.environ.get("STOP_AT", "0")):
            os.kill(os.getpid(), signal.SIGTERM)
        if last_rank and steps == int(os.environ.get("NAN_AT", "0")):
            loss = loss * float("nan")
    return loss, {}


def load_dataset(cfg, rank):
    return TokenFiles(cfg.data, cfg.train.seed)


if __name__ == "__main__":
    train_fsdp.run(build_model=build_model, compute_loss=compute_loss, load_dataset=load_dataset,
                   model_config=GPTConfig, data_config=DataConfig)
'''

TOML = '''
[model]
n_embd = 32
[data]
seq = 12
[train]
max_steps = 8
global_batch = 8
log_every = 1
eval_samples = 16
eval_every = 0
lr = 1e-2
warmup_steps = 2
[fsdp]
param_dtype = "fp32"
auto_wrap = "module"
'''


def write_repo(path):
    """The throwaway repo: its own modules, token files, and a copy of train_fsdp.py (the export test adds ckpt_export.py)."""
    (path / "data").mkdir(parents=True)
    (path / "model.py").write_text(REPO_MODEL)
    (path / "data" / "__init__.py").write_text('"""The repo\'s data package (prepare scripts, token files)."""\n')
    (path / "data" / "tokens.py").write_text(REPO_DATA)
    (path / "train.py").write_text(REPO_GLUE)
    (path / "run.toml").write_text(TOML)
    for name in ("utils.py", "config.py"):  # names a trainer might import: it must not
        (path / name).write_text(f'raise ImportError("the trainer imported the repo\'s {name}")\n')
    shutil.copy(os.path.join(ROOT, "train_fsdp.py"), path)
    rng = np.random.default_rng(0)
    for name, n in (("train.bin", 4000), ("val.bin", 400)):  # x[t+1] = 3 x[t] + 1 mod 16, with restarts
        tokens = np.zeros(n, np.uint16)
        for t in range(1, n):
            tokens[t] = rng.integers(16) if rng.random() < 0.1 else (3 * tokens[t - 1] + 1) % 16
        tokens.tofile(path / "data" / name)


def launch(repo, args, nproc=1, **env_extra):
    """The repo's train.py on nproc ranks forked from tests/script_runner.py (srun-style, run_ranks()): one rank's
    CompletedProcess, or for several their exit codes (`codes`) and their stderr joined."""
    env = dict(clean_env(), PYTHONPATH="", **env_extra)
    if nproc == 1:
        return script_runner.run("train.py", ["--config", "run.toml", *args], repo, env)
    ranks = run_ranks("train.py", ["--config", "run.toml", *args], nproc, env, timeout=300, cwd=repo)
    return types.SimpleNamespace(codes=[r.returncode for r in ranks], stderr="".join(r.stderr for r in ranks))


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if "loss" in r]


def same(a, b, rel=1e-5):
    assert len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b)), (a, b)


def repo_module(repo, name):
    """A module of the throwaway repo, under a name of its own (this process has its own model)."""
    spec = importlib.util.spec_from_file_location(f"throwaway_{name}", repo / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    path = tmp_path_factory.mktemp("repo")
    write_repo(path)
    return path


@pytest.fixture(scope="module")
def plain(repo):
    """One process, no --out-dir, its model's settings from the file and the command line (3 blocks)."""
    res = launch(repo, ["--strategy", "none", "--n-layer", "3", "--save-every", "4"])
    assert res.returncode == 0, res.stderr[-3000:]
    (run_dir,) = (repo / "runs").iterdir()
    return run_dir, res


def test_only_the_seams_settings_in_config_start_up_and_run_name(plain):
    run_dir, res = plain
    assert run_dir.name.startswith("gpt-")  # named after the model class
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"] == {"n_layer": 3, "n_embd": 32, "vocab_size": 16, "block_size": 12, "norm": "layer"}
    assert config["data"] == {"dir": "data", "seq": 12}
    text = (run_dir / "training_log.txt").read_text() + res.stdout + res.stderr
    assert not re.search(r"free|latent|kappa|arch", text, re.IGNORECASE), text
    assert "loss: compute_loss runs in fp32" in text
    assert records(run_dir)[-1]["loss"] < 0.7 * records(run_dir)[0]["loss"]  # it learns


def test_export_loads_into_the_repos_model(repo, plain):
    """ckpt_export.py copied beside the trainer: the repo's train.py --export writes a model.pt that
    loads into the repo's model and gives the logged validation loss."""
    run_dir, _ = plain
    step4 = run_dir / "checkpoints" / "step_0000004"
    shutil.copy(os.path.join(ROOT, "ckpt_export.py"), repo)
    res = script_runner.run("train.py", ["--export", step4], repo, dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    model_lib, data_lib = repo_module(repo, "model"), repo_module(repo / "data", "tokens")
    for ckpt in (step4, run_dir / "checkpoints" / "step_0000008"):
        payload = torch.load(ckpt / "model.pt", weights_only=True)  # plain torch.load, no trainer
        model = model_lib.GPT(model_lib.GPTConfig(**payload["config"]["model"]))
        model.load_state_dict(payload["model"])  # strict
        assert model.wte.weight is model.lm_head.weight
    source = data_lib.TokenFiles(data_lib.DataConfig(dir=str(repo / "data")), 0)
    with torch.no_grad():
        val = model(*source.val_batch(0, 16))[1].item()
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert abs(val - logged[-1]["val_loss"]) < 1e-5  # the exported model reproduces the validation loss


def test_a_longer_max_steps_on_resume_keeps_the_planned_rates(repo, plain):
    """Cosine over the run's first 8 steps, kept when it is resumed with --max-steps 12: steps 5-8
    repeat bit for bit, 9-12 run at the final rate, and the resume line says so."""
    run_dir, _ = plain
    res = launch(repo, ["--strategy", "none", "--n-layer", "3", "--out-dir", "resumed", "--max-steps", "12",
                        "--resume", run_dir / "checkpoints" / "step_0000004"])
    assert res.returncode == 0, res.stderr[-3000:]
    before, after = records(run_dir), records(repo / "resumed")
    assert [r["step"] for r in after] == list(range(5, 13))
    assert [(r["loss"], r["lr"]) for r in after[:4]] == [(r["loss"], r["lr"]) for r in before[4:]]
    assert [r["lr"] for r in after[4:]] == pytest.approx([1e-3] * 4)  # min_lr_ratio 0.1 x lr
    log = (repo / "resumed" / "training_log.txt").read_text()
    assert "changed on resume: train.max_steps: 8 -> 12" in log
    assert ("changed on resume: learning rate (cosine, lr_decay_steps 8): steps 5-8 keep their planned rates; "
            "steps 9-12 are added, at 1.00e-03 to 1.00e-03") in log, log


def test_strategies_on_two_processes_sigterm_and_resume(repo, plain):
    """data/ without __init__.py. fsdp stopped by SIGTERM to one rank at step 4 (exit 3, checkpoint),
    resumed under fsdp2, and ddp: the same losses as one process."""
    (repo / "data" / "__init__.py").unlink()
    ref = [r["loss"] for r in records(plain[0])]
    stop = launch(repo, ["--strategy", "fsdp", "--n-layer", "3", "--out-dir", "two"], nproc=2, STOP_AT="4")
    assert stop.codes == [train_fsdp.EXIT_PREEMPTED] * 2, stop.stderr[-3000:]
    assert json.loads((repo / "two" / "stopped.json").read_text()) == {"step": 4}
    assert (repo / "two" / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    resumed = launch(repo, ["--strategy", "fsdp2", "--n-layer", "3", "--out-dir", "two"], nproc=2)
    assert resumed.codes == [0, 0], resumed.stderr[-3000:]
    same([r["loss"] for r in records(repo / "two")], ref)
    ddp = launch(repo, ["--strategy", "ddp", "--n-layer", "3", "--out-dir", "ddp"], nproc=2)
    assert ddp.codes == [0, 0], ddp.stderr[-3000:]
    same([r["loss"] for r in records(repo / "ddp")], ref)


def test_meta_init_keeps_the_tie_and_refuses_an_uninitialised_module(repo):
    """--meta-init on fsdp with 2 processes equals one process; the tied weights stay one (the
    consolidated model.pt holds them equal). A norm that nothing initialises is refused, in one
    line that names it, before anything is written."""
    one = launch(repo, ["--strategy", "none", "--meta-init", "--out-dir", "meta1"])
    two = launch(repo, ["--strategy", "fsdp", "--meta-init", "--out-dir", "meta2"], nproc=2)
    assert one.returncode == 0 and two.codes == [0, 0], (one.stderr[-2000:], two.stderr[-3000:])
    same([r["loss"] for r in records(repo / "meta2")], [r["loss"] for r in records(repo / "meta1")])
    state = torch.load(repo / "meta2" / "checkpoints" / "step_0000008" / "model.pt", weights_only=True)["model"]
    assert torch.equal(state["wte.weight"], state["lm_head.weight"])
    bad = launch(repo, ["--strategy", "none", "--meta-init", "--norm", "rms", "--out-dir", "bad"])
    assert bad.returncode == train_fsdp.EXIT_BAD_INPUT, bad.stderr[-2000:]
    assert bad.stderr.strip() == ("error: --meta-init: nothing initialises h.0.ln.weight (RMSNorm): give the model "
                                  "an init_module(module) that covers it, or the module a reset_parameters()")
    assert not (repo / "bad").exists()


@pytest.mark.parametrize("flags, file", [(["--optimizer", "muon"], "muon.py"), (["--wandb", "p"], "trackers.py"),
                                         (["--tensorboard"], "trackers.py"), (["--float8", "tensorwise"], "float8.py"),
                                         (["--debug"], "debugging.py")])
def test_a_flag_whose_file_was_not_copied_is_one_line(repo, flags, file):
    """The trainer copied alone: --optimizer muon, --wandb, --tensorboard, --float8 and --debug need this
    project's muon.py, trackers.py, float8.py or debugging.py beside it, said in one line before anything
    is written."""
    res = launch(repo, ["--strategy", "none", "--out-dir", "alone", *flags])
    assert res.returncode == train_fsdp.EXIT_BAD_INPUT, res.stderr[-2000:]
    flag = " ".join(flags[:2 if flags[0] == "--optimizer" else 1])
    assert res.stderr.strip() == f"error: {flag} needs {file} beside train_fsdp.py (copy it from this project)"
    assert not (repo / "alone").exists()


def test_a_companion_whose_own_import_fails_says_so(repo):
    """muon.py copied, but what it imports is missing: one line names that module, and does not ask
    for muon.py to be copied; nothing is written."""
    (repo / "muon.py").write_text("import a_module_that_is_not_installed\n")
    res = launch(repo, ["--strategy", "none", "--out-dir", "broken", "--optimizer", "muon"])
    assert res.returncode == train_fsdp.EXIT_BAD_INPUT, res.stderr
    assert res.stderr.strip() == ("error: --optimizer muon needs the a_module_that_is_not_installed package, "
                                  "which is not installed: pip install a_module_that_is_not_installed")
    assert not (repo / "broken").exists()


def test_export_without_its_file_is_one_line(tmp_path):
    """The trainer copied alone: --export needs this project's ckpt_export.py beside it, said in one
    line; the checkpoint directory named is not touched."""
    shutil.copy(os.path.join(ROOT, "train_fsdp.py"), tmp_path)
    env = dict(clean_env(), PYTHONPATH="")
    res = script_runner.run("train_fsdp.py", ["--export", "nowhere/checkpoints/latest"], tmp_path, env)
    assert res.returncode == train_fsdp.EXIT_BAD_INPUT, res.stderr[-2000:]
    assert res.stderr.strip() == ("error: --export needs ckpt_export.py beside train_fsdp.py (copy it "
                                  "from this project)")
    assert not (tmp_path / "nowhere").exists()


def test_a_nan_just_before_a_save_is_never_saved(repo):
    """The loss turns NaN at step 4, between two log steps (every 10) and right before a save
    (every 2): the run stops with exit 1 and step 2 stays the latest checkpoint."""
    res = launch(repo, ["--strategy", "none", "--save-every", "2", "--log-every", "10", "--out-dir", "nan"],
                 NAN_AT="4")
    assert res.returncode == train_fsdp.EXIT_FAILED
    assert "error: the loss or its gradient became NaN/inf at step 4" in res.stderr, res.stderr[-2000:]
    assert sorted(os.listdir(repo / "nan" / "checkpoints")) == ["latest", "step_0000002"]


# ---------------------------------------------------------------------------------------------
# In-process, one process: the seams' sections and the tie under every strategy.


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("meta", [False, True], ids=["plain", "meta"])
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2", "ddp", "none"])
def test_tied_parameters_stay_shared(repo, group, strategy, meta):
    model_lib = repo_module(repo, "model")
    cfg = train_fsdp.parse_config(["--strategy", strategy, "--auto-wrap", "module"] + ["--meta-init"] * meta,
                                  train_fsdp.Config(model=model_lib.GPTConfig(), data=train_fsdp.NoSettings()))
    topo = train_fsdp.Topology(rank=0, world=1, local_world=1, device=torch.device("cpu"),
                               backend="gloo", mesh=None)
    topo = train_fsdp.dataclasses.replace(topo, mesh=train_fsdp.device_mesh(cfg, topo))
    torch.manual_seed(0)
    with torch.device("meta") if meta else train_fsdp.contextlib.nullcontext():
        model = model_lib.GPT(cfg.model)
    plain_count = sum(p.numel() for p in model.parameters())
    wrapped = train_fsdp.wrap_model(model, {model_lib.Block}, {model_lib.Block}, cfg, topo, model.init_module)
    assert model.wte.weight is model.lm_head.weight or strategy == "fsdp"  # FSDP1: views into one flat parameter
    assert train_fsdp.local_parameter_count(wrapped) == plain_count
    state = train_fsdp.get_model_state_dict(wrapped, options=train_fsdp.StateDictOptions(full_state_dict=True))
    assert torch.equal(state["wte.weight"], state["lm_head.weight"])
    assert not any(p.isnan().any() for p in state.values())


def test_meta_init_gives_the_same_tied_weights_under_every_strategy(repo, group):
    """The tied weight is initialised once, at its first holder, under every strategy: FSDP2 once
    initialised it again at the LM head, a draw more, and every later module's weights moved."""
    model_lib = repo_module(repo, "model")
    states = {}
    for strategy in ["none", "ddp", "fsdp", "fsdp2"]:
        cfg = train_fsdp.parse_config(["--strategy", strategy, "--auto-wrap", "module", "--meta-init"],
                                      train_fsdp.Config(model=model_lib.GPTConfig(), data=train_fsdp.NoSettings()))
        topo = train_fsdp.Topology(rank=0, world=1, local_world=1, device=torch.device("cpu"),
                                   backend="gloo", mesh=None)
        topo = train_fsdp.dataclasses.replace(topo, mesh=train_fsdp.device_mesh(cfg, topo))
        torch.manual_seed(0)
        with torch.device("meta"):
            model = model_lib.GPT(cfg.model)
        wrapped = train_fsdp.wrap_model(model, {model_lib.Block}, {model_lib.Block}, cfg, topo, model.init_module)
        states[strategy] = train_fsdp.get_model_state_dict(
            wrapped, options=train_fsdp.StateDictOptions(full_state_dict=True))
    for strategy, state in states.items():
        assert state.keys() == states["none"].keys()
        for k, v in state.items():
            assert torch.equal(v, states["none"][k]), (strategy, k)


def test_seam_settings_are_flags_toml_keys_and_refuse_a_clash(repo, tmp_path):
    model_lib = repo_module(repo, "model")
    template = train_fsdp.Config(model=model_lib.GPTConfig(), data=train_fsdp.NoSettings())
    path = tmp_path / "c.toml"
    path.write_text("[model]\nn_embd = 48\n")
    cfg = train_fsdp.parse_config(["--config", str(path), "--n-layer", "5"], template)
    assert (cfg.model.n_layer, cfg.model.n_embd) == (5, 48)
    with pytest.raises(train_fsdp.BadInput, match="--kappa"):
        train_fsdp.parse_config(["--kappa", "1"], template)  # the project's settings are not there

    @train_fsdp.dataclass
    class Clash:
        seed: int = 0
    with pytest.raises(train_fsdp.BadInput, match=r"model\.seed and train\.seed would both be --seed"):
        train_fsdp.parse_config([], train_fsdp.Config(model=Clash(), data=train_fsdp.NoSettings()))


def test_a_resume_refuses_a_changed_seam_setting(repo, group, tmp_path):
    model_lib = repo_module(repo, "model")

    def config(*argv):
        cfg = train_fsdp.parse_config(["--out-dir", str(tmp_path), "--max-steps", "8", *argv],
                                      train_fsdp.Config(model=model_lib.GPTConfig(), data=train_fsdp.NoSettings()))
        return cfg
    cfg = config()
    train_fsdp.prepare_run_dir(cfg, 0)[2].close()  # [2]: the run directory's lock
    train_fsdp.start_in(str(tmp_path), 0, cfg)  # the run starts: its config is saved
    assert json.loads((tmp_path / "config.json").read_text())["model"]["n_embd"] == 32
    with pytest.raises(train_fsdp.BadInput, match=r"model\.n_embd: 32 -> 48"):
        train_fsdp.prepare_run_dir(config("--n-embd", "48"), 0)
    _, notes, lock = train_fsdp.prepare_run_dir(config("--log-every", "3"), 0)  # the trainer's may change
    lock.close()
    assert notes == ["changed on resume: train.log_every: 10 -> 3"]
    # A run saved before lr_decay_steps existed decayed over its own max_steps: a resume keeps that.
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["train"]["lr_decay_steps"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    cfg = config("--max-steps", "12")
    train_fsdp.prepare_run_dir(cfg, 0)[2].close()
    assert cfg.train.lr_decay_steps == 8


def test_seams_that_read_each_other_are_replaced_together():
    """This project's compute_loss reads its model's output and settings: a custom model with the
    default loss (or settings without the model) is one line, not an AttributeError mid-run."""
    for seams in ({"build_model": lambda cfg: None}, {"compute_loss": lambda *a: None},
                  {"model_config": train_fsdp.NoSettings}, {"data_config": train_fsdp.NoSettings}):
        with pytest.raises(train_fsdp.BadInput, match="together|needs your load_dataset"):
            train_fsdp.main([], **seams)


def test_schedules():
    """cosine: decays to the floor at --lr-decay-steps, then stays; wsd: the peak, then a linear
    decay over the last --lr-decay-steps steps of the run."""
    cfg = train_fsdp.parse_config(["--lr", "1", "--warmup-steps", "2", "--lr-decay-steps", "10"])  # floor 0.1
    rates = [train_fsdp.lr_at(s, 1.0, cfg, 20) for s in range(20)]
    assert rates[:2] == [0.5, 1.0] and rates[9] == pytest.approx(0.1) and rates[9:] == [rates[9]] * 11
    cfg.train.lr_schedule, cfg.train.lr_decay_steps = "wsd", 4
    rates = [train_fsdp.lr_at(s, 1.0, cfg, 20) for s in range(20)]
    assert rates[2:16] == [1.0] * 14 and rates[16:] == pytest.approx([0.775, 0.55, 0.325, 0.1])
    cfg.train.max_steps = 30
    note = train_fsdp.schedule_change(cfg, {"max_steps": 20, "lr_schedule": "wsd", "lr_decay_steps": 4}, start=10)
    assert note == ("learning rate (wsd, lr_decay_steps 4): steps 17-20 of the plan change rate (step 17: 7.75e-01 "
                    "-> 1.00e+00); steps 21-30 are added, at 1.00e+00 to 1.00e-01")


def test_autocast_makes_a_loss_inside_the_model_fp32_under_fsdp():
    logits = torch.randn(4, 16, dtype=torch.bfloat16)
    for flags, dtype in ((["--strategy", "fsdp"], torch.bfloat16), (["--strategy", "ddp"], torch.float32),
                         (["--strategy", "fsdp", "--autocast"], torch.float32)):
        cfg = train_fsdp.parse_config(flags)
        with train_fsdp.precision_context(cfg, torch.device("cpu")):
            loss = torch.nn.functional.cross_entropy(logits, torch.zeros(4, dtype=torch.long))
        assert loss.dtype == dtype, flags
        assert ("--autocast" in train_fsdp.loss_precision(cfg)) == (dtype == torch.bfloat16)


def test_the_trainer_imports_nothing_of_this_project():
    source = open(os.path.join(ROOT, "train_fsdp.py")).read()
    top = [line for line in source.splitlines() if re.match(r"(import|from) ", line)]
    assert not [line for line in top if re.search(r"\b(model|data|sample|bench|muon|trackers)\b", line)], top


class ChildNamedModule(torch.nn.Module):
    """A model whose own child is named `module`, the name DDP gives the model it wraps."""

    def __init__(self):
        super().__init__()
        self.module, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.module(x))


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2", "ddp", "none"])
def test_a_child_named_module_keeps_its_weight_decay(group, strategy):
    """The optimizer finds each parameter by its name in the plain model: `module.` is DDP's only where
    DDP wraps, so a model's own child of that name keeps its weight decay under every strategy."""
    cfg = train_fsdp.parse_config(["--strategy", strategy, "--auto-wrap", "module"],
                                  train_fsdp.Config(model=train_fsdp.NoSettings(), data=train_fsdp.NoSettings()))
    topo = train_fsdp.Topology(rank=0, world=1, local_world=1, device=torch.device("cpu"), backend="gloo")
    topo = train_fsdp.dataclasses.replace(topo, mesh=train_fsdp.device_mesh(cfg, topo))
    model = ChildNamedModule()
    about = {"decay_names": train_fsdp.decayed_names(model), "hidden": set()}
    assert about["decay_names"] == {"module.weight", "head.weight"}
    wrapped = train_fsdp.wrap_model(model, {torch.nn.Linear}, set(), cfg, topo)
    decay, no_decay = train_fsdp.build_optimizer(wrapped, cfg, 1e-3, topo.device, about).param_groups
    assert decay["weight_decay"] == cfg.train.weight_decay > 0 and no_decay["weight_decay"] == 0
    assert sorted(p.dim() for p in decay["params"]) == [2, 2] and sorted(p.dim() for p in no_decay["params"]) == [1, 1]
