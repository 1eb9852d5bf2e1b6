"""Learning-rate schedule, LR scaling, epochs, --profile and --compile with FSDP, gradient clipping, and
the warnings the trainer hides (its own calls' only)."""
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import script_runner  # noqa: E402

import data as data_lib  # noqa: E402
import model as model_lib  # noqa: E402
import train_fsdp  # noqa: E402
from test_distributed import TINY, assert_same, clean_env, launch  # noqa: E402


def test_lr_warmup_then_cosine_to_min():
    cfg = SimpleNamespace(train=SimpleNamespace(warmup_steps=10, min_lr_ratio=0.1, lr_schedule="cosine",
                                                lr_decay_steps=0))  # 0: the decay ends at the last step
    lrs = [train_fsdp.lr_at(s, 1.0, cfg, 111) for s in range(111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))          # rising in warmup
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))          # non-increasing after
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-6)      # half-way through the cosine
    assert lrs[110] == pytest.approx(0.1, rel=1e-9)                   # the last step is at the floor


def test_grad_clip_scales_the_gradients_to_the_limit():
    """--grad-clip: the norm train_step returns (and logs) is the one before clipping; the optimizer then steps
    with gradients of the limit's norm, or untouched at 0. The equivalence tests compare runs clipped alike: only
    this sees a limit ignored. One process group: train_step counts the step's targets over all ranks."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for limit, after in ((1.0, 1.0), (0.0, 10.0)):
        model = torch.nn.Linear(4, 4, bias=False)
        seen = {}

        class Reader:  # stands in for the optimizer: keeps the gradient it would step with
            def step(self):
                seen["grad"] = model.weight.grad.clone()

            def zero_grad(self, set_to_none=True):
                model.zero_grad(set_to_none=set_to_none)

        def loss_fn(model, x, y, cfg):
            return (model.weight * 2.5).sum(), {}  # every gradient 2.5: norm 10
        cfg = train_fsdp.parse_config(["--strategy", "none", "--grad-clip", str(limit)])
        batch = [(torch.zeros(1), torch.zeros(1))]
        _, norm, _ = train_fsdp.train_step(model, Reader(), None, batch, cfg, loss_fn, train_fsdp.STRATEGIES["none"])
        assert norm.item() == pytest.approx(10.0)
        assert seen["grad"].norm().item() == pytest.approx(after, rel=1e-5)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("misc")
    return launch(tmp, 2, {
        "plain": [],
        "compiled": ["--compile"],
        "compiled_blocks": ["--compile", "--compile-scope", "blocks"],
        "checkpointed": ["--activation-checkpointing"],
        "compiled_blocks_checkpointed": ["--compile", "--compile-scope", "blocks", "--activation-checkpointing"],
        "fsdp2_one_unit": ["--strategy", "fsdp2", "--auto-wrap", "auto"],
        "fsdp2_one_unit_compiled": ["--strategy", "fsdp2", "--auto-wrap", "auto", "--compile"],
        "scaled": ["--lr-scale-base-batch", "4", "--lr", "1e-3"],
        "epochs": ["--max-steps", "0", "--epochs", "0.0005", "--dataset", "synthetic"],
        "profiled": ["--profile"],
    }, "misc")


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if "loss" in r]


def test_compile_with_fsdp_matches_eager(runs):
    """--compile forces use_orig_params (FSDP1 + dynamo needs it) and trains like eager."""
    assert_same(runs["compiled"][0], runs["plain"][0], rel=1e-4)
    with open(os.path.join(runs["compiled"][2], "training_log.txt")) as fh:
        assert "strategy fsdp" in fh.read()


def test_compiling_each_block_matches_eager(runs):
    """--compile-scope blocks: each block compiled in place before FSDP wraps it, same losses."""
    assert_same(runs["compiled_blocks"][0], runs["plain"][0], rel=1e-4)


def test_activation_checkpointing_matches_plain_compiled_or_not(runs):
    """Checkpointed blocks recompute their forward in backward: the same losses as without, and
    checkpointing around each compiled block (--compile-scope blocks) trains like eager."""
    assert_same(runs["checkpointed"][0], runs["plain"][0], rel=1e-6)
    assert_same(runs["compiled_blocks_checkpointed"][0], runs["plain"][0], rel=1e-4)


def test_compiled_fsdp2_of_one_unit_matches_eager_and_saves_the_same_keys(runs):
    """fsdp2 with the root its only unit is compiled whole: the same losses as eager, and the
    consolidated model.pt holds the same tensors under the same names (no compile prefix)."""
    assert_same(runs["fsdp2_one_unit_compiled"][0], runs["fsdp2_one_unit"][0], rel=1e-4)
    with open(os.path.join(runs["fsdp2_one_unit_compiled"][2], "training_log.txt")) as fh:
        assert "compile: the model" in fh.read()
    saved = [torch.load(os.path.join(runs[name][2], "checkpoints", "step_0000005", "model.pt"))["model"]
             for name in ("fsdp2_one_unit_compiled", "fsdp2_one_unit")]
    assert sorted(saved[0]) == sorted(saved[1])
    for k in saved[1]:
        torch.testing.assert_close(saved[0][k], saved[1][k], rtol=1e-4, atol=1e-6)


def test_linear_lr_scaling_with_global_batch(runs):
    """global batch 8 / base 4 doubles the peak: warmup step 1 of 2 is 1e-3 * 2 / 2."""
    assert records(runs["scaled"][2])[0]["lr"] == pytest.approx(1e-3)
    assert records(runs["plain"][2])[0]["lr"] == pytest.approx(3e-3 / 2)


def test_epochs_set_the_number_of_steps(runs):
    # 0.0005 epochs of 65,536 samples at 8 per step = 4.1 -> 5 steps
    assert len(records(runs["epochs"][2])) == 5


def test_profile_writes_chrome_traces(runs):
    """Each rank's trace covers exactly the promised steps 2-4 (schedule wait 1, warmup 1,
    active 3) and holds what a trace is read for: the model's matmuls, FSDP's forward and
    post-backward hooks, one gradient reduce-scatter per FSDP unit and step, and one optimizer
    step per profiled step, each inside its step's window."""
    for rank in (0, 1):
        path = os.path.join(runs["profiled"][2], f"trace_rank{rank}.json")
        with open(path) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
        steps = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")}
        assert sorted(steps) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"], path
        names = [e["name"] for e in events]
        for op in ("aten::mm", "FullyShardedDataParallel.forward", "FullyShardedDataParallel._post_backward_hook"):
            assert op in names, (path, op)
        # TINY: 2 blocks + the root = 3 FSDP units
        assert sum("reduce_scatter" in n and n.startswith("c10d::") for n in names) == 3 * 3, path
        opt_steps = [e for e in events if e["name"].startswith("Optimizer.step#AdamW")]
        assert len(opt_steps) == 3, path
        for e in opt_steps:
            assert sum(lo <= e["ts"] <= hi for lo, hi in steps.values()) == 1, (path, e["ts"], steps)


