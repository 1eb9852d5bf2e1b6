"""The formats researchers bring beside .txt and .jsonl: Parquet shards with a "text" column, and
token files written elsewhere (nanoGPT's flat train.bin / val.bin). Each bad input is one line
that names the file and what is valid, with nothing written."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import script_runner  # noqa: E402

import data  # noqa: E402
from test_data import english, raises_one_line, text_cfg  # noqa: E402
from test_distributed import clean_env  # noqa: E402


def parquet(path: Path, **columns):
    """A Parquet file of these columns, 4 rows a row group (pyarrow is optional: the tests of token
    files run without it)."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), path, row_group_size=4)
    return path


def test_parquet_rows_are_documents_joined_with_eos(tmp_path):
    docs = [english(5, seed=i) for i in range(10)]
    path = parquet(tmp_path / "docs.parquet", id=list(range(10)), text=docs)
    cfg = text_cfg(tmp_path, path, val_fraction=0.2)
    data.prepare_data(cfg)
    ds = data.open_dataset(cfg, seed=0)
    expected = []
    for i, doc in enumerate(docs):
        expected += ([ds.sp.eos_id()] if i else []) + ds.encode(doc)
    assert np.concatenate([ds.train_tokens, ds.val_tokens]).tolist() == expected


def test_a_directory_of_shards_is_one_stream_in_name_order(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    parquet(shards / "b.parquet", text=[english(20, seed=2)])
    parquet(shards / "a.parquet", text=[english(20, seed=1)])
    cfg = text_cfg(tmp_path, shards, val_fraction=0.2)
    data.prepare_data(cfg)
    manifest = json.loads((data.cache_dir_for(cfg) / "manifest.json").read_text())
    assert [Path(f["path"]).name for f in manifest["inputs"]["train"]] == ["a.parquet", "b.parquet"]


def test_a_directory_of_two_kinds_is_refused(tmp_path):
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "x"}\n')
    parquet(tmp_path / "mixed" / "b.parquet", text=["y"])
    raises_one_line(r"mixed: the directory holds \.jsonl and \.parquet files; keep one kind in it",
                    data.prepare_data, text_cfg(tmp_path, tmp_path / "mixed"))


@pytest.mark.parametrize("case, message", [
    ("no text column", r'no\.parquet: no "text" column \(it has body\); the text must be in "text"'),
    ("numbers", r'no\.parquet: column "text" holds int64, not strings'),
    ("null", r'no\.parquet row 5: "text" is null; every row needs a string'),
    ("empty shard", r"no\.parquet: the shard is empty \(no rows\); remove it or write it again"),
    ("corrupt", r"no\.parquet: not a readable Parquet file \("),
])
def test_bad_parquet_is_one_line_and_writes_nothing(tmp_path, case, message):
    path = tmp_path / "no.parquet"
    if case == "no text column":
        parquet(path, body=["a", "b"])
    elif case == "numbers":
        parquet(path, text=[1, 2])
    elif case == "null":
        parquet(path, text=[english(3, seed=i) for i in range(5)] + [None, "z"])
    elif case == "empty shard":
        pa = pytest.importorskip("pyarrow")
        parquet(path, text=pa.array([], pa.string()))
    else:
        parquet(path, text=[english(30)])
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    raises_one_line(message, data.prepare_data, text_cfg(tmp_path, path))
    assert not (tmp_path / "cache").exists()


def test_parquet_without_pyarrow_names_what_to_install(tmp_path, monkeypatch):
    path = parquet(tmp_path / "docs.parquet", text=["a"])
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    raises_one_line(r"docs\.parquet: reading Parquet needs pyarrow, which is not installed: pip install pyarrow",
                    data.prepare_data, text_cfg(tmp_path, path))


# --- token files ---------------------------------------------------------------------------------------------


def token_file(path: Path, n: int, vocab: int, dtype=np.uint16, seed=0) -> np.ndarray:
    tokens = np.random.default_rng(seed).integers(0, vocab, n).astype(dtype)
    tokens.tofile(path)
    return tokens


