"""Hostile input and faults of the machine, as they really happen, on the token-cache build and on
the trainer's companions: token files of the wrong width, linked subdirectories, a byte order mark,
a corrupt Parquet row group, an unreadable shard, a TOML file that is not UTF-8, a killed worker, a
killed build, a full disk, a foreign package named like a companion, a compile cache that cannot be
written. Each is one `error:` line (exit 2 for bad input, 1 for the machine's fault), nothing
half-written, no process left behind.

What needs privileges is real, not imitated: a permission denied to root comes from running the
command without CAP_DAC_OVERRIDE (setpriv), a full disk from a small tmpfs mount; a test whose tool or
privilege the machine lacks skips and says why."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import script_runner  # noqa: E402

import data  # noqa: E402
from test_data import english, raises_one_line, text_cfg  # noqa: E402
from test_distributed import TINY, clean_env  # noqa: E402

# Runs a command as root without the capabilities that let root read and write any file.
NO_DAC = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


def one_error_line(res, code):
    """The one stderr line of a command that failed with `code`, checked to be alone."""
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    return lines[0]


def data_py(args, env=None, cwd=ROOT):
    return script_runner.run("data.py", [str(a) for a in args], cwd, env or clean_env())


def without_dac(script, args, cwd=ROOT):
    """python SCRIPT ARGS as root without CAP_DAC_OVERRIDE: file modes apply to it."""
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
    return subprocess.run([*NO_DAC, sys.executable, script, *map(str, args)], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs mounted in tmp_path: a disk that really fills."""
    mount = tmp_path / "disk"
    mount.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True,
                         text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}): the full-disk tests need root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A small BPE tokenizer, given to the builds below so that they only tokenise."""
    tmp = tmp_path_factory.mktemp("tok")
    (tmp / "t.txt").write_text(english(2000, seed=3))
    cfg = text_cfg(tmp, tmp / "t.txt")
    data.prepare_data(cfg)
    return data.open_dataset(cfg, 0).tokenizer_path


def big_corpus(path: Path, mb: int) -> Path:
    """About `mb` MB of text, in parts of data.PART_BYTES: a build that takes seconds a part."""
    block = english(2000, seed=1)
    with open(path, "w") as f:
        while f.tell() < mb << 20:
            f.write(block)
    return path


# --- token files --------------------------------------------------------------------------------


def test_a_vocabulary_that_does_not_fit_uint16_is_refused(tmp_path):
    """50,000 uint32 ids with --tokenizer-vocab-size 128256 and --token-dtype left at uint16: read as
    uint16 every second id would be 0 or 1, and no uint16 reaches the vocabulary, so the id check
    could never fire. Refused; with --token-dtype uint32 the same file is read."""
    ids = np.random.default_rng(0).integers(0, 128256, 50_000, dtype=np.uint32)
    ids.tofile(tmp_path / "llama.bin")
    args = ["--dataset", tmp_path / "llama.bin", "--tokenizer-vocab-size", "128256", "--seq-len", "64",
            "--cache-dir", tmp_path / "cache"]
    line = one_error_line(data_py(args), 2)
    assert "128,256 tokens does not fit --token-dtype uint16" in line and "--token-dtype uint32" in line, line
    assert not (tmp_path / "cache").exists()
    assert data_py(args + ["--token-dtype", "uint32"]).returncode == 0


def test_uint32_ids_read_as_uint16_are_refused(tmp_path):
    """Ids below 65,536 written as uint32 make every second uint16 a zero: a vocabulary that fits
    cannot catch them, the layout does."""
    np.random.default_rng(0).integers(1, 4096, 50_000, dtype=np.uint32).tofile(tmp_path / "ids.bin")
    cfg = text_cfg(tmp_path, tmp_path / "ids.bin", tokenizer_vocab_size=4096)
    raises_one_line(r"ids\.bin looks like uint32 token ids read as uint16 .*pass --token-dtype uint32",
                    data.prepare_data, cfg)
    assert not (tmp_path / "cache").exists()
    np.random.default_rng(0).integers(1, 4096, 100_000, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    data.prepare_data(cfg)  # real uint16 ids pass


# --- text -----------------------------------------------------------------------------------------


def test_a_linked_subdirectory_is_read_and_a_link_loop_ends(tmp_path):
    """corpus/a.txt and corpus/more -> ../elsewhere holding b.txt: both files are the corpus (Path.rglob
    skipped the link); corpus/loop -> corpus, a link to itself, reads nothing twice."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(english(50, seed=1))
    (tmp_path / "elsewhere" / "b.txt").write_text(english(50, seed=2))
    (tmp_path / "corpus" / "more").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "corpus" / "loop").symlink_to(tmp_path / "corpus")
    found = data.list_sources(str(tmp_path / "corpus"), "--dataset")
    assert found == [tmp_path / "corpus" / "a.txt", tmp_path / "elsewhere" / "b.txt"]


