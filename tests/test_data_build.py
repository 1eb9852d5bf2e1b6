"""The token cache built on several processes: the same bytes as the serial build it replaced, for
corpora whose documents and lines straddle the parts the processes take; `python data.py` builds
the cache a run would; and ranks wait for a build longer than the collective timeout."""
import json
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import script_runner  # noqa: E402

import data  # noqa: E402
from test_data import english, text_cfg  # noqa: E402
from test_distributed import clean_env, run_ranks  # noqa: E402


def parquet():
    """pyarrow's parquet module: optional, as it is for users (the tests without Parquet run without it)."""
    return pytest.importorskip("pyarrow.parquet")


def serial_documents(path: Path):
    """The documents of a file as the serial build read them (before the parallel one): a .txt file
    line by line in text mode, one document; a .jsonl line or a Parquet row, one document."""
    if path.suffix == ".parquet":
        for text in parquet().read_table(path).column("text").to_pylist():
            yield text.splitlines(keepends=True)
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        if path.suffix == ".txt":
            yield list(f)
            return
        for line in f:
            if line.strip():
                yield json.loads(line)["text"].splitlines(keepends=True)


def serial_stream(sp, paths) -> list[int]:
    """The serial build's token stream: each line encoded alone, documents joined by EOS."""
    ids, first = [], True
    for path in paths:
        for doc in serial_documents(path):
            ids += [] if first else [sp.eos_id()]
            first = False
            for line in doc:
                ids += sp.encode(line)
    return ids


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A BPE tokenizer trained by the project (EOS, "\\n" a piece) on a corpus unlike the test corpora."""
    root = tmp_path_factory.mktemp("tok")
    (root / "t.txt").write_text(english(600, seed=99) + "ünïcødé 漢字\n")
    data.prepare_data(text_cfg(root, root / "t.txt"))
    return next((root / "cache").glob("*/tokenizer.model"))


def awkward_text(seed: int) -> bytes:
    """English with Windows and lone-CR line ends, invalid UTF-8, multi-byte characters and a long line."""
    rows = english(120, seed).encode().split(b"\n")
    rows[7] += b"\r"  # \r\n
    rows[11] += b"\rlone carriage return"
    rows[13] += b"\xe2\x82"  # a truncated UTF-8 sequence just before a line end
    rows[17] = b"\xff\xfe invalid bytes"
    rows[19] = "ünïcødé 漢字 ".encode() * 40
    return b"\n".join(rows)


def write_corpora(root: Path) -> dict:
    """{name: the --dataset path} of corpora in every format."""
    (root / "one.txt").write_bytes(awkward_text(1))
    shards = root / "books"
    shards.mkdir()
    (shards / "a.txt").write_bytes(awkward_text(2))
    (shards / "b.txt").write_text("")  # an empty document still costs a separator
    (shards / "c.txt").write_text(english(80, seed=3))
    docs = [english(n % 9, seed=n) for n in range(60)] + ["", "x\r\ny\u2028z"]
    lines = [json.dumps({"text": t}) + ("\n\n" if i % 5 == 0 else "\n") for i, t in enumerate(docs)]
    jsonl = root / "jsonl"
    jsonl.mkdir()
    (jsonl / "0.jsonl").write_text("".join(lines[:30]))
    (jsonl / "1.jsonl").write_text("".join(lines[30:]))
    shards = root / "parquet"
    shards.mkdir()
    pa, pq = pytest.importorskip("pyarrow"), parquet()
    for i in range(2):
        table = pa.table({"id": list(range(31)), "text": docs[31 * i:31 * i + 31]})
        pq.write_table(table, shards / f"{i}.parquet", row_group_size=7)  # 5 row groups a shard
    return {"txt": root / "one.txt", "txt directory": root / "books", "jsonl directory": jsonl,
            "parquet directory": shards}


@pytest.mark.parametrize("part_bytes", [64, 1000, 8 << 20])
def test_parallel_build_is_the_serial_stream(tmp_path, tokenizer, monkeypatch, part_bytes):
    """On 2 processes and parts of 64 bytes to 8 MB (the default: one part a file), every format's
    cache holds exactly the serial build's tokens, split at the same place."""
    monkeypatch.setattr(data, "PART_BYTES", part_bytes)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    for name, path in write_corpora(tmp_path).items():
        cfg = text_cfg(tmp_path, path, tokenizer=str(tokenizer), data_workers=2)
        data.prepare_data(cfg)
        ds = data.open_dataset(cfg, seed=0)
        expected = serial_stream(sp, data.list_sources(str(path), "--dataset"))
        n_val = max(1, int(np.ceil(len(expected) * 0.01)))
        assert ds.train_tokens.tolist() == expected[:-n_val], name
        assert ds.val_tokens.tolist() == expected[-n_val:], name
        if part_bytes == 64:
            assert all(len(data.parts_of(p)) > 1 for p in data.list_sources(str(path), "--dataset") if p.stat().st_size)


