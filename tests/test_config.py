"""Configuration and bad-input handling of train_fsdp.py.

Product rules under test:
- bad input -> ONE line on stderr starting "error: " that names the bad value (and what is valid),
  exit code 2, and nothing overwritten;
- one tree of dataclasses (Config: model/data/fsdp/train); every field is a flag --field-name and a key
  of the TOML table of its section (--config); precedence command line > config file > preset
  (--preset, --size) > default;
- the resolved config is saved as config.json in the run directory.

Part A calls parse_config/check_config in-process (fast). Part B runs the real CLI, each command in a
process of its own forked from one that imported torch already (tests/script_runner.py); the commands
that need no earlier result are run by one module fixture, a few at a time.
"""

import concurrent.futures
import dataclasses
import json
import os
import random
import shutil
import sys
import types
from pathlib import Path

import pytest
import script_runner
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import model as model_lib  # noqa: E402
import train_fsdp as T  # noqa: E402
from train_fsdp import BadInput, check_config, parse_config  # noqa: E402

TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def field_type(f):
    return TYPES.get(f.type, f.type) if isinstance(f.type, str) else f.type


def all_fields():
    """(section, field) for every field of every section of Config, discovered generically."""
    return [(section, f) for section, obj in T.sections(T.Config()).items() for f in dataclasses.fields(obj)]


def write_toml(path, text):
    path.write_text(text)
    return str(path)


def bad(argv, *words):
    """parse_config + check_config must raise BadInput, in one line, containing every word."""
    with pytest.raises(BadInput) as info:
        check_config(parse_config(argv))
    msg = str(info.value)
    assert "\n" not in msg, f"message is not one line: {msg!r}"
    for word in words:
        assert word in msg, f"{word!r} not in {msg!r}"
    return msg


# =============================================================================================
# A. In-process: parse_config / check_config


