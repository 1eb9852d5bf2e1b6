"""Multi-node emulated on one host: two torchrun launchers (--nnodes=2, c10d rendezvous on
localhost) as two "nodes". HYBRID_SHARD / _HYBRID_SHARD_ZERO2 shard within a node and replicate
across; losses equal the single-process run (fp32, 1e-5 relative)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import script_runner  # noqa: E402

from test_distributed import (  # noqa: E402
    TINY,
    assert_same,
    clean_env,
    launch,
    rank0_share,
    rendezvous_store,
    run_forked,
)


def two_nodes(tmp_path, per_node, runs, tag):
    """Start two launchers of `per_node` processes each; return {name: losses}."""
    spec, out = {}, {}
    for name, extra in runs.items():
        out[name] = str(tmp_path / f"{tag}-{name}")
        spec[name] = TINY + ["--out-dir", out[name]] + extra
    spec_file = tmp_path / f"{tag}.json"
    spec_file.write_text(json.dumps(spec))
    # Both launchers must be told one endpoint, so neither can pick it: this process serves the
    # rendezvous store on a port bound as 0, and both launchers join it as clients (is_host=false).
    # Rank 0's launcher then serves its workers' store on a port of its own, also bound as 0.
    store, _ = rendezvous_store()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={per_node}",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{store.port}", "--rdzv_conf=is_host=false",
           f"--rdzv_id={tag}", os.path.join(ROOT, "tests", "dist_driver.py"), str(spec_file)]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    for p, log in zip(nodes, logs):
        assert p.returncode == 0, log[-4000:]
    result = {}
    for name, run_dir in out.items():
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            result[name] = [r["loss"] for r in map(json.loads, fh) if "loss" in r]
    return result, logs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("ref"), 1, {"none": ["--strategy", "none"]}, "ref")["none"][0]


def test_two_nodes_of_two_processes_hybrid_sharding(tmp_path, reference):
    losses, _ = two_nodes(tmp_path, 2, {
        "full": ["--micro-batch", "2"],
        "hybrid": ["--micro-batch", "2", "--sharding-strategy", "HYBRID_SHARD"],
        "hybrid_zero2": ["--micro-batch", "2", "--sharding-strategy", "_HYBRID_SHARD_ZERO2"],
    }, "2x2")
    for name in ("full", "hybrid", "hybrid_zero2"):
        assert_same(losses[name], reference)
    # Hybrid shards inside a node (2 processes), FULL_SHARD over all 4.
    assert 0.5 <= rank0_share(tmp_path / "2x2-hybrid") < 0.55
    assert 0.5 <= rank0_share(tmp_path / "2x2-hybrid_zero2") < 0.55
    assert 0.25 <= rank0_share(tmp_path / "2x2-full") < 0.3


def test_two_nodes_of_one_process_hybrid_is_replication(tmp_path, reference):
    """One process per node: the shard group is one process, so hybrid sharding is pure
    replication; the trainer says so and the losses still equal the single process's."""
    losses, logs = two_nodes(tmp_path, 1, {
        "hybrid": ["--sharding-strategy", "HYBRID_SHARD"],
        "hybrid_zero2": ["--sharding-strategy", "_HYBRID_SHARD_ZERO2"],
    }, "2x1")
    assert_same(losses["hybrid"], reference)
    assert_same(losses["hybrid_zero2"], reference)
    assert "using DDP (--strategy ddp) across all processes" in "".join(logs)


def test_srun_style_launch_without_torchrun(tmp_path, reference):
    """Processes started the way srun starts tasks (SLURM_PROCID / SLURM_STEP_NUM_TASKS /
    SLURM_LOCALID, no RANK or WORLD_SIZE) find their rank and world size and train like one
    process. A plain `python train_fsdp.py` inside an allocation of several tasks (SLURM_NTASKS
    without a step) stays one process."""
    (_store, rendezvous), run_dir = rendezvous_store(), tmp_path / "srun"  # the store lives until they exit
    envs = [{**clean_env(), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_LOCALID": str(rank), "SLURM_STEP_NUM_NODES": "1", **rendezvous} for rank in range(2)]
    procs = run_forked("train_fsdp.py", [*TINY, "--out-dir", run_dir], envs)  # forked, as launch()'s ranks
    assert all(p.returncode == 0 for p in procs), procs[0].stderr[-3000:] + procs[1].stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as fh:
        losses = [r["loss"] for r in map(json.loads, fh) if "loss" in r]
    assert_same(losses, reference)
    assert "world 2" in (run_dir / "training_log.txt").read_text()
    env = clean_env()
    env.update(SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_LOCALID="0")
    alone = script_runner.run("train_fsdp.py", [*TINY, "--max-steps", "1", "--out-dir", tmp_path / "alone"], ROOT, env)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "world 1" in (tmp_path / "alone" / "training_log.txt").read_text()
