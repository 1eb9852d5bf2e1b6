"""The data digests that a resumed run compares with its checkpoint's describe what the data is
(the corpus bytes, the tokenizer's pieces), not how a file happens to be written: a retrained
SentencePiece model records its staging directory (host, pid) and thread count, so the same
corpus gives a tokenizer file with other bytes and the same pieces."""
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402
from test_data import english, text_cfg  # noqa: E402


def digests(cfg):
    data.prepare_data(cfg)
    ds = data.open_dataset(cfg, seed=0)
    return ds.digests, Path(ds.tokenizer_path).read_bytes()


def touch(path):
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_a_touched_corpus_keeps_its_digests(tmp_path, corpus_file, kind, monkeypatch):
    """touch corpus.txt: the cache is rebuilt, here by another process, and the retrained
    tokenizer file differs; the digests do not."""
    cfg = text_cfg(tmp_path, corpus_file, tokenizer_type=kind, tokenizer_vocab_size=400 if kind == "bpe" else 100)
    before, model_before = digests(cfg)
    touch(corpus_file)
    monkeypatch.setattr(os, "getpid", lambda: 4242)  # the next build's staging directory
    after, model_after = digests(cfg)
    assert model_after != model_before  # the premise: the retrained file's bytes changed
    assert after == before


def test_a_deleted_cache_rebuilt_on_another_machine_keeps_its_digests(tmp_path, corpus_file, monkeypatch):
    cfg = text_cfg(tmp_path, corpus_file)
    before, model_before = digests(cfg)
    shutil.rmtree(tmp_path / "cache")
    cfg.data_workers = data.data_workers(cfg) + 3  # the tokenizer's threads, recorded in its file
    after, model_after = digests(cfg)
    assert model_after != model_before
    assert after == before


def test_a_touched_corpus_beyond_the_hashed_bytes_keeps_its_digests(tmp_path, corpus_file, monkeypatch):
    """A corpus too large to hash at every start is hashed when its cache is built, so its
    digest is its bytes, not its size and mtime."""
    monkeypatch.setattr(data, "HASH_LIMIT", 100)
    cfg = text_cfg(tmp_path, corpus_file)
    before, _ = digests(cfg)
    touch(corpus_file)
    assert digests(cfg)[0] == before


def test_a_changed_corpus_changes_its_digests(tmp_path, corpus_file):
    cfg = text_cfg(tmp_path, corpus_file, tokenizer_type="char", tokenizer_vocab_size=100)
    before, _ = digests(cfg)
    corpus_file.write_text(corpus_file.read_text().replace("the", "eee"))  # other counts: other ids
    after, _ = digests(cfg)
    assert set(after) == set(before)
    assert [k for k in before if after[k] != before[k]] == [f"corpus {corpus_file.resolve()}", "tokenizer"]


def test_the_tokenizer_digest_reads_pieces_scores_and_kinds(tmp_path, corpus_file):
    cfg = text_cfg(tmp_path, corpus_file)
    data.prepare_data(cfg)
    sp = data.open_dataset(cfg, seed=0).sp
    other_cfg = text_cfg(tmp_path, corpus_file, tokenizer_vocab_size=401)
    data.prepare_data(other_cfg)
    other = data.open_dataset(other_cfg, seed=0).sp
    assert data.tokenizer_digest(sp) == data.tokenizer_digest(sp)
    assert data.tokenizer_digest(sp) != data.tokenizer_digest(other)


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(english(400))
    return path