@pytest.mark.parametrize("argv, words", [
    (["--no-such-flag"], ["--no-such-flag"]),
    (["--lr", "abc"], ["--lr", "abc", "float"]),
    (["--max-steps", "1.5"], ["--max-steps", "1.5", "int"]),
    (["--sharding-strategy", "FOO"], ["--sharding-strategy", "FOO", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                                      "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]),
    (["--preset", "nope"], ["--preset", "nope", "single_node_fsdp", "multi_node_fsdp", "large_scale_fsdp", "ddp"]),
    (["--size", "huge"], ["--size", "huge", *model_lib.SIZE_PRESETS]),
    (["--tokenizer-type", "word"], ["--tokenizer-type", "word", "bpe", "unigram", "char"]),
    (["--lr"], ["--lr", "expected one argument"]),
    (["--activation-checkpointing=1"], ["--activation-checkpointing", "'1'"]),
], ids=["unknown-flag", "lr-not-float", "max-steps-not-int", "unknown-sharding", "unknown-preset", "unknown-size",
        "unknown-tokenizer-type", "missing-value", "bool-flag-with-value"])
def test_bad_command_line(argv, words):
    bad(argv, *words)


def test_abbreviated_flag_is_not_accepted():
    # allow_abbrev=False: a prefix of a flag is an unknown flag, not silently --max-steps.
    bad(["--max-st", "3"], "--max-st")


@pytest.mark.parametrize("argv, words", [
    (["--grad-accum-mode", "sync", "--cpu-offload"], ["--grad-accum-mode sync", "--cpu-offload", "no_sync"]),
    (["--ac-every", "0"], ["--ac-every 0", ">= 1"]),
    (["--global-batch", "0"], ["--global-batch 0"]),
    (["--micro-batch", "-1"], ["--micro-batch -1"]),
    (["--arch", "free", "--n-layer", "3"], ["--n-layer 3", "even"]),
    (["--d-model", "100", "--n-head", "3"], ["--d-model 100", "--n-head 3"]),
    (["--d-model", "96", "--n-head", "32"], ["--d-model 96", "--n-head 32", "even head size"]),
    (["--n-head", "4", "--n-kv-head", "3"], ["--n-kv-head 3", "--n-head 4"]),
    (["--arch", "foo"], ["--arch", "foo", "free", "baseline"]),
    (["--latent-bits", "21"], ["--latent-bits 21", "1..20"]),
], ids=["sync-cpu-offload", "ac-every-0", "global-batch-0",
        "micro-batch-negative", "free-odd-layers", "d-model-not-multiple", "odd-head-size", "kv-heads-not-divisor",
        "unknown-arch", "latent-bits-range"])
def test_bad_combinations(argv, words):
    bad(argv, *words)


def test_sync_with_cpu_offload_is_fine_without_fsdp():
    # The rule is about FSDP's offloaded gradients: with DDP the same flags are not an error here.
    check_config(parse_config(["--grad-accum-mode", "sync", "--cpu-offload", "--strategy", "ddp"]))


def test_default_config_is_valid():
    cfg = parse_config([])
    check_config(cfg)
    model_lib.resolve_model_config(cfg.model)  # fills derived fields
    assert cfg.model.n_kv_head == cfg.model.n_head
    assert cfg.model.ffn_hidden > 0


@pytest.mark.parametrize("text, words", [
    ("[foo]\nx = 1\n", ["[foo]", "model", "data", "fsdp", "train"]),
    ("[train]\nbogus = 1\n", ["train.bogus", "valid keys", "max_steps", "lr"]),
    ("[train]\nlr = \"x\"\n", ["train.lr", "'x'", "float"]),
    ("[train]\nmax_steps = 1.5\n", ["train.max_steps", "1.5", "int"]),
    ("[train]\ncompile = 1\n", ["train.compile", "1", "bool"]),
    ("[train]\nmax_steps = true\n", ["train.max_steps", "True", "int"]),
    ("[fsdp]\nsharding_strategy = \"FOO\"\n", ["fsdp.sharding_strategy", "'FOO'", "FULL_SHARD", "HYBRID_SHARD"]),
    ("[train]\npreset = \"zzz\"\n", ["zzz", "single_node_fsdp", "ddp"]),
    ("[model]\nsize = \"zzz\"\n", ["zzz", "125m", "tiny"]),
    ("lr = 0.1\n", ["'lr'", "table", "[train]"]),
    ("[train.sub]\nx = 1\n", ["train.sub"]),
    ("[train\nlr = 1\n", ["not valid TOML", "line 1"]),
], ids=["unknown-table", "unknown-key", "lr-string", "int-field-float", "bool-field-int", "int-field-bool",
        "value-outside-choices", "unknown-preset", "unknown-size", "top-level-key", "nested-table", "invalid-toml"])
def test_bad_config_file(tmp_path, text, words):
    path = write_toml(tmp_path / "c.toml", text)
    msg = bad(["--config", path], *words)
    if "preset" not in text and "size" not in text:
        assert path in msg  # the message says which file holds the bad value


def test_missing_config_file(tmp_path):
    missing = str(tmp_path / "nope.toml")
    bad(["--config", missing], "--config", missing, "no such file")


def test_config_file_that_is_a_directory(tmp_path):
    bad(["--config", str(tmp_path)], "--config", str(tmp_path))


def test_config_file_not_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[train]\nout_dir = \"caf\xe9\"\n")
    bad(["--config", str(path)], "--config", str(path))


# ---------------------------------------------------------------------------------------------
# Numbers out of range are bad input, reported by check_config before anything is written
# (otherwise they crash later with a traceback or silently do nothing).

RANGES = [  # (argv, flag the message must name)
    (["--log-every", "0"], "--log-every"),
    (["--eval-samples", "0"], "--eval-samples"),
    (["--max-steps", "-3"], "--max-steps"),
    (["--epochs", "0"], "--epochs"),
    (["--n-head", "0"], "--n-head"),
    (["--n-kv-head", "-1"], "--n-kv-head"),
    (["--mapper-chunk", "0"], "--mapper-chunk"),
    (["--lr", "-1"], "--lr"),
    (["--dropout", "1.5"], "--dropout"),
]


@pytest.mark.parametrize("argv, flag", RANGES, ids=[a[0].lstrip("-") + "=" + a[1] for a, _ in RANGES])
def test_out_of_range_numbers_are_bad_input(argv, flag):
    bad(argv, flag, argv[1])


# ---------------------------------------------------------------------------------------------
# Precedence: command line > config file > preset (--preset, --size) > default


def test_no_arguments_give_the_defaults():
    assert parse_config([]) == T.Config()


@pytest.mark.parametrize("preset", [p for p in T.PRESETS])
def test_preset_sets_exactly_its_fields(preset):
    cfg = parse_config(["--preset", preset])
    expected = T.Config()
    expected.train.preset = preset
    for section, values in T.PRESETS[preset].items():
        for key, value in values.items():
            setattr(getattr(expected, section), key, value)
    assert cfg == expected


def test_large_scale_preset_turns_on_checkpointing_and_meta_init():
    cfg = parse_config(["--preset", "large_scale_fsdp"])
    assert cfg.fsdp.activation_checkpointing is True
    assert cfg.fsdp.meta_init is True
    assert cfg.train.strategy == "fsdp"
    check_config(cfg)  # the bundle itself is a valid configuration


def test_ddp_preset_sets_strategy():
    assert parse_config(["--preset", "ddp"]).train.strategy == "ddp"


def test_multi_node_preset_sets_hybrid_shard():
    cfg = parse_config(["--preset", "multi_node_fsdp"])
    assert cfg.fsdp.sharding_strategy == "HYBRID_SHARD"
    assert cfg.fsdp.forward_prefetch is True


def test_file_overrides_preset(tmp_path):
    path = write_toml(tmp_path / "c.toml", "[fsdp]\nmeta_init = false\n")
    cfg = parse_config(["--preset", "large_scale_fsdp", "--config", path])
    assert cfg.fsdp.meta_init is False  # file beats preset
    assert cfg.fsdp.activation_checkpointing is True  # untouched preset field stays


def test_command_line_overrides_file_and_preset(tmp_path):
    path = write_toml(tmp_path / "c.toml", "[train]\nlr = 0.005\nmax_steps = 7\n[fsdp]\nmeta_init = true\n")
    cfg = parse_config(["--config", path, "--lr", "0.002", "--preset", "large_scale_fsdp", "--no-meta-init"])
    assert cfg.train.lr == 0.002  # command line beats file
    assert cfg.train.max_steps == 7  # file value not on the command line stays
    assert cfg.fsdp.meta_init is False  # command line beats file and preset
    assert cfg.fsdp.activation_checkpointing is True  # from the preset


def test_preset_named_in_file(tmp_path):
    path = write_toml(tmp_path / "c.toml", "[train]\npreset = \"ddp\"\n")
    cfg = parse_config(["--config", path])
    assert cfg.train.preset == "ddp" and cfg.train.strategy == "ddp"


def test_file_field_beats_preset_named_in_same_file(tmp_path):
    path = write_toml(tmp_path / "c.toml", "[train]\npreset = \"ddp\"\nstrategy = \"none\"\n")
    assert parse_config(["--config", path]).train.strategy == "none"


def test_command_line_preset_beats_preset_in_file(tmp_path):
    path = write_toml(tmp_path / "c.toml", "[train]\npreset = \"ddp\"\n")
    cfg = parse_config(["--config", path, "--preset", "multi_node_fsdp"])
    assert cfg.train.preset == "multi_node_fsdp"
    assert cfg.train.strategy == "fsdp"  # the ddp bundle is not applied at all
    assert cfg.fsdp.sharding_strategy == "HYBRID_SHARD"


def test_size_preset_sets_shape():
    cfg = parse_config(["--size", "125m"])
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head) == (12, 768, 12)