def test_a_trained_tokenizer_is_the_same_on_any_number_of_processes(tmp_path, monkeypatch):
    """The tokenizer's sample and the cache do not depend on --data-workers or the parts."""
    (tmp_path / "c.txt").write_bytes(awkward_text(5) + english(300, seed=6).encode())
    built = []
    for workers, part_bytes in ((1, 8 << 20), (2, 500)):
        monkeypatch.setattr(data, "PART_BYTES", part_bytes)
        cfg = text_cfg(tmp_path, tmp_path / "c.txt", data_workers=workers, cache_dir=str(tmp_path / f"c{workers}"))
        data.prepare_data(cfg)
        out = data.cache_dir_for(cfg)
        manifest = json.loads((out / "manifest.json").read_text())
        built.append([(out / "train.bin").read_bytes(), (out / "val.bin").read_bytes(), manifest["digests"]])
    assert built[0] == built[1]


def test_the_tokenizer_of_a_large_corpus_reads_a_sample_spread_over_it(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "PART_BYTES", 1000)
    monkeypatch.setattr(data, "TOKENIZER_SAMPLE_BYTES", 10_000)
    (tmp_path / "c.txt").write_text(english(2000, seed=8))
    parts = data.parts_of(tmp_path / "c.txt")
    sample = data.tokenizer_sample(parts)
    assert 5 <= len(sample) <= 10 and sample[0] == parts[0]
    assert sample[-1].lo > 0.8 * parts[-1].hi  # spread to the end, not the corpus's head
    read = []
    monkeypatch.setattr(data, "part_sentences", lambda part: read.append(part) or ["some text here"] * 50)
    with pytest.raises(data.DataError):  # 50 copies of one line make no tokenizer of 400 pieces
        data.train_tokenizer(text_cfg(tmp_path, tmp_path / "c.txt", data_workers=1), parts, tmp_path)
    assert read == sample


def test_memory_stays_flat_at_most_two_parts_per_worker_wait(monkeypatch):
    """in_order() keeps at most two results per worker waiting, however many parts there are."""
    waiting = []

    class Executor:
        def __init__(self, *args):
            self.pending = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, arg):
            self.pending += 1
            waiting.append(self.pending)
            pool = self

            class Future:
                def result(self):
                    pool.pending -= 1
                    return fn(arg)

                def cancel(self):
                    pool.pending -= 1
            return Future()

    monkeypatch.setattr(data.concurrent.futures, "ProcessPoolExecutor", Executor)
    assert list(data.in_order(lambda x: x * x, list(range(100)), 3)) == [x * x for x in range(100)]
    assert max(waiting) == 6


def test_a_worker_s_error_stops_the_build_at_once(tmp_path, monkeypatch):
    """A bad line found by one of 2 processes is the build's error; the processes end with it."""
    monkeypatch.setattr(data, "PART_BYTES", 200)
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": english(3, seed=i)}) for i in range(200)]
    lines[150] = '{"body": "no text"}'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(data.DataError, match=r"docs\.jsonl line 151: not a JSON object"):
        data.prepare_data(text_cfg(tmp_path, path, data_workers=2))
    assert not (tmp_path / "cache").exists()


