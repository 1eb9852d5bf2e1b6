"""slurm_submit.sh on a real one-node Slurm cluster started on this machine (CPU, gloo).

The module fixture writes a slurm.conf for this host into a temporary directory, starts munged,
slurmctld and slurmd as root with their state, spool, logs and sockets there, waits for the
node to be idle, and stops everything afterwards (also when a test fails). Needs root and the
Debian packages slurm-wlm and munge (.ci/run installs them); without them the tests skip
loudly. The job output files, the run directories and the daemons' logs stay in pytest's
temporary directory for a look after a failure.

  a. a 2-process CPU job trains like a direct 1-process run of the same config (1e-5 relative)
  b. USR1 to the batch shell (what --signal=B:USR1@120 sends before the time limit): the
     trainer saves, the job requeues itself, resumes and finishes with the losses of an
     uninterrupted run at the same world size
  c. a total batch that does not divide fails at once: exit 2 and one clear line
"""
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import pytest

from test_distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "slurm_submit.sh")
# The states of a job that has ended for good (a requeued job passes through REQUEUED and PENDING instead).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED")
DAEMONS = ["munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo"]
TINY = ["--arch", "baseline", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--param-dtype", "fp32",
        "--eval-samples", "8", "--log-every", "1"]


def skip_loudly(why):
    msg = f"SLURM TEST SKIPPED: {why}; slurm_submit.sh was NOT tested (.ci/run installs Slurm as root)"
    print("\n" + "#" * 100 + "\n" + msg + "\n" + "#" * 100, file=sys.stderr)
    warnings.warn(msg)  # shows in the warnings summary even under pytest -q
    pytest.skip(msg)


def free_ports(n):
    """n different ports free now. Slurm's daemons read their ports from slurm.conf, so they
    cannot bind port 0 and report it: the ports are found just before slurm.conf is written,
    with every socket held until all n are found (two lookups cannot return the same port), and
    the daemons start right after; the window is the daemons' start-up only. Jobs are race-free:
    slurm_submit.sh's one-node rendezvous binds port 0."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def base_env(conf):
    """This environment without a surrounding job's Slurm or torchrun variables, plus the
    cluster's config. Jobs inherit it (--export=ALL), so they use this interpreter."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                "TORCHELASTIC", "GPUS_PER_NODE", "RDZV_", "RUN_DIR", "TOTAL_BATCH",
                                "BATCH_SIZE_PER"))}
    env.update(SLURM_CONF=conf, OMP_NUM_THREADS="1", PYTHON=sys.executable, PYTHONWARNINGS="ignore")
    return env