def test_flag_beats_size_whatever_the_order():
    for argv in (["--n-layer", "2", "--size", "125m"], ["--size", "125m", "--n-layer", "2"]):
        cfg = parse_config(argv)
        assert cfg.model.n_layer == 2
        assert cfg.model.d_model == 768


def test_file_beats_size_preset(tmp_path):
    path = write_toml(tmp_path / "c.toml", "[model]\nn_layer = 6\n")
    cfg = parse_config(["--config", path, "--size", "125m"])
    assert cfg.model.n_layer == 6 and cfg.model.d_model == 768


def test_size_named_in_file(tmp_path):
    path = write_toml(tmp_path / "c.toml", "[model]\nsize = \"small\"\n")
    cfg = parse_config(["--config", path])
    assert (cfg.model.n_layer, cfg.model.d_model) == (6, 384)


def test_int_accepted_for_float_field_in_file(tmp_path):
    path = write_toml(tmp_path / "c.toml", "[train]\nlr = 1\nepochs = 2\n[model]\nrope_theta = 500000\n")
    cfg = parse_config(["--config", path])
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert cfg.train.epochs == 2.0 and type(cfg.train.epochs) is float
    assert cfg.model.rope_theta == 500000.0 and type(cfg.model.rope_theta) is float


def test_bool_flags():
    assert parse_config(["--activation-checkpointing"]).fsdp.activation_checkpointing is True
    assert parse_config(["--no-activation-checkpointing"]).fsdp.activation_checkpointing is False
    assert parse_config(["--preset", "large_scale_fsdp",
                         "--no-activation-checkpointing"]).fsdp.activation_checkpointing is False
    assert parse_config([]).fsdp.limit_all_gathers is True
    assert parse_config(["--no-limit-all-gathers"]).fsdp.limit_all_gathers is False