@pytest.mark.parametrize("suite", ["single", "small", "multi", "knobs", "tune", "free", "text", "capacity", "sweep",
                                   "8b", "offload"])
def test_bench_suites_are_valid_trainer_commands(suite):
    """Every bench.py entry parses and validates as a trainer command, and the shapes are what
    the names say (GPU time is too scarce to find a typo there)."""
    import bench
    import model as model_lib
    for name, nproc, flags, steps, *warmup in bench.suite(suite, 4):
        assert steps - (warmup[0] if warmup else bench.WARMUP) >= 2, name  # a median over at least 2 steps
        cfg = train_fsdp.parse_config(bench.BASE + flags + ["--max-steps", str(steps), "--out-dir", "x"])
        train_fsdp.check_config(cfg)
        assert nproc in (1, 4)
        if "layers" in name:
            assert f"{cfg.model.n_layer} layers" in name and cfg.model.d_model == 4096
        assert ("fsdp2" in name) == (cfg.train.strategy == "fsdp2"), name
        if name.startswith("small"):
            assert (cfg.model.n_layer, cfg.model.d_model, cfg.data.seq_len) == (6, 384, 256)
        if name.startswith(("1b", "1.5b", "8b")):
            assert cfg.model.n_layer == model_lib.SIZE_PRESETS[name.split()[0]]["n_layer"]
            assert cfg.model.arch == ("free" if " free" in name else "baseline")