class Cluster:
    def __init__(self, base):
        self.base = base
        self.host = socket.gethostname().split(".")[0]
        self.cpus = len(os.sched_getaffinity(0))
        self.conf = os.path.join(base, "slurm.conf")
        self.socket = os.path.join(base, "munge.sock")
        self.env = base_env(self.conf)
        self.started = []  # (name, pid file) of the daemons we started, stopped in reverse

    def run(self, *cmd, check=True, timeout=60):
        res = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stdout}{res.stderr}\n{self.logs()}")
        return res.stdout

    def logs(self, n=30):
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = os.path.join(self.base, name)
            if os.path.exists(path):
                with open(path, errors="replace") as fh:
                    out.append(f"--- {path} (last {n} lines)\n" + "".join(fh.readlines()[-n:]))
        return "\n".join(out)

    def write_conf(self):
        b = self.base
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 ** 20
        ctld_port, slurmd_port = free_ports(2)
        for d in ("state", "spool"):
            os.makedirs(os.path.join(b, d), exist_ok=True)
        conf = f"""\
ClusterName=fsdptest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long (default 120 s) before it may start again
AuthInfo=socket={self.socket},cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd.pid
SlurmctldLogFile={b}/slurmctld.log
SlurmdLogFile={b}/slurmd.log
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
ReturnToService=2
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
KillWait=10
InactiveLimit=0
MinJobAge=600
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={max(100, min(1000, mem_mb // 2))} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.conf, "w") as fh:
            fh.write(conf)

    def start(self):
        b = self.base
        key = os.path.join(b, "munge.key")
        with open(key, "wb") as fh:
            fh.write(os.urandom(1024))
        os.chmod(key, 0o400)
        # -f: munged refuses a socket under world-writable /tmp otherwise
        self.run("munged", "-f", f"--socket={self.socket}", f"--key-file={key}", f"--pid-file={b}/munged.pid",
                 f"--log-file={b}/munged.log", f"--seed-file={b}/munged.seed")
        self.started.append(("munged", f"{b}/munged.pid"))
        self.write_conf()  # its ports are found here, just before the daemons that bind them start
        self.run("slurmctld", "-f", self.conf, "-i")
        self.started.append(("slurmctld", f"{b}/slurmctld.pid"))
        self.run("slurmd", "-f", self.conf, "-N", self.host)
        self.started.append(("slurmd", f"{b}/slurmd.pid"))
        deadline, state = time.time() + 60, ""
        while time.time() < deadline:
            res = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True)
            state = res.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        reason = subprocess.run(["sinfo", "-R"], env=self.env, capture_output=True, text=True).stdout
        raise RuntimeError(f"node {self.host} not idle after 60 s (state {state!r}; {reason})\n{self.logs()}")

    def stop(self):
        subprocess.run(["scancel", "--user=root"], env=self.env, capture_output=True)
        deadline = time.time() + 20
        while time.time() < deadline:
            res = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True)
            if res.returncode or not res.stdout.strip():
                break
            time.sleep(0.5)
        pids = []
        for name, pid_file in reversed(self.started):  # all told at once, then waited for
            try:
                with open(pid_file) as fh:
                    pids.append(int(fh.read().split()[0]))
                os.kill(pids[-1], signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
        for pid in pids:
            try:
                for _ in range(100):
                    os.kill(pid, 0)
                    time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.started = []

    def sbatch(self, tmp, name, variables, trainer_args):
        """Submit slurm_submit.sh as the README does, on CPU: no GPU request, all the node's CPUs
        in the one task. Returns the job id."""
        exports = {"CPU_PROCS_PER_NODE": "2", "OMP_NUM_THREADS": "1", **variables}
        cmd = ["sbatch", "--parsable", f"--chdir={ROOT}", f"--job-name={name}", f"--output={tmp}/{name}.out",
               f"--error={tmp}/{name}.err", "--gpus-per-node=0", f"--cpus-per-task={self.cpus}", "--time=15",
               "--export=ALL," + ",".join(f"{k}={v}" for k, v in exports.items())]
        job = self.run(*cmd, SCRIPT, *trainer_args).strip().split(";")[0]
        assert job.isdigit(), f"sbatch said {job!r}"
        return job

    def wait(self, job, timeout):
        """The exit code of the job once it has ended (a requeued one runs again first), None at the timeout.
        Polled here: sbatch --wait polls at 2, 8, then 32 s intervals, which left the suite waiting."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.job_field(job, "JobState") in ENDED:
                return int(self.job_field(job, "ExitCode").split(":")[0])
            time.sleep(0.2)
        return None

    def job_field(self, job, field):
        out = self.run("scontrol", "show", "job", str(job), "-o")
        for part in out.split():
            if part.startswith(field + "="):
                return part.split("=", 1)[1]
        return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        skip_loudly("not root (munged, slurmctld and slurmd run as root here)")
    missing = [d for d in DAEMONS if not shutil.which(d)]
    if missing:
        skip_loudly(f"Slurm/munge not installed (missing {', '.join(missing)}; apt-get install slurm-wlm munge)")
    base = str(tmp_path_factory.mktemp("slurm"))
    if len(base) > 80:  # the munge socket path must fit a sockaddr_un (108 bytes)
        base = tempfile.mkdtemp(prefix="slurm-")
    c = Cluster(base)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def job_files(tmp, name):
    text = {}
    for ext in ("out", "err"):
        path = os.path.join(tmp, f"{name}.{ext}")
        text[ext] = open(path, errors="replace").read() if os.path.exists(path) else ""
    return text


def finish(job, cluster, tmp, name, timeout):
    code = cluster.wait(job, timeout)
    if code is None:
        cluster.run("scancel", job, check=False)
    files = job_files(tmp, name)
    report = (f"job {job}: exit code {code}\n--- {name}.out\n{files['out'][-4000:]}\n"
              f"--- {name}.err\n{files['err'][-4000:]}\n{cluster.logs()}")
    return code, files, report


def direct_run(tmp, name, nproc, args):
    """The same training without Slurm, the reference: its ranks forked srun-style (run_ranks), in a thread beside
    the job. Returns its run directory and the future of the ranks' results."""
    run_dir = os.path.join(tmp, name)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(run_ranks, "train_fsdp.py", args + ["--out-dir", run_dir], nproc, timeout=300)
    pool.shutdown(wait=False)  # the thread ends with the run
    return run_dir, future