def test_last_repeated_flag_wins():
    assert parse_config(["--lr", "1", "--lr", "2"]).train.lr == 2.0


# ---------------------------------------------------------------------------------------------
# Every field is a flag and a TOML key, with a help string; discovered generically so that a field
# added later without a flag (or without help) fails here.


def other_value(section, f):
    """A valid value of the field's type that differs from its default."""
    default = getattr(getattr(T.Config(), section), f.name)
    choices = f.metadata.get("choices")
    typ = field_type(f)
    if choices:
        return next(c for c in choices if c != default)
    if section == "model" and f.name == "size":
        return next(s for s in model_lib.SIZE_PRESETS if s != default)
    if typ is bool:
        return not default
    if typ is int:
        return default + 3
    if typ is float:
        return default + 0.25
    if typ is str:
        return default + "x"
    raise AssertionError(f"{section}.{f.name}: unexpected type {f.type!r}")


def test_every_field_has_help_and_a_flag():
    parser = T.build_arg_parser()
    actions = {a.dest: a for a in parser._actions}
    for section, f in all_fields():
        help_text = f.metadata.get("help")
        assert isinstance(help_text, str) and help_text.strip(), f"{section}.{f.name} has no help string"
        action = actions.get(f"{section}.{f.name}")
        assert action is not None, f"{section}.{f.name} has no command-line flag"
        assert T.flag_name(f.name) in action.option_strings
        assert f.metadata.get("help") in action.help
        if field_type(f) is bool:
            assert "--no-" + f.name.replace("_", "-") in action.option_strings
        else:
            assert action.choices == f.metadata.get("choices")
    assert {f"{s}.{f.name}" for s, f in all_fields()} | {"config", "export", "help"} == set(actions)


def test_flag_names_are_unique():
    flags = [T.flag_name(f.name) for _, f in all_fields()]
    assert len(flags) == len(set(flags)), sorted(x for x in flags if flags.count(x) > 1)
    assert "--config" not in flags and "--help" not in flags
    T.build_arg_parser()  # argparse itself would raise on a conflict


def test_help_lists_every_flag():
    text = T.build_arg_parser().format_help()
    for _, f in all_fields():
        assert T.flag_name(f.name) in text


def test_every_field_settable_from_command_line():
    argv, expected = [], T.Config()
    for section, f in all_fields():
        value = other_value(section, f)
        setattr(getattr(expected, section), f.name, value)
        flag = T.flag_name(f.name)
        if field_type(f) is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    cfg = parse_config(argv)
    for section, f in all_fields():
        assert getattr(getattr(cfg, section), f.name) == getattr(getattr(expected, section), f.name), \
            f"{T.flag_name(f.name)} did not set {section}.{f.name}"