def test_nanogpt_token_files_are_read_where_they_are(tmp_path):
    """A directory with train.bin and val.bin (nanoGPT's layout): rows come from those files,
    memory-mapped, nothing copied."""
    d = tmp_path / "owt"
    d.mkdir()
    train, val = token_file(d / "train.bin", 5000, 50257), token_file(d / "val.bin", 700, 50257, seed=1)
    cfg = text_cfg(tmp_path, d, tokenizer_vocab_size=50304)
    data.prepare_data(cfg)
    assert sorted(p.name for p in data.cache_dir_for(cfg).iterdir()) == ["manifest.json"]
    ds = data.open_dataset(cfg, seed=0)
    assert ds.vocab_size == 50304 and ds.tokenizer_path == "" and ds.sp is None
    assert Path(ds.train_tokens.filename) == (d / "train.bin").resolve()
    assert ds.train_tokens.tolist() == train.tolist() and ds.val_tokens.tolist() == val.tolist()
    x, y = ds.train_batch(3, 4, 0, 4)
    assert x.shape == (4, 32) and int(x.max()) < 50257
    assert sorted(ds.digests) == sorted(f"{kind} {(d / f).resolve()}" for kind, f in
                                        (("corpus", "train.bin"), ("validation corpus", "val.bin")))


def test_one_uint32_token_file_holds_out_its_tail(tmp_path):
    train = token_file(tmp_path / "tokens.bin", 3000, 100_000, np.uint32)
    cfg = text_cfg(tmp_path, tmp_path / "tokens.bin", tokenizer_vocab_size=100_000, token_dtype="uint32",
                   val_fraction=0.1)
    data.prepare_data(cfg)
    ds = data.open_dataset(cfg, seed=0)
    assert ds.train_tokens.dtype == np.uint32
    assert ds.train_tokens.tolist() == train[:2700].tolist() and ds.val_tokens.tolist() == train[2700:].tolist()


@pytest.mark.parametrize("case, message", [
    ("id too large", r"tokens\.bin: token id \d+ is not below the vocabulary size 1000; give the "
                     r"--tokenizer-vocab-size \(or --tokenizer\) of the tokenizer that wrote it"),
    ("odd size", r"tokens\.bin: 2001 bytes is not a whole number of uint16 tokens; check --token-dtype"),
    ("mixed", r"token files \(\.bin\) and text cannot be mixed"),
])
def test_bad_token_files_are_one_line_and_write_nothing(tmp_path, case, message, monkeypatch):
    monkeypatch.setattr(data, "PART_BYTES", 256)  # the check runs over many parts: the bad id is in one
    path = tmp_path / "tokens.bin"
    tokens = token_file(path, 1000, 1000)
    extra = {}
    if case == "id too large":
        tokens[700] = 1000
        tokens.tofile(path)
    elif case == "odd size":
        path.write_bytes(path.read_bytes() + b"\0")
    else:
        (tmp_path / "val.txt").write_text(english(20))
        extra["val_path"] = str(tmp_path / "val.txt")
    raises_one_line(message, data.prepare_data, text_cfg(tmp_path, path, tokenizer_vocab_size=1000, **extra))
    assert not (tmp_path / "cache").exists()


def test_a_run_trains_on_token_files_and_sample_py_says_their_ids_have_no_text(tmp_path):
    d = tmp_path / "owt"
    d.mkdir()
    token_file(d / "train.bin", 4000, 500)
    token_file(d / "val.bin", 500, 500, seed=1)
    run = tmp_path / "run"
    args = ["--dataset", d, "--tokenizer-vocab-size", "512", "--seq-len", "16", "--cache-dir", tmp_path / "cache",
            "--strategy", "none", "--arch", "baseline", "--n-layer", "1", "--d-model", "16", "--n-head", "2",
            "--max-steps", "2", "--global-batch", "4", "--eval-every", "0", "--out-dir", run]
    res = script_runner.run(ROOT / "train_fsdp.py", args, ROOT, clean_env())
    assert res.returncode == 0, res.stderr[-3000:]
    res = script_runner.run(ROOT / "sample.py", ["--ckpt", run], ROOT, clean_env())
    assert res.returncode == 2 and res.stderr.startswith(f"error: the run's data ({d.resolve()}) came without a")