def wait_direct(future):
    for rank, res in enumerate(future.result()):
        assert res.returncode == 0, f"rank {rank}: " + res.stdout[-3000:] + res.stderr[-3000:]


def assert_same_losses(got, ref, rel):
    assert sorted(got) == sorted(ref), f"steps differ: {sorted(got)} vs {sorted(ref)}"
    for step in sorted(ref):
        assert abs(got[step] - ref[step]) <= rel * abs(ref[step]), \
            f"step {step}: {got[step]} (Slurm) vs {ref[step]} (direct)"


def test_cpu_job_trains_like_a_direct_run(cluster, tmp_path):
    tmp = str(tmp_path)
    args = TINY + ["--max-steps", "6"]
    # The reference trains beside the job (each with its own data cache): Slurm's start-up leaves the CPU idle.
    ref_dir, ref = direct_run(tmp, "direct", 1, args + ["--strategy", "none", "--global-batch", "8", "--cache-dir",
                                                        str(tmp_path / "cache-direct")])
    run_dir = os.path.join(tmp, "run")
    job = cluster.sbatch(tmp, "train", {"TOTAL_BATCH_SIZE": "8", "BATCH_SIZE_PER_DEVICE": "4", "RUN_DIR": run_dir},
                         args + ["--cache-dir", str(tmp_path / "cache")])
    code, files, report = finish(job, cluster, tmp, "train", timeout=180)
    wait_direct(ref)
    assert code == 0, report
    out = files["out"]
    assert "no GPU on this node: 2 CPU processes per node with gloo" in out, report
    assert "batch: total 8 = 4 per device x 2 processes x accumulation 1" in out, report
    assert "final validation: ce" in out, report
    assert "world 2 | backend gloo" in out, report
    assert_same_losses(read_metrics(run_dir), read_metrics(ref_dir), rel=1e-5)


def test_usr1_saves_requeues_and_resumes_exactly(cluster, tmp_path):
    tmp = str(tmp_path)
    args = TINY + ["--max-steps", "50", "--save-every", "10"]  # stopped at about step 12: 38 steps to spare
    # uninterrupted, same world size and batch layout, beside the job (each with its own data cache)
    ref_dir, ref = direct_run(tmp, "direct", 2, args + ["--global-batch", "8", "--micro-batch", "4", "--cache-dir",
                                                        str(tmp_path / "cache-direct")])
    run_dir = os.path.join(tmp, "run")
    job_id = cluster.sbatch(tmp, "preempt", {"TOTAL_BATCH_SIZE": "8", "BATCH_SIZE_PER_DEVICE": "4",
                                             "RUN_DIR": run_dir}, args + ["--cache-dir", str(tmp_path / "cache")])

    # Stop it once it has trained a few steps, as Slurm does before the time limit.
    metrics, deadline, steps = os.path.join(run_dir, "metrics.jsonl"), time.time() + 120, 0
    while time.time() < deadline and cluster.job_field(job_id, "JobState") not in ENDED:
        if os.path.exists(metrics):
            with open(metrics) as fh:
                steps = sum(1 for _ in fh)
            if steps >= 10:
                break
        time.sleep(0.2)
    running = cluster.job_field(job_id, "JobState") == "RUNNING"
    assert steps >= 10 and running, finish(job_id, cluster, tmp, "preempt", 5)[2]
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=cluster.env, check=True)

    code, files, report = finish(job_id, cluster, tmp, "preempt", timeout=180)
    wait_direct(ref)
    assert code == 0, report
    out = files["out"]
    assert "SIGUSR1: asking the trainer to save and stop" in out, report
    assert f"requeueing job {job_id}; the next run resumes from {run_dir}" in out, report
    assert f"job {job_id} (restart 1)" in out, report
    assert "final validation: ce" in out, report
    assert cluster.job_field(job_id, "Restarts") == "1", report
    assert cluster.job_field(job_id, "JobState") == "COMPLETED", report
    with open(os.path.join(run_dir, "training_log.txt")) as fh:
        log = fh.read()
    assert "resumed from" in log, report + log
    stopped = int(log.split("resumed from")[1].split("(step ")[1].split(",")[0])
    assert 10 <= stopped < 50, log
    # the checkpoint it resumed from is the one saved on the signal (rank 0's line in the .err file)
    assert f"signal SIGTERM at step {stopped}: checkpoint saved, exiting with code 3" in files["err"], report
    # a clean stop: the trainer's stopped.json was there, so no "without saving" line
    assert "without saving a stop checkpoint" not in files["err"] + out, report
    got, want = read_metrics(run_dir), read_metrics(ref_dir)
    assert_same_losses(got, want, rel=1e-6)
    print(f"\nstopped at step {stopped}, resumed after requeue; losses after it match the uninterrupted run "
          f"(step 50: {got[50]:.6f} vs {want[50]:.6f})")


