import json
import os
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
from data import DataConfig, DataError, open_dataset, prepare_data  # noqa: E402

WORDS = ("the a of and to in is was that for on with as by at from his her it be are this which or had not but they "
         "have were one all their an been has there who would more when will no if out so said what up its about into "
         "than them can only other new some could time these two may then do first any my now such like our over man "
         "me even most made after also did many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see men work long get "
         "here between both life being under never day same another know while last might us great old year off come "
         "since against go came right used take three river mountain quickly silver garden letter window").split()


def english(n_lines: int, seed: int = 0) -> str:
    """Varied English-like text with punctuation, numbers, blank lines and the odd double space."""
    rnd = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rnd.choice(WORDS) for _ in range(rnd.randint(4, 16))]
        if rnd.random() < 0.2:
            words.insert(rnd.randrange(len(words)), str(rnd.randint(0, 2024)))
        line = " ".join(words).capitalize() + rnd.choice(".!?,;:")
        lines.append(line.replace(" ", "  ", 1) if rnd.random() < 0.1 else line)
        if rnd.random() < 0.1:
            lines.append("")
    return "\n".join(lines) + "\n"


def text_cfg(tmp_path, dataset, **kw):
    kw = {"tokenizer_vocab_size": 400, "seq_len": 32, "cache_dir": str(tmp_path / "cache"), **kw}
    return DataConfig(dataset=str(dataset), **kw)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(english(400))
    return path


def cache_dir(cfg):
    return data.cache_dir_for(cfg)


def full_rows(ds, n):
    """All n training rows of step 0 (a permutation of the training set), as (n, seq_len + 1)."""
    x, y = ds.train_batch(0, n, 0, n)
    return torch.cat([x[:, :1], y], dim=1)


def indexed_dataset(n_train, seed=0):
    # Row i starts with token 4 * i, so a row's identity can be read off x[:, 0].
    return data.Dataset(np.arange(4 * n_train), np.arange(8), seq_len=3, stride=4, vocab_size=4 * n_train, seed=seed)


