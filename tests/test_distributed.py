"""Equivalence on CPU with gloo: FSDP1, FSDP2 (--strategy fsdp2) and DDP on N processes and one
process give the same losses on the same global batch (fp32, 1e-5 relative), for every sharding
strategy, wrap policy, accumulation layout and mode, activation checkpointing and the other FSDP
knobs.

Each launch runs many short trainings inside one process group (tests/dist_driver.py), so
torch starts once per process, not once per run. The launches here also record, per step, the
gradient reductions each rank issued (RECORD_COMMS, see dist_driver.py): equal numbers cannot
show whether no_sync was entered or in which dtype gradients were reduced; the counts can.

Equal losses alone cannot show a gradient of the wrong scale: clipping at 1.0 is active in
these runs (gradient norms 4-7) and AdamW is invariant to the gradient's scale, so the
equivalence tests also compare the logged (pre-clipping) gradient norm of every step.
"""
import concurrent.futures
import importlib.util
import itertools
import json
import math
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import script_runner  # noqa: E402

import data as data_lib  # noqa: E402
import model as model_lib  # noqa: E402
import train_fsdp  # noqa: E402

TINY = ["--arch", "baseline", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--max-steps", "5",
        "--global-batch", "8", "--log-every", "1", "--eval-every", "0", "--eval-samples", "16",
        "--param-dtype", "fp32", "--reduce-dtype", "fp32", "--warmup-steps", "2", "--lr", "3e-3",
        "--weight-decay", "0.1", "--auto-wrap", "module"]  # each block a unit, as large models have