def test_batch_that_does_not_divide_fails_early(cluster, tmp_path):
    tmp = str(tmp_path)
    run_dir = os.path.join(tmp, "run")
    job = cluster.sbatch(tmp, "baddiv", {"TOTAL_BATCH_SIZE": "12", "BATCH_SIZE_PER_DEVICE": "4", "RUN_DIR": run_dir},
                         TINY + ["--max-steps", "2"])
    code, files, report = finish(job, cluster, tmp, "baddiv", timeout=60)
    assert code == 2, report
    errors = [line for line in files["err"].splitlines() if line.strip()]
    assert errors == ["error: TOTAL_BATCH_SIZE=12 is not divisible by BATCH_SIZE_PER_DEVICE=4 x 2 processes "
                      "(1 nodes x 2); use a multiple of 8"], report
    assert not os.path.exists(run_dir)


@pytest.mark.parametrize("slurm_vars, procs", [
    ({"SLURM_GPUS_ON_NODE": "8"}, 8),
    ({"SLURM_GPUS_PER_NODE": "h100:4"}, 4),
    ({"SLURM_GPUS_PER_NODE": "0", "CPU_PROCS_PER_NODE": "3"}, 3),
    ({}, 1),  # no GPU count from Slurm: nvidia-smi's
])
def test_processes_per_node_come_from_the_allocation(slurm_vars, procs, tmp_path):
    """No cluster needed: the batch check fails before srun, naming the derived layout."""
    env = {**base_env(""), "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "TOTAL_BATCH_SIZE": "1000",
           "BATCH_SIZE_PER_DEVICE": "3", "PATH": f"{tmp_path}:{os.environ['PATH']}", **slurm_vars}
    # a fake nvidia-smi that sees one GPU, asked only when Slurm gives no GPU count
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: fake (UUID: GPU-0)'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    res = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2, res.stdout + res.stderr
    world = 2 * procs
    assert res.stderr.strip() == (f"error: TOTAL_BATCH_SIZE=1000 is not divisible by BATCH_SIZE_PER_DEVICE=3 x {world} "
                                  f"processes (2 nodes x {procs}); use a multiple of {3 * world}"), res.stderr