def test_data_py_builds_the_cache_the_run_reads(tmp_path):
    """python data.py with the trainer's data flags (and its --config) builds the cache that the
    run then finds valid: the run tokenises nothing."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(english(300))
    (tmp_path / "run.toml").write_text('[data]\ntokenizer_vocab_size = 400\nseq_len = 16\n')
    flags = ["--dataset", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--data-workers", "2"]
    res = run_data_py(tmp_path, ["--config", "run.toml", *flags])
    assert res.returncode == 0, res.stderr
    assert "the token cache is ready in" in res.stdout and "step" not in res.stdout
    cfg = data.DataConfig(dataset=str(corpus), cache_dir=str(tmp_path / "cache"), tokenizer_vocab_size=400, seq_len=16)
    train_bin = data.cache_dir_for(cfg) / "train.bin"
    before = train_bin.stat().st_mtime_ns
    data.prepare_data(cfg)  # what the run does first: the cache is valid as it is
    assert train_bin.stat().st_mtime_ns == before and data.open_dataset(cfg, 0).vocab_size == 400


@pytest.mark.parametrize("args, message", [
    (["--dataset", "nope.txt"], "--dataset nope.txt: no such file or directory"),
    (["--dataset", "c.txt", "--data-workers", "-1"], "--data-workers -1: must be at least 1, or 0 for every core"),
    (["--config", "bad.toml", "--dataset", "c.txt"], "--config bad.toml: [data] has no setting 'vocab'; valid: "),
    (["--dataset", "c.txt", "--data-workers", "x"], "argument --data-workers: invalid int value: 'x'"),
])
def test_data_py_bad_input_is_one_error_line_and_writes_nothing(tmp_path, args, message):
    (tmp_path / "c.txt").write_text(english(50))
    (tmp_path / "bad.toml").write_text("[data]\nvocab = 3\n")
    res = run_data_py(tmp_path, [*args, "--cache-dir", str(tmp_path / "cache")])
    assert res.returncode == 2 and res.stderr.startswith(f"error: {message}")
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "cache").exists()


def run_data_py(cwd, args):
    return script_runner.run(ROOT / "data.py", args, cwd, clean_env())


SLOW_BUILD = """
import datetime, sys, time
sys.path.insert(0, {root!r})
import data, train_fsdp
train_fsdp.COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=2)
build = data.prepare_data
def slow(cfg):
    time.sleep(7)  # the build: longer than three collective timeouts
    build(cfg)
data.prepare_data = slow
train_fsdp.run(sys.argv[1:])
"""


def test_ranks_wait_for_a_build_longer_than_the_collective_timeout(tmp_path):
    """With a 2-second collective timeout, rank 1 waits 7 seconds for rank 0's build: rank 0 says
    every 0.2 s that it is at work, so the run starts and trains. Rank 1 says once what it waits for."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(english(300))
    args = ["--dataset", str(corpus), "--tokenizer-vocab-size", "400", "--seq-len", "16", "--cache-dir",
            str(tmp_path / "cache"), "--arch", "baseline", "--n-layer", "1", "--d-model", "16", "--n-head", "2",
            "--max-steps", "2", "--global-batch", "4", "--eval-every", "0", "--log-every", "1",
            "--out-dir", str(tmp_path / "run")]
    ranks = run_ranks("-c", [SLOW_BUILD.format(root=str(ROOT)), *args], 2, timeout=120)
    for rank, res in enumerate(ranks):
        assert res.returncode == 0, f"rank {rank}: {res.stdout[-2000:]} {res.stderr[-3000:]}"
    assert ranks[1].stdout.count("rank 1: waiting for rank 0 (building the token cache), with no time limit") == 1
    steps = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in steps if "loss" in r] == [1, 2]


BROKEN_BUILD = SLOW_BUILD.replace("build(cfg)", "raise OSError(28, 'No space left on device', 'cache/train.bin')")


def test_a_build_that_dies_stops_every_rank_with_one_error_line(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(english(100))
    args = ["--dataset", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(tmp_path / "run")]
    ranks = run_ranks("-c", [BROKEN_BUILD.format(root=str(ROOT)), *args], 2, timeout=120)
    assert [res.returncode for res in ranks] == [2, 2]
    assert ranks[0].stderr.strip().splitlines()[-1] == "error: No space left on device: cache/train.bin"
    assert "Traceback" not in ranks[0].stderr + ranks[1].stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def parent_pid(_):
    return os.getppid()


def test_workers_are_not_forked_from_the_building_process():
    """The trainer builds the cache in a thread (rank0_does) while its main thread waits in a collective:
    a fork from that process copies locks other threads hold, which a child may then wait on forever.
    The workers are forked by a server process, single-threaded, never by the process that builds."""
    parents = []
    build = threading.Thread(target=lambda: parents.extend(data.in_order(parent_pid, list(range(4)), 2)))
    build.start()
    build.join()
    assert len(parents) == 4 and os.getpid() not in parents, parents
