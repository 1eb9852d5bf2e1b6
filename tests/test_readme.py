"""Keep README.md and docs/ true: docs/configuration.md lists every flag of `train_fsdp.py
--help` with its real default; every --flag the README and docs/ mention exists in
train_fsdp.py, bench.py, sample.py, torchrun, sbatch, lm_eval or tensorboard; every `make` target they name
exists; every link of README.md, BENCHMARKS.md and docs/ reaches a file and a heading, and every
tests/ or tools/ script they name is there."""
import dataclasses
import glob
import os
import re
import subprocess
import sys
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import script_runner  # noqa: E402

import train_fsdp  # noqa: E402


def read(path):
    with open(os.path.join(ROOT, path)) as fh:
        return fh.read()


README = read("README.md")
CONFIGURATION = read("docs/configuration.md")
DOCS = {path: read(path) for path in ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT))}
PAGES = {**DOCS, "BENCHMARKS.md": read("BENCHMARKS.md")}
FLAG = r"(?<![\w-])--[a-z][a-z0-9_-]*"
SBATCH_FLAGS = {"--gpus-per-node", "--nodes", "--time", "--signal", "--requeue", "--cpus-per-task", "--batch",
                "--wait", "--nnodes", "--ntasks", "--mem", "--wrap"}
TORCHRUN_FLAGS = {"--nproc_per_node", "--nnodes", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id", "--standalone"}
PIP_FLAGS = {"--index-url", "--local-dir"}  # and huggingface_hub's `hf download`
LM_EVAL_FLAGS = {"--model", "--model_args", "--tasks", "--batch_size"}
PYTEST_FLAGS = {"--dist", "--no-loadscope-reorder"}  # make test: pytest-xdist's
with open(os.path.join(ROOT, "tools", "mutants.py")) as fh:  # make mutants' MUTANTS_ARGS
    MUTANTS_FLAGS = set(re.findall(r'add_argument\("(--[a-z-]+)"', fh.read()))
SAMPLE_FLAGS = {"--ckpt", "--prompt", "--num-samples", "--max-new-tokens", "--temperature", "--top-k", "--seed",
                "--prompt-z", "--fixed-z", "--demo", "--figure", "--device", "--chat"}
TENSORBOARD_FLAGS = {"--logdir", "--port"}


def test_settings_table_lists_every_field_with_its_default():
    for section, obj in train_fsdp.sections(train_fsdp.Config()).items():
        for f in dataclasses.fields(obj):
            row = re.search(r"^\| `%s` \| `([^`]*)` \|" % re.escape(train_fsdp.flag_name(f.name)), CONFIGURATION, re.M)
            assert row, f"docs/configuration.md has no row for {train_fsdp.flag_name(f.name)}"
            default = f.default
            shown = "''" if default == "" else (f"{default:g}" if isinstance(default, float) else str(default))
            assert row.group(1) == shown, f"{f.name}: docs/configuration.md says {row.group(1)}, code says {shown}"


def test_configuration_page_has_every_flag_of_help_and_no_other():
    """Every flag `python train_fsdp.py --help` prints has a row (a boolean's --no- form aside;
    --config and --export are described in the text), and every row is a flag it prints."""
    helped = script_runner.run("train_fsdp.py", ["--help"], ROOT, dict(os.environ, OMP_NUM_THREADS="1"))
    assert helped.returncode == 0, helped.stderr
    helped = set(re.findall(FLAG, helped.stdout))
    helped -= {"--help"} | {f for f in helped if f.startswith("--no-") and "--" + f[5:] in helped}
    rows = set(re.findall(r"^\| `(--[a-z][a-z0-9-]*)` \|", CONFIGURATION, re.M))
    assert helped - rows == {"--config", "--export"}
    assert {"`--config FILE`", "`--export CHECKPOINT_DIR`"} <= set(re.findall(r"`--[a-z]+ [A-Z_]+`", CONFIGURATION))
    assert rows - helped == set()


def test_every_flag_in_the_readme_and_docs_exists():
    import bench
    parser_flags = {a for p in (train_fsdp.build_arg_parser(), bench.build_arg_parser())
                    for action in p._actions for a in action.option_strings}
    known = (parser_flags | TORCHRUN_FLAGS | SAMPLE_FLAGS | SBATCH_FLAGS | PIP_FLAGS | LM_EVAL_FLAGS |
             TENSORBOARD_FLAGS | PYTEST_FLAGS | MUTANTS_FLAGS)
    for path, text in DOCS.items():
        assert set(re.findall(FLAG, text)) - known == set(), path


def test_readme_links_the_settings_and_the_benchmarks():
    links = set(re.findall(r"\]\(([^)#]+)", README))
    assert {"docs/configuration.md", "BENCHMARKS.md"} <= links


def slug(heading):
    """GitHub's anchor of a heading: lower case; letters, digits, marks, spaces, - and _ kept; spaces to -."""
    text = heading.strip().lower()
    return "".join(c for c in text if unicodedata.category(c)[0] in "LMN" or c in " -_").replace(" ", "-")


def test_every_link_reaches_a_file_and_a_heading():
    def anchors(path):
        text = re.sub(r"(?ms)^```.*?^```", "", read(path))  # a "# comment" in a code block is no heading
        return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#+ ", line)}
    for path, text in PAGES.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            assert os.path.isfile(os.path.join(ROOT, linked)), f"{path}: {target}"
            if anchor and linked.endswith(".md"):
                assert anchor in anchors(linked), f"{path}: {target} (no such heading in {linked})"


def test_every_script_named_in_the_docs_is_there():
    """tests/ and tools/ files named in README, BENCHMARKS or docs/ exist (moved files included)."""
    for path, text in PAGES.items():
        for name in re.findall(r"(?<![\w/.-])((?:tests|tools)/[\w./-]+\.(?:py|sh))", text):
            assert os.path.isfile(os.path.join(ROOT, name)), f"{path} names {name}"


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
    """`make NAME` in the README and docs/ names a target of the Makefile; `make bench SUITE=X` runs
    bench.py on suite X."""
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", read("Makefile"), re.M))
    for path, text in DOCS.items():
        mentioned = set(re.findall(r"(?:^\s*|`)make ([a-z][a-z0-9-]*)", text, re.M))  # in code, not prose
        assert mentioned - targets == set(), path
    assert re.findall(r"(?:^\s*|`)make ([a-z][a-z0-9-]*)", README, re.M)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "--no-print-directory", "-n", "bench", "SUITE=multi", "BENCH_ARGS=--only DDP"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out.endswith("bench.py --suite multi --only DDP")


def test_the_reading_guide_names_places_that_exist():
    """The README's reading guide of train_fsdp.py (its bullet) names functions and classes that the
    file defines (torch's it names: imported), in the order it says, the first FSDP( call and main()
    where it says."""
    guide = README.split("- `train_fsdp.py`:", 1)[1].split("\n- ", 1)[0]
    source = read("train_fsdp.py")
    torch_names = ("ModuleWrapPolicy", "MixedPrecision", "no_sync", "clip")
    names = [n for n in re.findall(r"`(\w+)(?:\(\))?`", guide) if n not in torch_names]
    assert len(names) >= 10
    places = [re.search(rf"^(def|class) {name}\b", source, re.M) for name in names]
    assert all(places), [n for n, p in zip(names, places) if not p]
    assert "ModuleWrapPolicy(" in source and "MixedPrecision(" in source
    strategies = [p.start() for n, p in zip(names, places) if n in ("wrap_fsdp1", "wrap_fsdp2", "wrap_whole")]
    assert strategies == sorted(strategies) and len(strategies) == 3
    assert source[:source.index("FSDP(")].count("\n") < 450  # "before line 450"
    assert source[:source.index("\ndef main(")].count("\n") < 1100  # "before line 1,100"


def test_readme_is_a_front_page_under_20_kb():
    assert len(README.encode()) < 20 * 1024  # reference tables and studies live in docs/