def test_every_field_settable_from_config_file(tmp_path):
    lines, expected = [], T.Config()
    for section in T.sections(expected):
        lines.append(f"[{section}]")
        for s, f in all_fields():
            if s == section:
                value = other_value(section, f)
                setattr(getattr(expected, section), f.name, value)
                lines.append(f"{f.name} = {json.dumps(value)}")  # JSON scalars are valid TOML here
    cfg = parse_config(["--config", write_toml(tmp_path / "all.toml", "\n".join(lines) + "\n")])
    assert cfg == expected


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
@pytest.mark.parametrize("extra", [[], ["--strategy", "none", "--arch", "baseline"]], ids=["fsdp", "none"])
def test_shipped_config_files_are_valid(path, extra):
    cfg = parse_config(["--config", str(path), *extra])
    check_config(cfg)
    assert cfg != T.Config()  # the file set something


def test_config_dataclasses_are_the_sections():
    assert set(T.sections(T.Config())) == {"model", "data", "fsdp", "train", "checkpoint"}
    assert all(dataclasses.is_dataclass(sec) for sec in T.sections(T.Config()).values())
    assert type(T.Config().model) is model_lib.ModelConfig  # this project's seams' settings by default


# =============================================================================================
# B. The real command line, as subprocesses

TINY = ["--arch", "baseline", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--max-steps", "2",
        "--global-batch", "4", "--param-dtype", "fp32", "--eval-samples", "8"]
WORDS = ("the a of and to in is was that for on with as by at from river mountain quickly silver garden "
         "letter window").split()


def cli_env():
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCH_DISTRIBUTED_DEBUG"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"  # tiny models; keeps parallel subprocesses from fighting over 2 cores
    return env


def run_cli(args, timeout=180):
    return script_runner.run("train_fsdp.py", args, REPO, cli_env(), timeout)


