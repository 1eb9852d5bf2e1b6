"""Keep README.md true: its settings table lists every field with its real default, and every
--flag it mentions exists in train_fsdp.py, sample.py, torchrun, sbatch or lm_eval."""
import dataclasses
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_fsdp  # noqa: E402

README = open(os.path.join(ROOT, "README.md")).read()
SBATCH_FLAGS = {"--gpus-per-node", "--nodes", "--time", "--signal", "--requeue", "--cpus-per-task", "--batch",
                "--wait", "--nnodes"}
TORCHRUN_FLAGS = {"--nproc_per_node", "--nnodes", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id", "--standalone"}
PIP_FLAGS = {"--index-url"}
LM_EVAL_FLAGS = {"--model", "--model_args", "--tasks", "--batch_size"}
SAMPLE_FLAGS = {"--ckpt", "--prompt", "--num-samples", "--max-new-tokens", "--temperature", "--top-k", "--seed",
                "--prompt-z", "--fixed-z", "--demo", "--device"}


def test_settings_table_lists_every_field_with_its_default():
    for section, obj in train_fsdp.sections(train_fsdp.Config()).items():
        for f in dataclasses.fields(obj):
            row = re.search(r"^\| `%s` \| `([^`]*)` \|" % re.escape(train_fsdp.flag_name(f.name)), README, re.M)
            assert row, f"README settings table has no row for {train_fsdp.flag_name(f.name)}"
            default = f.default
            shown = "''" if default == "" else (f"{default:g}" if isinstance(default, float) else str(default))
            assert row.group(1) == shown, f"{f.name}: README says {row.group(1)}, code says {shown}"


def test_every_flag_in_the_readme_exists():
    import bench
    parser_flags = {a for p in (train_fsdp.build_arg_parser(), bench.build_arg_parser())
                    for action in p._actions for a in action.option_strings}
    known = parser_flags | TORCHRUN_FLAGS | SAMPLE_FLAGS | SBATCH_FLAGS | PIP_FLAGS | LM_EVAL_FLAGS
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", README))
    assert mentioned - known == set()


def test_make_training_targets_train_and_demonstrate_in_one_run_directory():
    """`make train-* RUN=DIR` trains into DIR and the demonstration that follows reads DIR;
    without RUN on the command line each target gets its own timestamped directory."""
    def dry_run(*args):  # the commands make would run (not "make[1]: Entering ..." under `make test`)
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
        env["RUN"] = "runs/from-the-environment"  # an exported RUN is not the run directory
        return subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=True).stdout.splitlines()

    for target in ("train-free-fsdp", "train-baseline-fsdp", "train-free", "train-baseline"):
        named = dry_run(target, "RUN=runs/mine", "ARGS=--max-steps 3")
        assert "--out-dir runs/mine --max-steps 3" in named[0] and named[1].endswith("--ckpt runs/mine --demo")
        default = dry_run(target)
        run_dir = re.search(r"--out-dir (runs/\S+)", default[0]).group(1)
        assert run_dir.startswith(f"runs/{target[len('train-'):]}-") and f"--ckpt {run_dir} --demo" in default[1]


def test_every_make_target_in_the_readme_exists():
    """`make NAME` in the README names a target of the Makefile; `make bench SUITE=X` runs bench.py on suite X."""
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", open(os.path.join(ROOT, "Makefile")).read(), re.M))
    mentioned = set(re.findall(r"(?:^\s*|`)make ([a-z][a-z0-9-]*)", README, re.M))  # in code, not prose
    assert mentioned and mentioned - targets == set()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "--no-print-directory", "-n", "bench", "SUITE=multi", "BENCH_ARGS=--only DDP"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out.endswith("bench.py --suite multi --only DDP")