def row_ids(x):
    return (x[:, 0] // 4).tolist()


# --- synthetic task -------------------------------------------------------------------------------------------------


def test_synthetic_rows_have_the_papers_format():
    ds = open_dataset(DataConfig(synthetic_train_samples=4096), seed=0)
    assert (ds.vocab_size, ds.seq_len, ds.n_train, ds.n_val, ds.tokenizer_path) == (32, 66, 4096, 1024, "")
    rows = full_rows(ds, ds.n_train)
    assert rows.shape == (4096, 67)
    noise = total = 0
    letters, starts = set(), set()
    for row in rows.tolist():
        text = ds.decode(row)
        assert text[0] == "\n" and text[2] == ">" and "A" <= text[1] <= "Z"
        body = text[3:]
        assert len(body) == 64 and set(body) <= {"_", "!", text[1]}
        hits = [i for i, c in enumerate(body) if c == text[1]]
        assert hits, "noise can hide at most a few letters of a block of 8"
        # Some start s in [0, 56] must put every letter inside [s, s + 8) with only '!' filling the gaps.
        fits = [s for s in range(57) if s <= hits[0] and hits[-1] < s + 8 and set(body[s:s + 8]) <= {"!", text[1]}]
        assert fits
        if len(fits) == 1:
            starts.add(fits[0])
        letters.add(text[1])
        noise += body.count("!")
        total += len(body)
    assert letters == set("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    assert 0 in starts and 56 in starts
    assert abs(noise / total - 1 / 16) < 0.004  # std of the rate over 262k positions is ~0.0005


def test_synthetic_x_y_are_the_row_shifted_by_one():
    ds = open_dataset(DataConfig(synthetic_train_samples=64), seed=0)
    x, y = ds.train_batch(0, 8, 0, 8)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 66)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert (x[:, 0] == 0).all() and (x[:, 2] == 1).all()  # "\n" then the letter then ">"


def test_synthetic_training_set_depends_on_seed_but_validation_does_not():
    cfg = DataConfig(synthetic_train_samples=512, synthetic_val_samples=256)
    a, b, c = open_dataset(cfg, seed=1), open_dataset(cfg, seed=1), open_dataset(cfg, seed=2)
    assert np.array_equal(a.train_tokens, b.train_tokens)
    assert not np.array_equal(a.train_tokens, c.train_tokens)
    assert torch.equal(a.val_batch(0, 256)[0], c.val_batch(0, 256)[0])
    assert torch.equal(a.train_batch(3, 16, 0, 16)[0], b.train_batch(3, 16, 0, 16)[0])


def test_synthetic_encode_decode_round_trip():
    ds = open_dataset(DataConfig(synthetic_train_samples=8), seed=0)
    text = "\nQ>___QQ!QQQQQ" + "_" * 51
    assert ds.decode(ds.encode(text)) == text
    assert ds.encode("\n>!_AZ") == [0, 1, 2, 3, 4, 29]
    with pytest.raises(DataError, match="not in the synthetic vocabulary"):
        ds.encode("hello")


def test_synthetic_prepare_is_a_no_op(tmp_path):
    prepare_data(DataConfig(cache_dir=str(tmp_path / "cache")))
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("seq_len", [0, 66])
def test_synthetic_accepts_its_own_seq_len(seq_len):
    assert open_dataset(DataConfig(seq_len=seq_len, synthetic_train_samples=8), seed=0).seq_len == 66


def test_synthetic_rejects_other_seq_len():
    with pytest.raises(DataError, match=r"--seq-len 100: the synthetic task's rows are 66 tokens; use 0 or 66"):
        open_dataset(DataConfig(seq_len=100), seed=0)


# --- batch order ----------------------------------------------------------------------------------------------------


def assert_rank_slices_make_the_global_batch(make, step, global_batch, keys):
    """At world sizes 1, 2 and 4, the ranks' slices of step `step` (each rank its own dataset from
    `make`) are disjoint (`keys(x)`: the rows' identities) and concatenate to the global batch."""
    whole = make().train_batch(step, global_batch, 0, global_batch)
    for world in (1, 2, 4):
        per_rank = global_batch // world
        slices = [make().train_batch(step, global_batch, r * per_rank, per_rank) for r in range(world)]
        flat = [k for x, _ in slices for k in keys(x)]
        assert len(set(flat)) == len(flat)  # disjoint across ranks
        assert torch.equal(torch.cat([x for x, _ in slices]), whole[0])
        assert torch.equal(torch.cat([y for _, y in slices]), whole[1])


@pytest.mark.parametrize("step", [0, 3, 7])
def test_rank_slices_union_equals_the_global_batch(step):
    assert_rank_slices_make_the_global_batch(lambda: indexed_dataset(50), step, 12, row_ids)


def test_step_addressing_matches_iterating():
    walked = indexed_dataset(30)
    batches = [walked.train_batch(step, 8, 0, 8)[0] for step in range(6)]
    jumped = indexed_dataset(30)
    assert torch.equal(jumped.train_batch(5, 8, 0, 8)[0], batches[5])
    assert torch.equal(jumped.train_batch(2, 8, 0, 8)[0], batches[2])


def test_epochs_cover_every_row_once_and_reshuffle():
    ds = indexed_dataset(10)
    assert ds.steps_per_epoch(4) == 3
    seen = [i for step in range(5) for i in row_ids(ds.train_batch(step, 4, 0, 4)[0])]  # step 2 straddles epochs
    first, second = seen[:10], seen[10:]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second
    assert first == np.random.default_rng([0, 0]).permutation(10).tolist()


def test_order_depends_on_seed():
    a = row_ids(indexed_dataset(100, seed=0).train_batch(0, 20, 0, 20)[0])
    b = row_ids(indexed_dataset(100, seed=1).train_batch(0, 20, 0, 20)[0])
    assert a != b


def test_slice_outside_global_batch_is_rejected():
    with pytest.raises(ValueError, match="outside the global batch"):
        indexed_dataset(10).train_batch(0, 4, 2, 4)


def test_val_batch_is_fixed_and_clipped():
    ds = open_dataset(DataConfig(synthetic_train_samples=8, synthetic_val_samples=10), seed=0)
    x, y = ds.val_batch(8, 5)
    assert x.shape == (2, 66)
    assert torch.equal(x, ds.val_batch(0, 10)[0][8:])
    assert ds.val_batch(10, 4)[0].shape == (0, 66)


# --- text windows shifted per epoch (issue 16) ----------------------------------------------------------------------


def text_dataset(n_tokens, seq_len=8, seed=0):
    # Token i is i, so a window's start offset is its first token, x[:, 0].
    return data.Dataset(np.arange(n_tokens), np.arange(seq_len + 1), seq_len, seq_len, n_tokens, seed,
                        shift_windows=True)


def offsets_per_epoch(ds, global_batch, steps):
    """{epoch: window start offsets in the order the run reads them}, walking steps 0..steps-1."""
    k = np.arange(steps * global_batch)
    epochs, _ = ds.epoch_of(k)
    starts = torch.cat([ds.train_batch(s, global_batch, 0, global_batch)[0][:, 0] for s in range(steps)]).tolist()
    out = {}
    for epoch, start in zip(epochs.tolist(), starts):
        out.setdefault(epoch, []).append(start)
    return out


def test_text_windows_shift_every_epoch_and_cover_each_shifted_layout_once():
    # 8-token windows over 84 tokens: 10 rows unshifted (the last ends at token 81), 9 once shifted.
    ds = text_dataset(84)
    assert (ds.n_train, ds.n_shifted, ds.max_shift) == (10, 9, 7)
    seen = offsets_per_epoch(ds, 4, 20)  # 80 rows: epoch 0, then 7 whole shifted epochs (and a bit)
    assert sorted(seen[0]) == list(range(0, 80, 8))  # epoch 0: the unshifted windows, every one once
    shifts = []
    for epoch in range(1, 8):
        shift = seen[epoch][0] % 8
        assert sorted(seen[epoch]) == [shift + 8 * j for j in range(9)], epoch  # every row once, one shift
        assert ds.epoch_shift(epoch) == shift and 1 <= shift <= 7
        shifts.append(shift)
    # Epochs 1-7 use each of the 7 possible shifts once: no two epochs see the same windows.
    assert sorted(shifts) == list(range(1, 8))
    assert shifts != list(range(1, 8))  # in a drawn order, not counting up
    # The windows really are what the token stream holds at those offsets.
    x, y = ds.train_batch(3, 4, 0, 4)
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(x, x[:, :1] + torch.arange(8))


def test_text_window_shifts_depend_on_the_seed():
    a = [text_dataset(1000, seq_len=64, seed=0).epoch_shift(e) for e in range(1, 9)]
    b = [text_dataset(1000, seq_len=64, seed=1).epoch_shift(e) for e in range(1, 9)]
    assert a != b and len(set(a)) == len(set(b)) == 8


@pytest.mark.parametrize("step", [1, 2, 5, 9])  # 2 and 5 straddle epoch boundaries (10 and 19 rows)
def test_shifted_windows_are_identical_for_any_world_size_and_disjoint_across_ranks(step):
    assert_rank_slices_make_the_global_batch(lambda: text_dataset(84), step, 4, lambda x: x[:, 0].tolist())


def test_shifted_windows_resume_exactly():
    """A resumed run builds a fresh Dataset and addresses its next step directly: it must read
    what the uninterrupted run read, in every epoch, with no state carried over."""
    walked = text_dataset(84, seed=5)
    batches = [walked.train_batch(step, 4, 0, 4)[0] for step in range(30)]
    for step in (29, 7, 2, 16, 0):
        assert torch.equal(text_dataset(84, seed=5).train_batch(step, 4, 0, 4)[0], batches[step]), step


def test_one_epoch_of_text_reads_the_unshifted_windows_as_before():
    """Epoch 0 is unshifted and ordered as before the shifts existed: a single-epoch run sees
    every window of the corpus once, in the same order."""
    shifted, plain = text_dataset(84, seed=3), text_dataset(84, seed=3)
    plain.n_shifted, plain.max_shift = plain.n_train, 0  # the layout without shifts
    for step in range(2):
        assert torch.equal(shifted.train_batch(step, 5, 0, 5)[0], plain.train_batch(step, 5, 0, 5)[0])
    first = shifted.train_batch(0, 10, 0, 10)[0][:, 0]
    assert (first // 8).tolist() == np.random.default_rng([3, 0]).permutation(10).tolist()


def test_a_corpus_of_one_window_shifts_by_what_is_left():
    assert (text_dataset(9).n_shifted, text_dataset(9).max_shift) == (1, 0)  # no token to spare: no shift
    ds = text_dataset(11)  # 2 tokens to spare
    assert (ds.n_train, ds.n_shifted, ds.max_shift) == (1, 1, 2)
    starts = [ds.train_batch(step, 1, 0, 1)[0][0, 0].item() for step in range(5)]
    assert starts[0] == 0 and sorted(starts[1:3]) == [1, 2] and sorted(starts[3:5]) == [1, 2]


def test_synthetic_and_random_rows_are_not_shifted():
    ds = open_dataset(DataConfig(synthetic_train_samples=16), seed=0)
    assert ds.max_shift == 0 and ds.n_shifted == ds.n_train
    x, _ = ds.train_batch(5, 8, 0, 8)  # epoch 2
    assert (x[:, 0] == data.NEWLINE).all() and (x[:, 2] == data.PROMPT_END).all()
    assert data.open_dataset(DataConfig(dataset="random", seq_len=16), seed=0).max_shift == 0


# --- text corpora ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bpe", "unigram", "char"])
def test_text_prepare_and_load(tmp_path, corpus, kind):
    cfg = text_cfg(tmp_path, corpus, tokenizer_type=kind)
    prepare_data(cfg)
    ds = open_dataset(cfg, seed=0)
    manifest = json.loads((cache_dir(cfg) / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and ds.train_tokens.dtype == np.uint16
    assert isinstance(ds.train_tokens, np.memmap)
    assert ds.vocab_size == 400 if kind != "char" else 30 < ds.vocab_size < 400
    assert ds.tokenizer_path == str(cache_dir(cfg) / "tokenizer.model")
    # The cached stream is exactly the corpus's encoding, split at the last 1%.
    text = corpus.read_text()
    stream = np.concatenate([ds.train_tokens, ds.val_tokens])
    assert stream.tolist() == ds.encode(text)
    assert len(ds.val_tokens) == int(np.ceil(len(stream) * 0.01))
    assert ds.decode(ds.encode(text)) == text  # newlines, double spaces and digits survive
    assert ds.n_train == (len(ds.train_tokens) - 1) // 32 and ds.n_val == (len(ds.val_tokens) - 1) // 32
    assert ds.max_shift == 31  # text windows shift per epoch (issue 16)
    x, y = ds.train_batch(0, 4, 0, 4)
    assert x.dtype == torch.int64 and x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Consecutive rows share one boundary token, nanoGPT-style.
    rows = ds.windows(ds.train_tokens, np.array([0, 32]))
    assert rows[1][0, -1] == rows[0][1, 0]
    assert rows[0][0].tolist() == ds.train_tokens[:32].tolist()


def test_cache_fast_path_does_not_retokenize(tmp_path, corpus, monkeypatch):
    cfg = text_cfg(tmp_path, corpus)
    prepare_data(cfg)
    train_bin = cache_dir(cfg) / "train.bin"
    before = train_bin.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("the cache was valid; nothing should be rebuilt")

    monkeypatch.setattr(data, "train_tokenizer", fail)
    monkeypatch.setattr(data, "write_tokens", fail)
    prepare_data(cfg)
    assert train_bin.stat().st_mtime_ns == before
    open_dataset(cfg, seed=0)


def test_changed_corpus_is_detected_and_rebuilt(tmp_path, corpus):
    cfg = text_cfg(tmp_path, corpus)
    prepare_data(cfg)
    n_before = open_dataset(cfg, seed=0).n_train
    corpus.write_text(corpus.read_text() + english(100, seed=1))
    with pytest.raises(DataError, match="no valid token cache.*run prepare_data"):
        open_dataset(cfg, seed=0)
    prepare_data(cfg)
    assert open_dataset(cfg, seed=0).n_train > n_before


def test_same_size_same_mtime_edit_is_caught_by_the_hash(tmp_path, corpus):
    cfg = text_cfg(tmp_path, corpus)
    prepare_data(cfg)
    st = corpus.stat()
    corpus.write_text(corpus.read_text().replace("the", "THE", 1))
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert corpus.stat().st_size == st.st_size
    prepare_data(cfg)
    ds = open_dataset(cfg, seed=0)
    assert np.concatenate([ds.train_tokens, ds.val_tokens]).tolist() == ds.encode(corpus.read_text())


def test_missing_bin_file_makes_cache_stale(tmp_path, corpus):
    cfg = text_cfg(tmp_path, corpus)
    prepare_data(cfg)
    (cache_dir(cfg) / "val.bin").unlink()
    with pytest.raises(DataError, match="no valid token cache"):
        open_dataset(cfg, seed=0)
    prepare_data(cfg)
    open_dataset(cfg, seed=0)


def test_load_without_prepare_raises_and_writes_nothing(tmp_path, corpus):
    cfg = text_cfg(tmp_path, corpus)
    with pytest.raises(DataError, match="no valid token cache"):
        open_dataset(cfg, seed=0)
    assert not (tmp_path / "cache").exists()


def test_jsonl_documents_are_joined_with_eos(tmp_path):
    docs = [english(30, seed=s) for s in range(5)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    cfg = text_cfg(tmp_path, path)
    prepare_data(cfg)
    ds = open_dataset(cfg, seed=0)
    stream = np.concatenate([ds.train_tokens, ds.val_tokens]).tolist()
    eos = ds.sp.eos_id()
    expected = []
    for i, d in enumerate(docs):
        expected += ([eos] if i else []) + ds.encode(d)
    assert stream == expected


def test_jsonl_line_without_text_is_rejected(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(obj) + "\n" for obj in [{"text": english(50)}, {"text": "ok"}, {"body": "x"}]))
    with pytest.raises(DataError, match=r"docs\.jsonl line 3: .*\"text\""):
        prepare_data(text_cfg(tmp_path, path))


def test_directory_of_txt_files(tmp_path):
    root = tmp_path / "books"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text(english(150, seed=1))
    (root / "a.txt").write_text(english(150, seed=2))
    (root / "sub" / "c.txt").write_text(english(150, seed=3))
    (root / "notes.md").write_text("not part of the corpus")
    cfg = text_cfg(tmp_path, root)
    prepare_data(cfg)
    ds = open_dataset(cfg, seed=0)
    manifest = json.loads((cache_dir(cfg) / "manifest.json").read_text())
    paths = [Path(f["path"]) for f in manifest["inputs"]["train"]]
    assert [p.relative_to(root.resolve()).as_posix() for p in paths] == ["a.txt", "b.txt", "sub/c.txt"]
    assert sorted(manifest["sha256"]) == sorted(map(str, paths))
    stream = np.concatenate([ds.train_tokens, ds.val_tokens]).tolist()
    assert stream.count(ds.sp.eos_id()) == 2


def test_separate_val_path(tmp_path, corpus):
    val = tmp_path / "val.txt"
    val.write_text(english(40, seed=7))
    cfg = text_cfg(tmp_path, corpus, val_path=str(val))
    prepare_data(cfg)
    ds = open_dataset(cfg, seed=0)
    assert ds.val_tokens.tolist() == ds.encode(val.read_text())
    assert ds.train_tokens.tolist() == ds.encode(corpus.read_text())


def test_existing_tokenizer_is_reused(tmp_path, corpus, monkeypatch):
    first = text_cfg(tmp_path, corpus, tokenizer_type="unigram")
    prepare_data(first)
    model = open_dataset(first, seed=0).tokenizer_path
    other = tmp_path / "other.txt"
    other.write_text(english(200, seed=9))
    monkeypatch.setattr(data, "train_tokenizer", lambda *a: pytest.fail("a given tokenizer must not be retrained"))
    cfg = text_cfg(tmp_path, other, tokenizer=model, tokenizer_vocab_size=123)
    prepare_data(cfg)
    ds = open_dataset(cfg, seed=0)
    assert ds.tokenizer_path == model and ds.vocab_size == 400
    assert ds.train_tokens.tolist() + ds.val_tokens.tolist() == ds.encode(other.read_text())


def test_text_seq_len_defaults_to_512(tmp_path, corpus):
    (tmp_path / "big.txt").write_text(english(3000))
    cfg = text_cfg(tmp_path, tmp_path / "big.txt", seq_len=0, tokenizer_type="char")
    prepare_data(cfg)
    assert open_dataset(cfg, seed=0).seq_len == 512


# --- input errors ---------------------------------------------------------------------------------------------------


def raises_one_line(match, fn, *args):
    with pytest.raises(DataError, match=match) as err:
        fn(*args)
    assert "\n" not in str(err.value)


def test_missing_dataset_path(tmp_path):
    raises_one_line(r"--dataset .*nope\.txt: no such file or directory; use 'synthetic', a \.txt, \.jsonl, "
                    r"\.parquet or \.bin file", prepare_data,
                    text_cfg(tmp_path, tmp_path / "nope.txt"))


def test_unsupported_extension(tmp_path):
    (tmp_path / "table.csv").write_text("a,b\n")
    cfg = text_cfg(tmp_path, tmp_path / "table.csv")
    raises_one_line(r"unsupported file extension '\.csv'; use 'synthetic', a \.txt, \.jsonl", prepare_data, cfg)


def test_directory_without_txt_files(tmp_path):
    (tmp_path / "empty").mkdir()
    raises_one_line(r"contains no \.txt, \.jsonl or \.parquet files", prepare_data,
                    text_cfg(tmp_path, tmp_path / "empty"))


def test_empty_corpus(tmp_path):
    (tmp_path / "blank.txt").write_text("\n  \n")
    cfg = text_cfg(tmp_path, tmp_path / "blank.txt")
    raises_one_line(r"--dataset .*blank\.txt: the corpus is empty", prepare_data, cfg)


def test_missing_val_path(tmp_path, corpus):
    cfg = text_cfg(tmp_path, corpus, val_path=str(tmp_path / "nope.txt"))
    raises_one_line(r"--val-path .*nope\.txt: no such file", prepare_data, cfg)


def test_validation_split_too_short(tmp_path, corpus):
    # found by prepare_data, before the cache is kept (tests/test_hostile.py: nothing is written)
    cfg = text_cfg(tmp_path, corpus, seq_len=512)
    raises_one_line(r"validation split has \d+ tokens, fewer than --seq-len 512 \+ 1; "
                    r"use a smaller --seq-len or a larger --val-fraction",
                    prepare_data, cfg)


def test_training_split_too_short(tmp_path):
    (tmp_path / "tiny.txt").write_text(english(300))
    cfg = text_cfg(tmp_path, tmp_path / "tiny.txt", seq_len=100000, val_fraction=0.5, tokenizer_type="char")
    raises_one_line(r"training split has \d+ tokens, fewer than --seq-len 100000 \+ 1", prepare_data, cfg)


def test_bad_tokenizer_type(tmp_path, corpus):
    raises_one_line(r"--tokenizer-type wordpiece: unknown; use one of bpe, unigram, char", prepare_data,
                    text_cfg(tmp_path, corpus, tokenizer_type="wordpiece"))


@pytest.mark.parametrize("fraction", [0.0, -0.1, 0.6])
def test_bad_val_fraction(tmp_path, corpus, fraction):
    raises_one_line(rf"--val-fraction {re.escape(str(fraction))}: must be in \(0, 0\.5\]", open_dataset,
                    text_cfg(tmp_path, corpus, val_fraction=fraction), 0)


def test_missing_tokenizer_file(tmp_path, corpus):
    cfg = text_cfg(tmp_path, corpus, tokenizer=str(tmp_path / "missing.model"))
    raises_one_line(r"--tokenizer .*missing\.model: no such file", prepare_data, cfg)


def test_vocab_size_too_large(tmp_path, corpus):
    raises_one_line(r"--tokenizer-vocab-size 50000 with --tokenizer-type bpe is too large for this corpus; "
                    r"use --tokenizer-vocab-size <= \d+",
                    prepare_data, text_cfg(tmp_path, corpus, tokenizer_vocab_size=50000))


def test_vocab_size_too_small(tmp_path, corpus):
    raises_one_line(r"--tokenizer-vocab-size 100 with --tokenizer-type unigram is too small .*; "
                    r"use --tokenizer-vocab-size >= \d+",
                    prepare_data, text_cfg(tmp_path, corpus, tokenizer_vocab_size=100, tokenizer_type="unigram"))


def test_failed_prepare_leaves_no_valid_cache(tmp_path, corpus):
    cfg = text_cfg(tmp_path, corpus, tokenizer_vocab_size=50000)
    with pytest.raises(DataError):
        prepare_data(cfg)
    with pytest.raises(DataError, match="no valid token cache"):
        open_dataset(cfg, seed=0)


def test_interrupted_rebuild_never_looks_valid(tmp_path, corpus, monkeypatch):
    cfg = text_cfg(tmp_path, corpus)
    prepare_data(cfg)
    corpus.write_text(corpus.read_text() + english(50, seed=3))

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(data, "split_tail", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg)
    assert (cache_dir(cfg) / "train.bin").exists()  # the old file is still there, but without a manifest
    with pytest.raises(DataError, match="no valid token cache"):
        open_dataset(cfg, seed=0)
    monkeypatch.undo()
    prepare_data(cfg)
    ds = open_dataset(cfg, seed=0)
    assert np.concatenate([ds.train_tokens, ds.val_tokens]).tolist() == ds.encode(corpus.read_text())


def test_random_tokens_for_benchmarks():
    cfg = data.DataConfig(dataset="random", seq_len=64, tokenizer_vocab_size=70000)
    data.prepare_data(cfg)  # nothing to prepare
    ds = data.open_dataset(cfg, seed=3)
    x, y = ds.train_batch(2, 8, 0, 8)
    assert x.shape == (8, 64) and torch.equal(x[:, 1:], y[:, :-1])
    assert ds.vocab_size == 70000 and ds.train_tokens.dtype == np.uint32 and int(x.max()) < 70000
    assert torch.equal(data.open_dataset(cfg, seed=3).train_batch(2, 8, 0, 8)[0], x)
    assert not torch.equal(data.open_dataset(cfg, seed=4).train_batch(2, 8, 0, 8)[0], x)
    assert ds.val_batch(0, 100)[0].shape == (data.RANDOM_ROWS[1], 64)


def test_content_hashes_stop_at_the_byte_budget(tmp_path, monkeypatch):
    """A large corpus is not re-read in full at every start: hashing stops at HASH_LIMIT bytes."""
    monkeypatch.setattr(data, "HASH_LIMIT", 250)
    paths = []
    for i, size in enumerate([100, 100, 100, 40]):
        p = tmp_path / f"f{i}.txt"
        p.write_text("x" * size)
        paths.append(p)
    hashed = data.content_hashes(paths)
    assert sorted(hashed) == [str(paths[0]), str(paths[1]), str(paths[3])]  # f2 would exceed 250 bytes