GQA_TIED = ["--n-kv-head", "1", "--tie-embeddings"]  # grouped-query attention and tied embeddings
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
WRAPS = [["--auto-wrap", "module"], ["--auto-wrap", "lambda"], ["--auto-wrap", "size", "--min-num-params", "2000"]]
FSDP2 = ["--strategy", "fsdp2"]
FREE = ["--arch", "free", "--latent-bits", "4"]
FLOAT8 = ["--float8", "tensorwise", "--global-batch", "4"]
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
NEEDS_TORCHAO = pytest.mark.skipif(not HAS_TORCHAO, reason="pip install torchao (.ci/run does)")
VAL_ROWS = 11  # validation rows of the val11 runs: 2 ranks x micro 4 leave rank 1 none in the last chunk


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def rendezvous_store():
    """The rendezvous of processes started without torchrun: a TCPStore that this (the test)
    process serves on a port the kernel picks as it binds (port 0), so that two test runs on one
    machine never take the same port. Returns the store, to keep until the processes exit, and
    the environment that makes every rank a client of it, as torchrun's workers are clients of
    their agent's store (TORCHELASTIC_USE_AGENT_STORE: rank 0 does not try to serve one itself)."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def rank_envs(nproc):
    """The environments of nproc ranks started without torchrun, as srun starts them (clean_env() with RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and the rendezvous; one process: clean_env() alone). Returns the
    rendezvous store (None for one process), to keep until the ranks exit, and the environments."""
    if nproc == 1:
        return None, [clean_env()]
    store, rendezvous = rendezvous_store()
    return store, [dict(clean_env(), **rendezvous, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                        LOCAL_WORLD_SIZE=str(nproc)) for r in range(nproc)]


def run_forked(script, args, envs, timeout=600, cwd=ROOT):
    """`python SCRIPT ARGS` in cwd once per environment, all at once, each forked from tests/script_runner.py:
    their CompletedProcess, once all have exited."""
    with concurrent.futures.ThreadPoolExecutor(len(envs)) as pool:
        return list(pool.map(lambda env: script_runner.run(script, args, cwd, env, timeout), envs))


def run_ranks(script, args, nproc, env=None, timeout=600, cwd=ROOT):
    """run_forked() on nproc ranks as srun starts them (rank_envs(), updated by `env`)."""
    _store, ranks = rank_envs(nproc)  # the rendezvous, kept until the ranks exit
    return run_forked(script, args, [{**e, **(env or {})} for e in ranks], timeout, cwd)


def launch(tmp_path, nproc, runs, tag, record=False):
    """Run {name: extra args} in one launch; return {name: (per-step losses, final val dict,
    run dir)}. `record`: each rank also writes comms_rank{r}.json into the run dir (comms())."""
    spec, out = {}, {}
    for name, extra in runs.items():
        out[name] = str(tmp_path / f"{tag}-{name}")
        spec[name] = TINY + ["--out-dir", out[name], "--cache-dir", str(tmp_path / "cache")] + extra
    spec_file = tmp_path / f"{tag}.json"
    spec_file.write_text(json.dumps(spec))
    procs = run_ranks("tests/dist_driver.py", [spec_file], nproc, {"RECORD_COMMS": "1"} if record else None)
    for rank, res in enumerate(procs):
        assert res.returncode == 0, f"rank {rank}: " + res.stdout[-3000:] + res.stderr[-5000:]
    results = {}
    for name, run_dir in out.items():
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            records = [json.loads(line) for line in fh]
        losses = [r["loss"] for r in records if "loss" in r]
        val = next(r for r in reversed(records) if "val_loss" in r)
        results[name] = (losses, val, run_dir)
    return results


def assert_same(a, b, rel=1e-5):
    assert len(a) == len(b) and len(a) >= 5
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(y), f"step {i + 1}: {x} vs {y} (losses {a} vs {b})"


def grad_norms(run):
    """The logged global gradient norm (before clipping) of every step of a launch() result."""
    with open(os.path.join(run[2], "metrics.jsonl")) as fh:
        return [r["grad_norm"] for r in map(json.loads, fh) if "grad_norm" in r]


def assert_same_run(run, ref, rel=1e-5, norm_rel=1e-4):
    """Same losses and same pre-clipping gradient norms at every step (launch() results)."""
    assert_same(run[0], ref[0], rel)
    a, b = grad_norms(run), grad_norms(ref)
    assert len(a) == len(b) == len(run[0])
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= norm_rel * abs(y), f"step {i + 1}: grad_norm {x} vs {y} (norms {a} vs {b})"


def comms(run, rank=0):
    """Per step of a recorded run, {op: calls} of the gradient reductions this rank issued."""
    with open(os.path.join(run[2], f"comms_rank{rank}.json")) as fh:
        return [step["counts"] for step in json.load(fh)]


def comm_dtypes(run, op):
    """Every dtype in which any rank issued `op` during training steps."""
    found = set()
    for rank in range(len([f for f in os.listdir(run[2]) if f.startswith("comms_rank")])):
        with open(os.path.join(run[2], f"comms_rank{rank}.json")) as fh:
            for step in json.load(fh):
                found.update(step["dtypes"].get(op, []))
    return found


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, no data parallelism: the reference."""
    tmp = tmp_path_factory.mktemp("single")
    return launch(tmp, 1, {
        "none": ["--strategy", "none"],
        "none_accum4": ["--strategy", "none", "--micro-batch", "2"],
        "fsdp1": ["--strategy", "fsdp"],
        "meta1": ["--strategy", "fsdp", "--meta-init"],
        "val11": ["--strategy", "none", "--eval-samples", str(VAL_ROWS), "--eval-every", "2"],
        "gqa_tied": ["--strategy", "none"] + GQA_TIED,
    }, "single", record=True)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    runs = {f"{s}-{w[1]}": ["--sharding-strategy", s] + w for s, w in itertools.product(STRATEGIES, WRAPS)}
    runs.update({
        "ddp": ["--strategy", "ddp"],
        "ddp_accum_sync": ["--strategy", "ddp", "--micro-batch", "2", "--grad-accum-mode", "sync"],
        "ddp_ac": ["--strategy", "ddp", "--activation-checkpointing", "--micro-batch", "2"],
        "accum_no_sync": ["--micro-batch", "2", "--grad-accum-mode", "no_sync"],
        "accum_sync": ["--micro-batch", "2", "--grad-accum-mode", "sync"],
        "accum_sync_zero2": ["--micro-batch", "1", "--grad-accum-mode", "sync", "--sharding-strategy",
                             "SHARD_GRAD_OP"],
        "ac_all": ["--activation-checkpointing"],
        "ac_every2": ["--activation-checkpointing", "--ac-every", "2"],
        "ac_size_wrap": ["--activation-checkpointing", "--auto-wrap", "size", "--min-num-params", "2000"],
        "gqa_tied": GQA_TIED,
        "prefetch_post": ["--backward-prefetch", "BACKWARD_POST", "--forward-prefetch"],
        "prefetch_none": ["--backward-prefetch", "NONE", "--no-limit-all-gathers"],
        "flat_params": ["--no-use-orig-params", "--weight-decay", "0"],
        "flat_params_ref": ["--weight-decay", "0"],
        "meta2": ["--meta-init"],
        "free_fsdp": ["--arch", "free", "--latent-bits", "4"],
        "free_ddp": ["--arch", "free", "--latent-bits", "4", "--strategy", "ddp"],
        "free_fsdp_ac": ["--arch", "free", "--latent-bits", "4", "--activation-checkpointing",
                         "--sharding-strategy", "SHARD_GRAD_OP"],
        "bf16": ["--param-dtype", "bf16"],
        "val11": ["--eval-samples", str(VAL_ROWS), "--eval-every", "2"],
        "fp16": ["--param-dtype", "fp16", "--reduce-dtype", "fp16"],
        "fp16_ddp": ["--param-dtype", "fp16", "--strategy", "ddp"],
        # FSDP2
        "fsdp2-FULL_SHARD": FSDP2,
        "fsdp2-SHARD_GRAD_OP": FSDP2 + ["--sharding-strategy", "SHARD_GRAD_OP"],
        "fsdp2-size": FSDP2 + WRAPS[2],
        "fsdp2_accum_no_sync": FSDP2 + ["--micro-batch", "2", "--grad-accum-mode", "no_sync"],
        "fsdp2_accum_sync": FSDP2 + ["--micro-batch", "2", "--grad-accum-mode", "sync"],
        "fsdp2_accum_sync_zero2": FSDP2 + ["--micro-batch", "1", "--grad-accum-mode", "sync", "--sharding-strategy",
                                           "SHARD_GRAD_OP"],
        "fsdp2_ac": FSDP2 + ["--activation-checkpointing", "--ac-every", "2", "--micro-batch", "2"],
        "fsdp2_meta": FSDP2 + ["--meta-init"],
        # A size rule that would make the tied embedding a unit of its own: it stays in the root's.
        "fsdp2_gqa_tied": FSDP2 + GQA_TIED + ["--auto-wrap", "size", "--min-num-params", "100"],
        "fsdp2_tied_meta": FSDP2 + GQA_TIED + ["--meta-init"],
        "fsdp2_free": FSDP2 + FREE + ["--forward-prefetch"],
        "fsdp2_free_ac": FSDP2 + FREE + ["--activation-checkpointing", "--sharding-strategy", "SHARD_GRAD_OP"],
        "fsdp2_bf16": FSDP2 + ["--param-dtype", "bf16"],
        "fsdp2_fp16": FSDP2 + ["--param-dtype", "fp16", "--reduce-dtype", "fp16"],
        "fsdp2_offload_sync": FSDP2 + ["--cpu-offload", "--micro-batch", "2", "--grad-accum-mode", "sync"],
        "fsdp2_val11": FSDP2 + ["--sharding-strategy", "SHARD_GRAD_OP", "--eval-samples", str(VAL_ROWS),
                                "--eval-every", "2"],
        "fsdp2_hybrid1": FSDP2 + ["--sharding-strategy", "HYBRID_SHARD", "--hybrid-shard-size", "1"],
        "fsdp2_ignored": FSDP2 + ["--backward-prefetch", "NONE", "--no-limit-all-gathers", "--buffer-dtype", "bf16",
                                  "--sync-module-states", "--no-use-orig-params"],
    })
    if HAS_TORCHAO:  # --float8 on a smaller batch: the CPU's float8 matmul is a slow reference kernel
        runs.update({"fsdp_float8": FLOAT8, "fsdp2_float8": FSDP2 + FLOAT8,
                     "ddp_float8": ["--strategy", "ddp"] + FLOAT8,
                     "ddp_gb4": ["--strategy", "ddp", "--global-batch", "4"]})
    return launch(tmp, 2, runs, "two", record=True)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """4 processes: hybrid sharding as 2 groups of 2 (shard inside, replicate across)."""
    tmp = tmp_path_factory.mktemp("four")
    return launch(tmp, 4, {
        "full": ["--micro-batch", "2"],
        "hybrid": ["--micro-batch", "2", "--sharding-strategy", "HYBRID_SHARD", "--hybrid-shard-size", "2"],
        "hybrid_zero2": ["--micro-batch", "2", "--sharding-strategy", "_HYBRID_SHARD_ZERO2",
                         "--hybrid-shard-size", "2"],
        # Accumulation (2 micro-batches of 1) under hybrid sharding, in both modes.
        "hybrid_accum_no_sync": ["--micro-batch", "1", "--sharding-strategy", "HYBRID_SHARD",
                                 "--hybrid-shard-size", "2", "--grad-accum-mode", "no_sync"],
        "hybrid_accum_sync": ["--micro-batch", "1", "--sharding-strategy", "HYBRID_SHARD",
                              "--hybrid-shard-size", "2", "--grad-accum-mode", "sync"],
        # FSDP2: FULL_SHARD and SHARD_GRAD_OP over 4, hybrid as 2 groups of 2, with accumulation
        "fsdp2_full4": FSDP2 + ["--micro-batch", "1", "--grad-accum-mode", "no_sync"],
        "fsdp2_sgo4": FSDP2 + ["--micro-batch", "1", "--grad-accum-mode", "sync", "--sharding-strategy",
                               "SHARD_GRAD_OP"],
        "fsdp2_hybrid": FSDP2 + ["--micro-batch", "2", "--sharding-strategy", "HYBRID_SHARD",
                                 "--hybrid-shard-size", "2"],
        "fsdp2_hybrid_zero2": FSDP2 + ["--micro-batch", "2", "--sharding-strategy", "_HYBRID_SHARD_ZERO2",
                                       "--hybrid-shard-size", "2"],
        "fsdp2_hybrid_accum_no_sync": FSDP2 + ["--micro-batch", "1", "--sharding-strategy", "HYBRID_SHARD",
                                               "--hybrid-shard-size", "2", "--grad-accum-mode", "no_sync"],
        "fsdp2_hybrid_accum_sync": FSDP2 + ["--micro-batch", "1", "--sharding-strategy", "HYBRID_SHARD",
                                            "--hybrid-shard-size", "2", "--grad-accum-mode", "sync"],
    }, "four", record=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("wrap", [w[1] for w in WRAPS])
def test_fsdp_two_processes_equal_one_process(single, two, strategy, wrap):
    assert_same_run(two[f"{strategy}-{wrap}"], single["none"])


def test_ddp_equals_one_process(single, two):
    assert_same_run(two["ddp"], single["none"])
    assert_same_run(two["ddp_accum_sync"], single["none"])
    assert_same_run(two["ddp_ac"], single["none"])  # checkpointing inside DDP, with no_sync accumulation


def test_accumulation_layouts_are_equal(single, two, four):
    """1 process x 4 micro-batches = 4 processes x 1 = 2 processes x 2, in both modes.

    Guards issue 13 bug 1, the loss not divided by the accumulation steps or divided twice:
    the gradient would be `accum` times too large or too small. The losses cannot show it
    (clipping at 1.0 is active and AdamW ignores the gradient's scale), the pre-clipping
    gradient norm of every step does: it must not depend on the layout."""
    ref = single["none"]
    assert_same_run(single["none_accum4"], ref)     # accum 4, one process
    assert_same_run(four["full"], ref)              # accum 1, 4 processes
    assert_same_run(two["accum_no_sync"], ref)      # accum 2
    assert_same_run(two["accum_sync"], ref)         # accum 2
    assert_same_run(two["accum_sync_zero2"], ref)   # accum 4
    assert_same_run(two["ddp_ac"], ref)             # accum 2 under DDP
    # The norm is that of the mean loss over the global batch, so about the same size as with
    # one micro-batch; a factor accum (4) either way is far outside these bounds.
    assert all(1 < n < 20 for n in grad_norms(ref)), grad_norms(ref)


def test_no_sync_reduces_gradients_once_per_step(two, four):
    """Guards issue 13 bug 5, no_sync never entered: the gradients would be reduced after every
    micro-batch, giving the same numbers (by design) at twice the traffic. Counted per step and
    rank: no_sync accumulation issues exactly the reductions of a step without accumulation,
    sync mode one set per micro-batch (2 here), under FSDP1, FSDP2 (set_requires_gradient_sync),
    their hybrid sharding and DDP."""
    cases = [  # (accumulation run in no_sync mode, in sync mode, run without accumulation, ops, processes,
        # all_reduce calls a step that reduce no gradient: train_step's count of the step's targets, and the
        # gradient norm's, which FSDP1's clip_grad_norm_ issues)
        ("accum_no_sync", "accum_sync", "FULL_SHARD-module", ["reduce_scatter_single"], two, 2, 1),
        ("hybrid_accum_no_sync", "hybrid_accum_sync", "hybrid", ["reduce_scatter_single", "all_reduce"], four, 4, 2),
        ("ddp_ac", "ddp_accum_sync", "ddp", ["ddp_bucket_all_reduce"], two, 2, 1),
        ("fsdp2_accum_no_sync", "fsdp2_accum_sync", "fsdp2-FULL_SHARD", ["reduce_scatter_single"], two, 2, 1),
        ("fsdp2_hybrid_accum_no_sync", "fsdp2_hybrid_accum_sync", "fsdp2_hybrid", ["reduce_scatter_single",
                                                                                   "all_reduce"], four, 4, 1),
    ]
    for no_sync, sync, plain, ops, runs, nproc, norm_reduces in cases:
        for rank in range(nproc):
            once, per_micro, single_pass = comms(runs[no_sync], rank), comms(runs[sync], rank), comms(runs[plain], rank)
            assert len(once) == len(per_micro) == len(single_pass) == 5
            for step in range(5):
                for op in ops:
                    norm = norm_reduces if op == "all_reduce" else 0
                    n = single_pass[step].get(op, 0) - norm  # one per unit (hybrid: across replicas)
                    assert n > 0, (plain, op, single_pass[step])
                    assert once[step].get(op, 0) - norm == n, f"{no_sync} rank {rank} step {step + 1}: {once[step]}"
                    assert per_micro[step].get(op, 0) - norm == 2 * n, f"{sync} rank {rank}: {per_micro[step]}"


def test_reduce_dtype_is_the_dtype_of_the_gradient_reduction(two):
    """Guards issue 13 bug 4, --reduce-dtype ignored (gradients reduced in the parameter
    dtype): the bf16 run's losses stay within any loose tolerance of fp32's either way, so
    check what goes over the wire: bf16 parameters, gradients reduce-scattered in fp32 (the
    default --reduce-dtype); with --reduce-dtype fp16, in fp16."""
    assert comm_dtypes(two["bf16"], "reduce_scatter_single") == {"float32"}
    assert comm_dtypes(two["fp16"], "reduce_scatter_single") == {"float16"}
    assert comm_dtypes(two["FULL_SHARD-module"], "reduce_scatter_single") == {"float32"}


def rank0_share(run_dir):
    """Rank 0's share of the parameters, from the start-up summary (padding makes it a bit more)."""
    with open(os.path.join(run_dir, "training_log.txt")) as fh:
        m = re.search(r"parameters: total ([\d,]+) \| trainable [\d,]+ \| on rank 0 ([\d,]+)", fh.read())
    total, local = (int(g.replace(",", "")) for g in m.groups())
    return local / total


def test_hybrid_sharding_two_groups_of_two(single, four):
    assert_same_run(four["hybrid"], single["none"])
    assert_same_run(four["hybrid_zero2"], single["none"])
    # Sharded over a group of 2, not over all 4 (equal losses alone cannot tell the two apart).
    assert 0.5 <= rank0_share(four["hybrid"][2]) < 0.55
    assert 0.5 <= rank0_share(four["hybrid_zero2"][2]) < 0.55
    assert 0.25 <= rank0_share(four["full"][2]) < 0.3


def test_hybrid_sharding_with_accumulation_equals_one_process(single, four):
    assert_same_run(four["hybrid_accum_no_sync"], single["none"])
    assert_same_run(four["hybrid_accum_sync"], single["none"])


def test_activation_checkpointing_changes_no_loss(two):
    ref = two["FULL_SHARD-module"]
    assert_same_run(two["ac_all"], ref)
    assert_same_run(two["ac_every2"], ref)
    assert_same_run(two["ac_size_wrap"], ref)


def test_gqa_and_tied_embeddings_under_fsdp_equal_one_process(single, two):
    assert_same_run(two["gqa_tied"], single["gqa_tied"])
    assert two["gqa_tied"][0] != single["none"][0]  # the options change the model


def test_other_fsdp_knobs_change_no_loss(single, two):
    ref = two["FULL_SHARD-module"]
    for name in ("prefetch_post", "prefetch_none"):
        assert_same_run(two[name], ref)
    assert_same_run(single["fsdp1"], single["none"])
    # Flat parameters cannot exempt 1-D weights from decay, so compare both without decay.
    assert_same_run(two["flat_params"], two["flat_params_ref"])


def assert_same_run_and_weights(run, ref):
    """Equal losses, and equal final weights (the consolidated model.pt of step 5)."""
    assert_same_run(run, ref)
    a = torch.load(os.path.join(run[2], "checkpoints", "step_0000005", "model.pt"), weights_only=True)["model"]
    b = torch.load(os.path.join(ref[2], "checkpoints", "step_0000005", "model.pt"), weights_only=True)["model"]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_meta_init_is_world_size_independent(single, two):
    """Units are materialised and initialised in the same order on every rank and world size."""
    assert_same_run_and_weights(two["meta2"], single["meta1"])


@pytest.mark.parametrize("run, run_ac", [("free_fsdp", "free_fsdp_ac"), ("fsdp2_free", "fsdp2_free_ac")])
def test_free_transformer_fsdp_equals_ddp(two, run, run_ac):
    """Z is sampled per rank, so compare at the same world size; the post-sampler weight is
    sharded by FSDP1 / FSDP2 and its update must match DDP's. FSDP2's runs also use forward
    prefetch, and activation checkpointing under SHARD_GRAD_OP."""
    assert_same_run(two[run], two["free_ddp"])
    assert_same_run(two[run_ac], two["free_ddp"])
    a = torch.load(os.path.join(two[run][2], "checkpoints", "step_0000005", "model.pt"), weights_only=True)["model"]
    b = torch.load(os.path.join(two["free_ddp"][2], "checkpoints", "step_0000005", "model.pt"),
                   weights_only=True)["model"]
    torch.testing.assert_close(a["latent.post_sampler"], b["latent.post_sampler"], rtol=1e-4, atol=1e-6)


def test_bf16_mixed_precision_trains_close_to_fp32(two):
    bf16, fp32 = two["bf16"][0], two["FULL_SHARD-module"][0]
    assert all(abs(a - b) < 0.05 * b for a, b in zip(bf16, fp32))
    assert bf16 != fp32  # bf16 really ran in reduced precision


def test_full_state_dict_loads_into_unwrapped_model(two):
    """The consolidated checkpoint loads with torch.load + load_state_dict into a plain model,
    which then gives the validation loss the FSDP run reported."""
    losses, val, run_dir = two["FULL_SHARD-module"]
    with open(os.path.join(run_dir, "checkpoints", "latest")) as fh:
        ckpt = torch.load(os.path.join(run_dir, "checkpoints", fh.read().strip(), "model.pt"), weights_only=True)
    cfg = model_lib.ModelConfig(**ckpt["config"]["model"])
    model = model_lib.build_model(cfg)
    model.load_state_dict(ckpt["model"])
    model.eval()
    ds = data_lib.open_dataset(data_lib.DataConfig(**ckpt["config"]["data"]), ckpt["config"]["train"]["seed"])
    x, y = ds.val_batch(0, 16)
    with torch.no_grad():
        logits, _ = model(x)
        loss, _ = model_lib.lm_loss(logits, y)
    assert abs(loss.item() - val["val_loss"]) < 1e-5 * val["val_loss"]


def test_fp16_with_sharded_grad_scaler(two):
    """fp16 goes through ShardedGradScaler (FSDP) / GradScaler (DDP): the first step overflows
    at the initial scale 2^16 and is skipped, then training proceeds like DDP's."""
    runs = {}
    for name in ("fp16", "fp16_ddp"):
        with open(os.path.join(two[name][2], "metrics.jsonl")) as fh:
            runs[name] = [r for r in map(json.loads, fh) if "loss" in r]
    assert runs["fp16"][0]["grad_norm"] == float("inf")
    assert all(math.isfinite(r["grad_norm"]) for r in runs["fp16"][1:])
    for a, b in zip(runs["fp16"], runs["fp16_ddp"]):
        assert abs(a["loss"] - b["loss"]) < 1e-3 * b["loss"]
    assert runs["fp16"][-1]["loss"] < runs["fp16"][0]["loss"]


def test_validation_is_world_size_independent(single, two):
    """11 validation rows over 2 ranks x micro-batch 4: in the last chunk (rows 8-10) rank 0 has
    3 rows and rank 1 none, so rank 1 runs a dummy row that must weigh 0; the mean equals the
    single process's at every evaluation. Guards issue 13 bug 7 (the padding row weighted 1:
    one row's loss too many in the sum, about 1/11 off)."""
    micro, world = 4, 2  # TINY's global batch 8 over 2 processes
    last_chunk = (VAL_ROWS - 1) // (micro * world) * (micro * world)
    assert last_chunk + micro >= VAL_ROWS  # rank 1's first row of the last chunk is past the end
    vals = {}
    for name, runs in (("one", single), ("two", two)):
        with open(os.path.join(runs["val11"][2], "metrics.jsonl")) as fh:
            vals[name] = [r["val_loss"] for r in map(json.loads, fh) if "val_loss" in r]
    assert len(vals["one"]) == len(vals["two"]) == 3  # steps 2, 4 and the last
    for a, b in zip(vals["two"], vals["one"]):
        assert abs(a - b) <= 1e-5 * b


# =============================================================================================
# FSDP2 (--strategy fsdp2)


def wrap_info(run, rank=0):
    """The FSDP units, state-dict tensor types and forward-prefetch pairs (dist_driver.wrap_record)."""
    with open(os.path.join(run[2], f"wrap_rank{rank}.json")) as fh:
        return json.load(fh)


def log_of(run):
    with open(os.path.join(run[2], "training_log.txt")) as fh:
        return fh.read()


FSDP2_EQUAL_ONE_PROCESS = [  # (launch, run): fp32 losses, gradient norms and validation of one process
    ("two", "fsdp2-FULL_SHARD"), ("two", "fsdp2-SHARD_GRAD_OP"), ("two", "fsdp2-size"),
    ("two", "fsdp2_accum_no_sync"), ("two", "fsdp2_accum_sync"), ("two", "fsdp2_accum_sync_zero2"),
    ("two", "fsdp2_ac"), ("two", "fsdp2_offload_sync"), ("two", "fsdp2_ignored"), ("two", "fsdp2_hybrid1"),
    ("four", "fsdp2_full4"), ("four", "fsdp2_sgo4"), ("four", "fsdp2_hybrid"), ("four", "fsdp2_hybrid_zero2"),
    ("four", "fsdp2_hybrid_accum_no_sync"), ("four", "fsdp2_hybrid_accum_sync"),
]


@pytest.mark.parametrize("where,name", FSDP2_EQUAL_ONE_PROCESS, ids=[n for _, n in FSDP2_EQUAL_ONE_PROCESS])
def test_fsdp2_equals_one_process(single, two, four, where, name):
    """FULL_SHARD / SHARD_GRAD_OP / HYBRID on 2 and 4 processes, with and without accumulation in
    both modes, activation checkpointing, size-rule units and CPU offload (sync accumulation,
    which FSDP1 refuses with offload). The logged gradient norm is the global one: the local
    DTensor norm of a shard would differ."""
    run = {"two": two, "four": four}[where][name]
    assert_same_run(run, single["none"])
    assert abs(run[1]["val_loss"] - single["none"][1]["val_loss"]) <= 1e-5 * single["none"][1]["val_loss"]
    if name != "fsdp2_hybrid1":
        assert "strategy fsdp2 " in log_of(run)


def test_fsdp2_cpu_offload_policy(two):
    """--cpu-offload: CPUOffloadPolicy on every unit (on a CPU-only machine the numbers cannot
    show it: test_fsdp2_equals_one_process checks they stay right, with sync accumulation)."""
    policies = wrap_info(two["fsdp2_offload_sync"])["fsdp2_policies"]
    assert [p[0] for p in policies] == ["", "blocks.0", "blocks.1"]
    assert {p[1] for p in policies} == {"CPUOffloadPolicy"}
    assert {p[1] for p in wrap_info(two["fsdp2-FULL_SHARD"])["fsdp2_policies"]} == {"OffloadPolicy"}


def test_fsdp2_units_are_fsdp1_units(two):
    """One rule (shard_units) decides the units of both backends, for the block rule and the size
    rule; the root is a unit of its own."""
    for fsdp1, fsdp2 in (("FULL_SHARD-module", "fsdp2-FULL_SHARD"), ("FULL_SHARD-size", "fsdp2-size")):
        assert wrap_info(two[fsdp2])["units"] == wrap_info(two[fsdp1])["units"]
    assert [u[0] for u in wrap_info(two["fsdp2-FULL_SHARD"])["units"]] == ["", "blocks.0", "blocks.1"]
    assert len(wrap_info(two["fsdp2-size"])["units"]) > 3  # the size rule picks more, smaller units


def test_fsdp2_sharding_strategy_sets_reshard_after_forward(two, four):
    """FULL_SHARD and HYBRID_SHARD gather every unit twice a step (forward, then again in backward:
    resharded after forward) except the last block and the root, needed first in backward;
    SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2 once. Equal losses cannot tell them apart; the
    all-gathers can."""
    def gathers(run):
        return {s["counts"]["all_gather_single"] for s in json.load(open(os.path.join(run[2], "comms_rank0.json")))}
    units = len(wrap_info(two["fsdp2-FULL_SHARD"])["units"])
    assert units == 3  # the root and two blocks
    assert gathers(two["fsdp2-FULL_SHARD"]) == {2 * units - 2}
    assert gathers(two["fsdp2-SHARD_GRAD_OP"]) == {units}
    assert gathers(four["fsdp2_hybrid"]) == {2 * units - 2}
    assert gathers(four["fsdp2_hybrid_zero2"]) == {units}


def test_fsdp2_hybrid_shards_over_the_group_only(four):
    assert 0.5 <= rank0_share(four["fsdp2_hybrid"][2]) < 0.55
    assert 0.5 <= rank0_share(four["fsdp2_hybrid_zero2"][2]) < 0.55
    assert 0.25 <= rank0_share(four["fsdp2_full4"][2]) < 0.3


def test_state_dicts_hold_dtensors_under_fsdp1_and_fsdp2(two):
    """FSDP1 gets a device mesh for every sharding strategy, so its state dicts hold DTensors
    like FSDP2's (without one: ShardedTensor); DCP checkpoints of both then interchange.
    NO_SHARD shards nothing: plain tensors, as DDP's."""
    for strategy in STRATEGIES:
        expected = ["Tensor"] if strategy == "NO_SHARD" else ["DTensor"]
        assert wrap_info(two[f"{strategy}-module"])["state_dict"] == expected, strategy
    assert wrap_info(two["fsdp2-FULL_SHARD"])["state_dict"] == ["DTensor"]


def test_fsdp2_meta_init_equals_fsdp1_meta_init(single, two):
    """Sharded on the meta device, then each module initialised on full-size tensors in FSDP1's
    order, each rank keeping its shard: the weights of one FSDP1 process, at any world size."""
    assert_same_run_and_weights(two["fsdp2_meta"], single["meta1"])


def test_fsdp2_tied_embeddings_stay_in_one_unit(single, two):
    """The size rule would make the embedding a unit: tied to the head (in the root), it stays
    in the root's unit with it. Under --meta-init (allowed with fsdp2) the tie survives."""
    assert_same_run(two["fsdp2_gqa_tied"], single["gqa_tied"])
    names = [u[0] for u in wrap_info(two["fsdp2_gqa_tied"])["units"]]
    assert "tok_emb" not in names and "lm_head" not in names and len(names) > 3, names
    final = torch.load(os.path.join(two["fsdp2_tied_meta"][2], "checkpoints", "step_0000005", "model.pt"),
                       weights_only=True)["model"]
    assert torch.equal(final["tok_emb.weight"], final["lm_head.weight"])
    losses = two["fsdp2_tied_meta"][0]
    assert losses[-1] < losses[0] and losses != two["fsdp2_gqa_tied"][0]


def test_fsdp2_forward_prefetch_follows_the_run_order(two):
    """--forward-prefetch: each unit prefetches the next in the order the forward ran them (the
    latent sampler between the two halves of the Free Transformer); none without the flag."""
    assert wrap_info(two["fsdp2_free"])["forward_prefetch"] == [["", "blocks.0"], ["blocks.0", "latent"],
                                                                ["latent", "blocks.1"]]
    assert wrap_info(two["fsdp2-FULL_SHARD"])["forward_prefetch"] == []


def test_fsdp2_mixed_precision_policy(two):
    """param_dtype and reduce_dtype through MixedPrecisionPolicy: bf16 compute with fp32
    reduce-scatters; fp16 with fp16 reduce-scatters and the amp GradScaler (the first step
    overflows at 2^16 and is skipped, then training proceeds like DDP's)."""
    assert {tuple(p[1:]) for p in wrap_info(two["fsdp2_bf16"])["fsdp2_policies"]} == {
        ("OffloadPolicy", "torch.bfloat16", "torch.float32")}
    assert comm_dtypes(two["fsdp2_bf16"], "reduce_scatter_single") == {"float32"}
    assert comm_dtypes(two["fsdp2_fp16"], "reduce_scatter_single") == {"float16"}
    bf16, fp32 = two["fsdp2_bf16"][0], two["fsdp2-FULL_SHARD"][0]
    assert all(abs(a - b) < 0.05 * b for a, b in zip(bf16, fp32)) and bf16 != fp32
    # The same bf16 casts as FSDP1's MixedPrecision: FSDP1 and FSDP2 differ only in the order of
    # the fp32 sums (2e-5 relative seen over 8 steps; DDP's autocast, another set of casts, 8e-4).
    assert all(abs(a - b) < 2e-4 * b for a, b in zip(bf16, two["bf16"][0])), (bf16, two["bf16"][0])
    with open(os.path.join(two["fsdp2_fp16"][2], "metrics.jsonl")) as fh:
        fp16 = [r for r in map(json.loads, fh) if "loss" in r]
    assert fp16[0]["grad_norm"] == float("inf") and all(math.isfinite(r["grad_norm"]) for r in fp16[1:])
    for a, b in zip(fp16, two["fp16_ddp"][0]):
        assert abs(a["loss"] - b) < 1e-3 * b


def test_fsdp2_validation_between_steps(single, two):
    """Evaluations every 2 steps under SHARD_GRAD_OP (the gathered parameters outlive a no-grad
    forward) leave training and the later evaluations as one process has them."""
    assert_same_run(two["fsdp2_val11"], single["val11"])
    vals = {}
    for name, runs in (("one", single), ("two", two)):
        run = runs["val11" if name == "one" else "fsdp2_val11"]
        with open(os.path.join(run[2], "metrics.jsonl")) as fh:
            vals[name] = [r["val_loss"] for r in map(json.loads, fh) if "val_loss" in r]
    assert len(vals["one"]) == len(vals["two"]) == 3
    for a, b in zip(vals["two"], vals["one"]):
        assert abs(a - b) <= 1e-5 * b


def test_fsdp2_names_the_fsdp1_settings_it_ignores(two):
    """Settings FSDP2 has no form for are said on one line (and change nothing: see
    test_fsdp2_equals_one_process)."""
    notes = [line for line in log_of(two["fsdp2_ignored"]).splitlines() if "have no effect" in line]
    assert len(notes) == 1, notes
    for flag in ("--backward-prefetch NONE", "--limit-all-gathers False", "--buffer-dtype bf16",
                 "--sync-module-states True", "--use-orig-params False"):
        assert flag in notes[0], notes[0]
    assert "have no effect" not in log_of(two["fsdp2-FULL_SHARD"])


def test_hybrid_with_one_process_per_group_is_ddp(two):
    """One process per shard group is replication: DDP does it (FSDP1's NO_SHARD fallback skipped
    the all-reduce across replicas)."""
    with open(os.path.join(two["fsdp2_hybrid1"][2], "config.json")) as fh:
        assert json.load(fh)["train"]["strategy"] == "ddp"
    assert "strategy ddp" in log_of(two["fsdp2_hybrid1"])
    assert comms(two["fsdp2_hybrid1"])[0].get("ddp_bucket_all_reduce", 0) > 0


@NEEDS_TORCHAO
def test_float8_trains_alike_under_every_strategy(two):
    """--float8 tensorwise scales each tensor by its own amax, and FSDP gathers the weights before the cast:
    FSDP1, FSDP2 and DDP cast the same tensors and give the same losses. The matmuls really ran in
    float8: the losses are close to fp32's, not equal."""
    ref = two["ddp_float8"]
    for name in ("fsdp_float8", "fsdp2_float8"):
        assert_same_run(two[name], ref)
    fp32 = two["ddp_gb4"][0]
    assert all(abs(a - b) < 0.02 * b for a, b in zip(ref[0], fp32)) and ref[0] != fp32


def latest_checkpoint(run):
    root = os.path.join(run[2], "checkpoints")
    with open(os.path.join(root, "latest")) as fh:
        return os.path.join(root, fh.read().strip())


@NEEDS_TORCHAO
def test_float8_converts_the_blocks_and_keeps_the_checkpoint_layout(two):
    """Only the blocks' Linear layers whose sides are multiples of 16 compute in float8, the head
    never. The checkpoints hold what any run's hold: the same names, shapes and dtypes in dcp/ and
    in model.pt, which loads into the plain model."""
    def layout(run):
        ckpt = latest_checkpoint(run)
        meta = train_fsdp.read_dcp_metadata(os.path.join(ckpt, "dcp")).state_dict_metadata
        sharded = {k: (tuple(m.size), m.properties.dtype) for k, m in meta.items() if k.startswith("model.")}
        full = torch.load(os.path.join(ckpt, "model.pt"), weights_only=True)
        return sharded, {k: (tuple(v.shape), v.dtype) for k, v in full["model"].items()}, full
    ref_sharded, ref_full, full = layout(two["ddp_gb4"])
    model = model_lib.build_model(model_lib.ModelConfig(**full["config"]["model"]))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    expected = sorted(n for n, m in linears.items() if n.startswith("blocks.")
                      and m.in_features % 16 == 0 and m.out_features % 16 == 0)
    assert expected and "lm_head" in linears
    assert wrap_info(two["ddp_gb4"])["float8"] == []
    for name in ("fsdp_float8", "fsdp2_float8", "ddp_float8"):
        assert sorted(wrap_info(two[name])["float8"]) == expected, name
        sharded, full_layout, full = layout(two[name])
        assert sharded == ref_sharded and full_layout == ref_full, name
        model.load_state_dict(full["model"])