def test_a_jsonl_with_a_byte_order_mark_is_read_as_without(tmp_path):
    """A .jsonl saved with a UTF-8 BOM: its first line is JSON after the mark, and the tokens are
    those of the same file without it."""
    lines = "".join(json.dumps({"text": english(3, seed=i)}) + "\n" for i in range(40))
    (tmp_path / "bom").mkdir()
    (tmp_path / "plain").mkdir()
    (tmp_path / "bom" / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    (tmp_path / "plain" / "d.jsonl").write_text(lines)
    tokens = []
    for name in ("bom", "plain"):
        cfg = text_cfg(tmp_path / name, tmp_path / name / "d.jsonl", tokenizer_type="char")
        data.prepare_data(cfg)
        ds = data.open_dataset(cfg, 0)
        tokens.append(np.concatenate([ds.train_tokens, ds.val_tokens]).tolist())
    assert tokens[0] == tokens[1]


def corrupt_second_row_group(path: Path) -> Path:
    """Two row groups of text; the second one's pages overwritten with garbage, the footer intact."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": [english(30, seed=i) for i in range(8)]}), path, row_group_size=4)
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start)
        f.write((bytes(range(7, 250, 3)) * column.total_compressed_size)[:column.total_compressed_size])
    assert pq.ParquetFile(path).metadata.num_row_groups == 2  # the footer still reads
    return path


@pytest.mark.parametrize("train", [True, False], ids=["training a tokenizer", "given a tokenizer"])
def test_a_corrupt_row_group_is_named_by_file_and_group(tmp_path, tokenizer, train):
    """The footer reads, the second row group does not: python data.py and the trainer say which
    shard and row group, in one line, whether the tokenizer is trained on it or given (it blamed
    the tokenizer, or printed a traceback)."""
    shards = tmp_path / "shards"
    shards.mkdir()
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pytest.importorskip("pyarrow").table({"text": [english(30, seed=9)] * 4}), shards / "a.parquet")
    corrupt_second_row_group(shards / "b.parquet")
    flags = ["--dataset", shards, "--cache-dir", tmp_path / "cache", "--seq-len", "32"]
    flags += ["--tokenizer-vocab-size", "400"] if train else ["--tokenizer", tokenizer]
    line = one_error_line(data_py(flags), 2)
    assert f"{shards / 'b.parquet'} row group 1: cannot be read" in line, line
    run = script_runner.run("train_fsdp.py", [*TINY, "--strategy", "none", *map(str, flags),
                                              "--out-dir", str(tmp_path / "run")], ROOT, clean_env())
    assert one_error_line(run, 2).startswith(f"error: {shards / 'b.parquet'} row group 1: cannot be read")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    assert not (tmp_path / "run").exists()


def test_an_unreadable_shard_is_one_line(tmp_path, tokenizer):
    """A shard its reader may not read (mode 000, as root without CAP_DAC_OVERRIDE): one line naming
    it, exit 2, nothing written."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(english(50, seed=1))
    (tmp_path / "corpus" / "b.txt").write_text(english(50, seed=2))
    (tmp_path / "corpus" / "b.txt").chmod(0)
    res = without_dac("data.py", ["--dataset", tmp_path / "corpus", "--tokenizer", tokenizer,
                                  "--cache-dir", tmp_path / "cache", "--seq-len", "32"])
    line = one_error_line(res, 2)
    assert f"{tmp_path / 'corpus' / 'b.txt'}: Permission denied" in line, line
    assert not (tmp_path / "cache").exists()


def test_a_toml_that_is_not_utf8_is_one_line(tmp_path):
    (tmp_path / "c.toml").write_bytes(b"[data]\ndataset = \"caf\xe9.txt\"\n")
    line = one_error_line(data_py(["--config", tmp_path / "c.toml"]), 2)
    assert "c.toml: not valid TOML, TOML files are UTF-8" in line, line


# --- processes ------------------------------------------------------------------------------------


def children(pid):
    """The pids whose parent is pid (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def wait_for(what, deadline_s=120):
    """Polls what() until it returns something true (a condition on other processes, never a
    time taken for one); fails after deadline_s."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = what()
        if found:
            return found
        time.sleep(0.02)
    pytest.fail(f"timed out after {deadline_s} s waiting for {what.__doc__ or what}")


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_build(tmp_path, tokenizer):
    """python data.py on a corpus of several 8 MB parts, 2 workers; returns (process, its workers):
    the build's process, the fork server below it, and the workers the server forked."""
    corpus = big_corpus(tmp_path / "big.txt", 40)
    proc = subprocess.Popen([sys.executable, "data.py", "--dataset", str(corpus), "--tokenizer", tokenizer,
                             "--cache-dir", str(tmp_path / "cache"), "--data-workers", "2"],
                            cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def workers():
        """a worker of the build"""
        return [w for server in children(proc.pid) for w in children(server)]
    return proc, wait_for(workers)


def test_a_killed_worker_is_one_line_and_leaves_nothing(tmp_path, tokenizer):
    """One worker killed mid-build, as the OOM killer does: one line that says a worker died and what
    to lower, exit 1; no process and no half-built cache left."""
    proc, workers = start_build(tmp_path, tokenizer)
    server = children(proc.pid)
    os.kill(workers[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    assert err.strip().splitlines() == ["error: a data worker process died (killed, most likely for want of "
                                        "memory); lower --data-workers (it was 2)"], err[-3000:]
    wait_for(lambda: not any(alive(p) for p in server + workers))
    assert not [p for p in (tmp_path / "cache").glob("*")]


def test_a_killed_build_leaves_no_worker(tmp_path, tokenizer):
    """kill -9 of python data.py: its fork server and workers end with it (they slept on forever,
    320 MB each, reparented to init)."""
    proc, workers = start_build(tmp_path, tokenizer)
    server = children(proc.pid)
    proc.kill()
    proc.communicate(timeout=60)
    wait_for(lambda: not any(alive(p) for p in server + workers))


def test_a_full_disk_is_one_line_naming_it(tmp_path, tokenizer, small_disk):
    """--cache-dir on a 2 MB disk and 8 MB to tokenise: numpy's 'N requested and M written' became
    one line that says the disk is full and where, exit 1 (the machine's fault), under python
    data.py and the trainer; the disk is left empty."""
    corpus = big_corpus(tmp_path / "big.txt", 8)
    flags = ["--dataset", corpus, "--tokenizer", tokenizer, "--cache-dir", small_disk / "cache", "--seq-len", "32"]
    line = one_error_line(data_py(flags), 1)
    assert line.startswith(f"error: No space left on device: the disk of {small_disk / 'cache'} is full"), line
    run = script_runner.run("train_fsdp.py", [*TINY, "--strategy", "none", *map(str, flags),
                                              "--out-dir", str(tmp_path / "run")], ROOT, clean_env())
    assert one_error_line(run, 1).startswith(f"error: No space left on device: the disk of {small_disk / 'cache'}")
    assert list(small_disk.iterdir()) == []  # not even the cache directory it made
    assert not (tmp_path / "run").exists()


# --- the trainer's companions and compile cache ---------------------------------------------------


@pytest.mark.parametrize("flags, module", [(["--optimizer", "muon"], "muon"), (["--tensorboard"], "trackers")])
def test_a_foreign_package_named_like_a_companion_is_refused(tmp_path, flags, module):
    """The trainer copied without muon.py (or trackers.py), a public package of that name installed:
    refused in one line naming it, before anything is written (it ended in a TypeError, with a
    run.lock and an empty metrics.jsonl left)."""
    repo, site = tmp_path / "repo", tmp_path / "site"
    repo.mkdir()
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text("class Muon:\n    pass\n\n\nclass Trackers:\n    pass\n")
    for name in ("train_fsdp.py", "model.py", "data.py"):
        shutil.copy(ROOT / name, repo)
    res = script_runner.run("train_fsdp.py", [*TINY, "--strategy", "none", *flags, "--out-dir", str(tmp_path / "run")],
                            repo, dict(clean_env(), PYTHONPATH=str(site)))
    line = one_error_line(res, 2)
    assert line == (f"error: {' '.join(flags)} needs this project's {module}.py beside train_fsdp.py, not "
                    f"{site / module / '__init__.py'} (another package of that name): copy it from this project")
    assert not (tmp_path / "run").exists()


def test_a_compile_cache_that_cannot_be_written_is_one_line(tmp_path):
    """--compile-cache on an existing directory its run may not write (mode 555, as root without
    CAP_DAC_OVERRIDE): one line before the run directory exists (it passed, and the first compile
    ended in a 93-line traceback)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o555)
    res = without_dac("train_fsdp.py", [*TINY, "--strategy", "none", "--compile", "--compile-cache", cache,
                                        "--out-dir", tmp_path / "run"])
    line = one_error_line(res, 2)
    assert line.startswith(f"error: compile cache {cache}: Permission denied"), line
    assert not (tmp_path / "run").exists()