def error_line(proc):
    """Checks the bad-input contract and returns the single error line."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), proc.stderr
    assert len(lines) == 1, f"more than one line on stderr: {proc.stderr!r}"
    return lines[-1]


def small_corpus(path, n_lines=400):
    rnd = random.Random(0)
    path.write_text("\n".join(" ".join(rnd.choice(WORDS) for _ in range(10)) for _ in range(n_lines)) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Starts every independent CLI scenario at once; returns {name: (CompletedProcess, scenario dir)}."""
    root = tmp_path_factory.mktemp("cli")
    scenarios = {}

    def add(name, args):
        d = root / name
        d.mkdir(exist_ok=True)
        scenarios[name] = (args(d), d)

    add("unknown_flag", lambda d: ["--no-such-flag", "--out-dir", d / "run"])
    add("unknown_enum", lambda d: ["--sharding-strategy", "FOO", "--out-dir", d / "run"])
    add("indivisible_batch", lambda d: [*TINY, "--global-batch", "10", "--micro-batch", "4", "--out-dir", d / "run"])
    add("missing_data", lambda d: ["--dataset", "/nonexistent/corpus.txt", "--cache-dir", d / "cache",
                                   "--out-dir", d / "run"])

    def empty_corpus(d):
        (d / "empty.txt").write_text("")
        return ["--dataset", d / "empty.txt", "--cache-dir", d / "cache", "--out-dir", d / "run"]
    add("empty_corpus", empty_corpus)
    add("seq_len_train", lambda d: ["--dataset", small_corpus(d / "corpus.txt"), "--tokenizer-type", "char",
                                    "--seq-len", "100000", "--cache-dir", d / "cache", "--out-dir", d / "run"])
    # ~18.6k characters: training split ok for 1000, the 1% validation split (~190 tokens) is not.
    add("seq_len_val", lambda d: ["--dataset", small_corpus(d / "corpus.txt"), "--tokenizer-type", "char",
                                  "--seq-len", "1000", "--cache-dir", d / "cache", "--out-dir", d / "run"])

    def taken(d):
        (d / "run").mkdir()
        (d / "run" / "config.json").write_text('{"previous": "run"}\n')
        (d / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
        return [*TINY, "--out-dir", d / "run"]
    add("run_dir_taken", taken)
    add("hybrid_bad", lambda d: [*TINY, "--sharding-strategy", "HYBRID_SHARD", "--hybrid-shard-size", "3",
                                 "--out-dir", d / "run"])

    def out_dir_is_file(d):
        (d / "f").write_text("x")
        return [*TINY, "--out-dir", d / "f"]
    add("out_dir_is_file", out_dir_is_file)
    add("ok", lambda d: [*TINY, "--out-dir", d / "ok"])
    add("debug", lambda d: [*TINY, "--debug", "--out-dir", d / "run"])
    add("fsdp_knobs_under_ddp", lambda d: [*TINY, "--strategy", "ddp", "--sharding-strategy", "SHARD_GRAD_OP",
                                           "--no-limit-all-gathers", "--activation-checkpointing",
                                           "--out-dir", d / "run"])

    def with_config(d):
        toml = write_toml(d / "run.toml", "[model]\narch = \"baseline\"\nn_layer = 2\nd_model = 32\nn_head = 2\n"
                          "[fsdp]\nparam_dtype = \"fp32\"\n"
                          "[train]\npreset = \"ddp\"\nmax_steps = 1\nglobal_batch = 4\neval_samples = 8\n"
                          "lr = 0.005\nseed = 7\n")
        return ["--config", toml, "--lr", "0.002", "--out-dir", d / "run"]
    add("config_file", with_config)

    workers = max(2, min(4, os.cpu_count() or 2))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {name: pool.submit(run_cli, args) for name, (args, _) in scenarios.items()}
        return {name: (futures[name].result(), scenarios[name][1]) for name in scenarios}


def test_cli_debug_turns_on_distributed_debugging(runs):
    """--debug sets the level torch.distributed uses (reading the variable after import is not enough)."""
    proc, _ = runs["debug"]
    assert proc.returncode == 0, proc.stderr
    assert "distributed debug level DETAIL, NCCL_DEBUG=INFO" in proc.stdout


def test_cli_fsdp_settings_under_ddp_are_named_as_ignored(runs):
    """Not refused (a config written for FSDP may be rerun as DDP), but said; activation
    checkpointing is honoured by DDP, so it is not in the list."""
    proc, _ = runs["fsdp_knobs_under_ddp"]
    assert proc.returncode == 0, proc.stderr
    assert ("with --strategy ddp these FSDP settings have no effect: --sharding-strategy SHARD_GRAD_OP, "
            "--limit-all-gathers False\n") in proc.stdout


def test_cli_unknown_flag(runs):
    line = error_line(runs["unknown_flag"][0])
    assert "--no-such-flag" in line


def test_cli_unknown_enum_value(runs):
    line = error_line(runs["unknown_enum"][0])
    assert "--sharding-strategy" in line and "FOO" in line
    for valid in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"):
        assert valid in line


def test_cli_global_batch_not_divisible(runs):
    line = error_line(runs["indivisible_batch"][0])
    assert "--global-batch 10" in line and "micro-batch 4" in line and "multiple of 4" in line


def test_cli_missing_dataset(runs):
    proc, d = runs["missing_data"]
    line = error_line(proc)
    assert "/nonexistent/corpus.txt" in line and "no such file" in line and "synthetic" in line
    assert not (d / "run").exists()


def test_cli_empty_corpus(runs):
    proc, d = runs["empty_corpus"]
    line = error_line(proc)
    assert str(d / "empty.txt") in line and "empty" in line
    assert not (d / "run").exists()


def test_cli_seq_len_longer_than_corpus(runs):
    line = error_line(runs["seq_len_train"][0])
    assert "--seq-len 100000" in line and "smaller --seq-len" in line


def test_cli_seq_len_longer_than_validation_stream(runs):
    proc, d = runs["seq_len_val"]
    line = error_line(proc)
    assert "validation" in line and "--seq-len 1000" in line and "--val-fraction" in line
    assert not (d / "run").exists()


def test_cli_run_dir_already_holds_a_run(runs):
    proc, d = runs["run_dir_taken"]
    line = error_line(proc)
    assert str(d / "run") in line and "--overwrite" in line
    assert (d / "run" / "config.json").read_text() == '{"previous": "run"}\n'
    assert (d / "run" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert sorted(p.name for p in (d / "run").iterdir()) == ["config.json", "metrics.jsonl"]


def test_cli_bad_hybrid_shard_size(runs):
    line = error_line(runs["hybrid_bad"][0])
    assert "--hybrid-shard-size 3" in line and "world size 1" in line


def test_cli_bad_hybrid_shard_size_leaves_no_run_behind(runs):
    proc, d = runs["hybrid_bad"]
    assert proc.returncode == 2
    assert not (d / "run" / "config.json").exists()


def test_cli_out_dir_is_a_file(runs):
    proc, d = runs["out_dir_is_file"]
    line = error_line(proc)
    assert str(d / "f") in line
    assert (d / "f").read_text() == "x"


def check_run_dir(run_dir, expected_cfg, steps):
    config = json.loads((run_dir / "config.json").read_text())
    assert isinstance(config, dict)
    assert config == dataclasses.asdict(expected_cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [steps]
    assert all(isinstance(r["loss"], float) and r["loss"] > 0 for r in train)
    assert any("val_loss" in r for r in records)
    assert (run_dir / "training_log.txt").read_text().strip()
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{steps:07d}"
    payload = torch.load(run_dir / "checkpoints" / latest / "model.pt", weights_only=True)
    assert payload["step"] == steps and payload["config"] == config
    model = model_lib.build_model(model_lib.ModelConfig(**payload["config"]["model"]))
    model.load_state_dict(payload["model"])  # strict: every key and shape matches
    return config


def resolved(argv, vocab_size=32):
    """The config the CLI should save: parsed, checked, then resolved for one process (derived fields
    filled, vocab from the data)."""
    cfg = parse_config([str(a) for a in argv])
    check_config(cfg)
    topo = T.Topology(rank=0, world=1, local_world=1, device=torch.device("cpu"), backend="gloo")
    T.resolve_config(cfg, topo, types.SimpleNamespace(vocab_size=vocab_size))
    cfg.train.lr_decay_steps = cfg.train.lr_decay_steps or cfg.train.max_steps  # a new run's cosine (prepare_run_dir)
    return cfg


def test_cli_tiny_run_succeeds(runs):
    proc, d = runs["ok"]
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr
    config = check_run_dir(d / "ok", resolved([*TINY, "--out-dir", d / "ok"]), steps=2)
    assert config["train"]["max_steps"] == 2
    assert config["model"]["vocab_size"] == 32  # resolved from the synthetic data
    assert config["model"]["n_kv_head"] == 2 and config["model"]["ffn_hidden"] == 128  # derived fields


def test_cli_overwrite_replaces_the_run(runs, tmp_path):
    run_dir = tmp_path / "ok"
    shutil.copytree(runs["ok"][1] / "ok", run_dir)
    argv = [*TINY, "--max-steps", "1", "--seed", "3", "--out-dir", run_dir, "--overwrite"]
    proc = run_cli(argv)
    assert proc.returncode == 0, proc.stderr
    config = check_run_dir(run_dir, resolved(argv), steps=1)  # old metrics are gone, not appended to
    assert config["train"]["overwrite"] is True and config["train"]["seed"] == 3


def test_cli_config_file_sets_fields_in_a_real_run(runs):
    proc, d = runs["config_file"]
    assert proc.returncode == 0, proc.stderr
    argv = ["--config", d / "run.toml", "--lr", "0.002", "--out-dir", d / "run"]
    config = check_run_dir(d / "run", resolved(argv), steps=1)
    assert config["model"]["arch"] == "baseline" and config["model"]["n_layer"] == 2  # from the file
    assert config["fsdp"]["param_dtype"] == "fp32" and config["train"]["seed"] == 7  # from the file
    assert config["train"]["strategy"] == "ddp"  # from the preset named in the file
    assert config["train"]["lr"] == 0.002  # command line beats the file's 0.005
    assert "strategy ddp" in (d / "run" / "training_log.txt").read_text()