def reference_grad_norm(run_dir):
    """The global gradient norm of step 1 computed here, without FSDP: the run's initial model
    (same seed and config) on step 1's whole global batch, mean loss, one backward."""
    with open(os.path.join(run_dir, "config.json")) as fh:
        cfg = json.load(fh)
    torch.manual_seed(cfg["train"]["seed"])
    model = model_lib.build_model(model_lib.ModelConfig(**cfg["model"]))
    ds = data_lib.open_dataset(data_lib.DataConfig(**cfg["data"]), cfg["train"]["seed"])
    gb = cfg["train"]["global_batch"]
    x, y = ds.train_batch(0, gb, 0, gb)
    logits, _ = model(x)
    model_lib.lm_loss(logits, y)[0].backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def test_log_records_and_start_up_summary(runs):
    """Every log record carries the token count, throughput and memory fields, and rank 0's summary
    names world, backend, dtypes, parameter counts and the batch layout.
    The logged grad_norm is the global norm before clipping: step 1's equals the norm computed
    here on one plain model (sharded or per-rank norms would be smaller, clipped ones 1.0)."""
    tokens_per_step = 8 * 66  # TINY: global batch 8, synthetic rows of 66 tokens
    recs = records(runs["plain"][2])
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1))
    for r in recs:
        assert r["tokens_seen"] == r["step"] * tokens_per_step
        assert r["tokens_per_s"] > 0 and 0 < r["step_time_s"] < 60
        assert 0 <= r["data_fraction"] < 1 and r["mem_peak_gib"] > 0 and r["lr"] > 0 and r["grad_norm"] > 0
    ref = reference_grad_norm(runs["plain"][2])
    assert abs(recs[0]["grad_norm"] - ref) <= 1e-5 * ref, (recs[0]["grad_norm"], ref)
    assert ref > 1.0  # above the clipping threshold: a clipped norm could not pass for it
    with open(os.path.join(runs["plain"][2], "training_log.txt")) as fh:
        log = fh.read()
    for line in ("world 2 | backend gloo | device cpu", "strategy fsdp FULL_SHARD wrap=module",
                 "dtypes param=fp32 reduce=fp32 buffer=fp32", "parameters: total 34,976 | trainable 34,976",
                 "batch: global 8 = micro 4 x world 2 x accum 1 (sync) | seq 66 | 528 tokens/step"):
        assert line in log, log


def test_bench_timeout_stops_the_workers_too(tmp_path, monkeypatch):
    """An entry past --timeout-s is recorded as stopped and leaves no trainer process behind
    (torchrun's workers run in sessions of their own: killing torchrun's group alone missed them).
    The timeout fires once the workers train (their first step is in metrics.jsonl), not after 20 s of
    the clock: a machine that is slow to start them cannot make the test pass with no worker to stop."""
    import bench
    run_dir, timeout_s = os.path.join(str(tmp_path), "never_ends"), 20

    class TimesOutOnceTraining(subprocess.Popen):
        def communicate(self, input=None, timeout=None):
            if timeout != timeout_s:  # bench's later waits for the stopped entry: the real ones
                return super().communicate(input, timeout)
            deadline = time.monotonic() + 300
            while not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
                assert time.monotonic() < deadline, "the workers did not train within 300 s"
                try:
                    super().communicate(timeout=0.1)  # reads the output meanwhile, as the real wait does
                except subprocess.TimeoutExpired:
                    continue
                raise AssertionError(f"the entry ended (exit {self.returncode}) before its workers trained")
            raise subprocess.TimeoutExpired(self.args, timeout)

    monkeypatch.setattr(bench.subprocess, "Popen", TimesOutOnceTraining)
    flags = ["--size", "tiny", "--seq-len", "64", "--micro-batch", "1", "--global-batch", "2"]
    args = bench.build_arg_parser().parse_args(["--out", str(tmp_path), "--timeout-s", str(timeout_s)])
    row = bench.run_entry(("never ends", 2, flags, 10 ** 6), args, 1.0, 1.0)
    assert f"stopped after --timeout-s {timeout_s}" in open(os.path.join(tmp_path, "never_ends.log")).read()
    assert "error" in row
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if run_dir.encode() in fh.read():
                    left.append(pid)
        except OSError:
            pass
    assert not left, f"processes of the stopped entry still running: {left}"


def test_the_trainer_hides_its_own_notices_only(tmp_path):
    """FSDP1 on one process switches to NO_SHARD and says so at the wrap and every state dict: hidden
    around the trainer's own calls, so a one-process fsdp run shows none. A program that imports the
    trainer still sees every warning of its own, those of that text and of DCP included."""
    env = {k: v for k, v in clean_env().items() if k != "PYTHONWARNINGS"}
    run = script_runner.run("train_fsdp.py", TINY + ["--strategy", "fsdp", "--max-steps", "2", "--save-every", "1",
                                                      "--out-dir", str(tmp_path / "run")], ROOT, env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Warning" not in run.stderr, run.stderr[-3000:]
    script = ("import warnings, train_fsdp\n"
              "with warnings.catch_warnings(record=True) as seen:\n"
              "    warnings.warn('FSDP is switching to use `NO_SHARD` in my own code')\n"
              "    warnings.warn('my own torch.distributed.checkpoint notice')\n"
              "print(len(seen))\n")
    res = script_runner.run("-c", [script], ROOT, env)
    assert res.returncode == 0 and res.stdout.split() == ["2"], res.stderr[-3000:]