@pytest.mark.parametrize("nodes, endpoint", [("1", r"localhost:0"), ("2", r"node-a:[1-9][0-9]*")])
def test_rendezvous_of_one_node_binds_port_0(nodes, endpoint, tmp_path):
    """One node: torchrun binds port 0, so jobs sharing a node never take the same port. Several
    nodes must all be told one: the first node and a port found free there. A stub srun prints
    the torchrun command it was given (no cluster)."""
    (tmp_path / "srun").write_text('#!/bin/sh\necho "srun $*"\n')
    (tmp_path / "scontrol").write_text("#!/bin/sh\nprintf 'node-a\\nnode-b\\n'\n")
    for name in ("srun", "scontrol"):
        (tmp_path / name).chmod(0o755)
    env = {**base_env(""), "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": nodes, "SLURM_JOB_NODELIST": "node-[a-b]",
           "SLURM_GPUS_PER_NODE": "0", "CPU_PROCS_PER_NODE": "1", "TOTAL_BATCH_SIZE": nodes,
           "BATCH_SIZE_PER_DEVICE": "1", "RUN_DIR": str(tmp_path / "run"), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    srun = next(line for line in res.stdout.splitlines() if line.startswith("srun "))
    assert re.search(rf"--rdzv_endpoint={endpoint} ", srun), srun


def requeue_decision(tmp_path, clean, signal=True, code=1):
    """Runs the script with stub srun / scancel / scontrol (no cluster): the stub srun sends
    USR1 to the batch shell, waits until the shell has asked for the stop (scancel), writes the
    trainer's stopped.json if `clean`, and exits 1 as torchrun does. Without `signal` the stub
    srun only exits with `code` (a run that fails, or finishes, on its own). Returns (exit code,
    output, whether the job was requeued)."""
    stubs, run_dir = tmp_path / "stubs", tmp_path / "run"
    stubs.mkdir(exist_ok=True)
    run_dir.mkdir(exist_ok=True)
    for name in ("scancelled", "requeued"):
        if (stubs / name).exists():
            (stubs / name).unlink()
    scripts = {
        "scancel": f"#!/bin/sh\ntouch {stubs}/scancelled\n",
        "scontrol": f"#!/bin/sh\n[ \"$1\" = requeue ] && touch {stubs}/requeued\n"
                    "[ \"$1\" = show ] && echo 'JobId=7 JobState=RUNNING'\nexit 0\n",
        "srun": (f"#!/bin/sh\nkill -USR1 $PPID\nwhile [ ! -e {stubs}/scancelled ]; do sleep 0.05; done\n"
                 if signal else "#!/bin/sh\n")
                + (f"echo '{{\"step\": 5}}' > {run_dir}/stopped.json\n" if clean else "") + f"exit {code}\n",
    }
    for name, text in scripts.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {**base_env(""), "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_PER_NODE": "0",
           "CPU_PROCS_PER_NODE": "1", "TOTAL_BATCH_SIZE": "1", "BATCH_SIZE_PER_DEVICE": "1", "HEAD_NODE": "localhost",
           "RDZV_PORT": "1", "RUN_DIR": str(run_dir), "PATH": f"{stubs}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    return res.returncode, res.stdout + res.stderr, (stubs / "requeued").exists()


def test_a_failure_after_the_signal_is_requeued_once(tmp_path):
    """No stopped.json: requeued the first time (the resume starts from a complete checkpoint),
    not the second (a save that always fails must not requeue forever); a clean stop requeues
    and clears the mark."""
    code, out, requeued = requeue_decision(tmp_path, clean=False)
    assert (code, requeued) == (0, True), out
    assert "without saving a stop checkpoint" in out and "resumes from the latest complete one" in out, out
    code, out, requeued = requeue_decision(tmp_path, clean=False)
    assert (code, requeued) == (1, False), out
    assert "failed again (exit code 1) without saving a stop checkpoint: not requeueing" in out, out
    code, out, requeued = requeue_decision(tmp_path, clean=True)
    assert (code, requeued) == (0, True) and "without saving" not in out, out
    assert not (tmp_path / "run" / "requeued_after_failure").exists()
    code, out, requeued = requeue_decision(tmp_path, clean=False)  # the mark was cleared: once more
    assert (code, requeued) == (0, True), out


@pytest.mark.parametrize("code", [1, 2, 0])
def test_a_run_that_ends_without_a_signal_is_not_requeued(tmp_path, code):
    """Guards issue 13 bug 6, requeueing after any failure: with no signal, a failed run (exit
    1 from torchrun, 2 for bad input) ends the job with its own exit code and is not requeued
    (a requeue would rerun a failing job forever); nor is a finished one (0). No requeue mark
    is left behind, and scancel is never called."""
    code_out, out, requeued = requeue_decision(tmp_path, clean=False, signal=False, code=code)
    assert (code_out, requeued) == (code, False), out
    assert f"srun exited with code {code}" in out and "requeueing" not in out, out
    assert not (tmp_path / "run" / "requeued_after_failure").exists()
    assert not (tmp_path / "stubs" / "scancelled").exists()


def test_environment_hooks_venv_conda_and_modules(tmp_path):
    """VENV, CONDA_ENV and MODULES run before anything else (a stub conda and module here); the
    activation scripts may read unset variables (set -u is off around them). The job then
    stops at the batch check, so nothing trains."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text('echo "venv activated${NOT_SET_ANYWHERE}"\n')
    (tmp_path / "conda").write_text("#!/bin/sh\n# `conda shell.bash hook` prints the shell function\n"
                                    "echo 'conda() { echo \"conda $1 $2${NOT_SET_EITHER}\"; }'\n")
    (tmp_path / "conda").chmod(0o755)
    env = {**base_env(""), "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_PER_NODE": "0",
           "CPU_PROCS_PER_NODE": "2", "TOTAL_BATCH_SIZE": "3", "BATCH_SIZE_PER_DEVICE": "1",
           "VENV": str(tmp_path / "venv"), "CONDA_ENV": "myenv", "MODULES": "gcc cuda",
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    # `module` is a shell function on clusters; a stub on PATH stands in for it
    (tmp_path / "module").write_text('#!/bin/sh\necho "module $*"\n')
    (tmp_path / "module").chmod(0o755)
    res = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "is not divisible" in res.stderr, res.stdout + res.stderr
    assert res.stdout.splitlines()[:3] == ["module load gcc cuda", "venv activated", "conda activate myenv"], res.stdout
