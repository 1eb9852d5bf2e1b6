"""Training data for train_fsdp.py: the Free Transformer paper's synthetic task, or a corpus.

prepare_data() does the slow, disk-writing work once (on global rank 0, with every core of its
node): train a SentencePiece tokenizer, tokenize the corpus into flat uint16/uint32 token files and
write a manifest. open_dataset() (every rank) only reads: it memory-maps those files and serves
batches addressed by (step, slice of the global batch), so the order is a pure function of the seed
and resume/any world size see exactly the same samples. `python data.py --dataset ...` builds the
same cache as a job of its own (docs/data.md).
"""

import argparse
import array
import collections
import concurrent.futures
import dataclasses
import datetime
import errno
import hashlib
import io
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import re
import shutil
import socket
import sys
import threading
import tomllib
import typing
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
import tqdm


class DataError(ValueError):
    """Bad user input; the message is one line naming the bad value and what is valid."""


class BuildFailed(RuntimeError):
    """The machine failed the build (a full disk, a worker killed): one line, exit code 1."""


def opt(default, help, choices=None):
    """A config field whose help text (and allowed values) become the command-line flag's."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class DataConfig:
    dataset: str = opt("synthetic", "'synthetic' (built-in task), 'random' (uniform random tokens, "
                       "for benchmarks), a .txt, .jsonl or .parquet file (a \"text\" field) or a "
                       "directory of one kind of them, or token files: a .bin file or a directory "
                       "with train.bin (and val.bin)")
    val_path: str = opt("", "separate validation corpus (same kinds); empty = hold out "
                        "--val-fraction of the tokens")
    val_fraction: float = opt(0.01, "fraction of the tokens held out for validation (no "
                              "--val-path), in (0, 0.5]")
    tokenizer: str = opt("", "existing tokenizer to use: a SentencePiece .model, or a model "
                         "directory's tokenizer.json; empty = train one on the corpus")
    tokenizer_type: str = opt("bpe", "kind of tokenizer to train", ["bpe", "unigram", "char"])
    tokenizer_vocab_size: int = opt(4096, "vocabulary size of a trained tokenizer (an upper bound "
                                    "for char) and of --dataset random")
    seq_len: int = opt(0, "tokens per training row; 0 = the dataset's own (66 for synthetic, 512 "
                       "for text and random)")
    cache_dir: str = opt("data_cache", "directory for trained tokenizers and tokenized .bin files")
    data_workers: int = opt(0, "processes that build the token cache; 0 = every core this process "
                            "may use")
    token_dtype: str = opt("uint16", "integer type of given .bin token files", ["uint16", "uint32"])
    instruct: bool = opt(False, "rows are instruction examples, {\"prompt\", \"completion\"} or "
                         "{\"messages\": [...]} in .jsonl or .parquet; only the answers are "
                         "targets (docs/fine-tuning.md); needs --tokenizer")
    document_mask: bool = opt(False, "each document attends only to itself, from RoPE position 0: "
                              "--instruct packs several examples into a row only with it (else "
                              "one example a row, padded); a corpus keeps its rows")
    too_long: str = opt("truncate", "--instruct: an example longer than --seq-len + 1 tokens is "
                        "truncated or dropped (counted in the summary line)", ["truncate", "drop"])
    synthetic_train_samples: int = opt(65536, "number of samples in the synthetic training set")
    synthetic_val_samples: int = opt(1024,
                                     "number of samples in the fixed synthetic validation set")

    # What train_fsdp.py reads besides the fields (its "Seams" comment). A resumed run may move
    # the token cache: where it lives does not change the tokens.
    RESUME_FREE: typing.ClassVar = frozenset({"cache_dir", "data_workers"})

    def check(self):
        check_config(self)

    @staticmethod
    def saved_fields(table):
        """A saved run's [data] table, the fields it predates set as it ran: off."""
        return {"instruct": False, "document_mask": False, "too_long": "truncate", **table}

TOKENIZER_TYPES = ("bpe", "unigram", "char")
TEXT_SEQ_LEN = 512
FORMAT_VERSION = 2  # bump when the cache layout changes so old caches read as stale
# bytes hashed per check at most; the rest is trusted on size + mtime to keep checks fast
HASH_LIMIT = 64 << 20
TEXT_KINDS = (".txt", ".jsonl", ".parquet")
# text a process reads and tokenises at once: memory stays flat, and every core has work
PART_BYTES = 8 << 20
ENCODE_LINES = 8192  # lines per sp.encode call
TOKENIZER_SAMPLE_BYTES = 1 << 30  # text a tokenizer is trained on at most, spread over the corpus

# The synthetic task (Fleuret, "The Free Transformer", section 4). A sample is "\n", a letter, ">"
# and 64 characters: underscores with the letter repeated 8 times at a random place, each position
# then turned into "!" with probability 1/16. Predicting the block well needs an early latent
# decision of where it goes.
SYNTH_CHARS = "\n>!_" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
SYNTH_VOCAB = 32  # 30 symbols padded to a multiple of 8 for the embedding/logits matmuls
SYNTH_BODY, SYNTH_BLOCK, SYNTH_NOISE = 64, 8, 1 / 16
SYNTH_ROW = 3 + SYNTH_BODY  # "\n" + letter + ">" + body = 67 tokens -> seq_len 66
# fixed and independent of --seed, so every run validates on the same set
SYNTH_VAL_SEED = (12345, 54321)
NEWLINE, PROMPT_END, NOISE, BLANK, LETTER_A = range(5)
# third word of the seed of the text windows' per-epoch shifts (Dataset.epoch_shift)
SHIFT_STREAM = 1
# --instruct: the byte kept beside each token. TARGET: the loss predicts it; START: an example
# begins there. y holds IGNORE (cross_entropy's ignore_index) where no target is.
TARGET, START, IGNORE = 1, 2, -100


def synthetic_rows(n: int, rng: np.random.Generator) -> np.ndarray:
    """n synthetic samples: an (n, 67) uint8 array of token ids, made without a Python loop."""
    letters = (LETTER_A + rng.integers(0, 26, n)).astype(np.uint8)
    starts = rng.integers(0, SYNTH_BODY - SYNTH_BLOCK + 1, n)
    body = np.full((n, SYNTH_BODY), BLANK, np.uint8)
    body[np.arange(n)[:, None], starts[:, None] + np.arange(SYNTH_BLOCK)] = letters[:, None]
    body[rng.random((n, SYNTH_BODY)) < SYNTH_NOISE] = NOISE
    rows = np.empty((n, SYNTH_ROW), np.uint8)
    rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3:] = NEWLINE, letters, PROMPT_END, body
    return rows


class Dataset:
    """Rows of seq_len + 1 tokens cut from a flat token array at a fixed stride, plus the tokenizer.
    Text rows start every seq_len tokens, so neighbours share one boundary token (nanoGPT's x/y);
    synthetic samples are independent, so their stride is the whole row."""

    def __init__(self, train, val, seq_len, stride, vocab_size, seed, tokenizer=(None, ""),
                 shift_windows=False, digests=None, marks=(None, None), document_mask=False,
                 separators=(None, None)):
        # tokenizer: the SentencePiece processor and its .model path; (None, "") for the synthetic
        # alphabet. digests (text): {source: digest} (data_digests), which a resumed run must find
        # unchanged; None when the config alone fixes the rows (synthetic, random). marks
        # (--instruct): a byte beside each train and val token, TARGET and START bits.
        # document_mask: rows are (x, y, positions), positions restarting at each document, which
        # an example's START marks, or in a corpus its BOS or the token after its separator.
        self.train_tokens, self.val_tokens, self.digests = train, val, digests
        self.train_marks, self.val_marks = marks
        self.document_mask, self.separators = document_mask, separators
        self.seq_len, self.stride, self.vocab_size, self.seed = seq_len, stride, vocab_size, seed
        self.sp, self.tokenizer_path = tokenizer
        self.n_train = (len(train) - seq_len - 1) // stride + 1
        self.n_val = (len(val) - seq_len - 1) // stride + 1
        # shift_windows (text): each epoch after the first moves its windows by an offset in [1,
        # stride), so that a token is not always seen with the same left context, which a model
        # memorises; epoch 0 is the plain layout. A shifted epoch holds the rows that fit after the
        # largest shift (max_shift).
        self.n_shifted = (max(1, (len(train) - stride - seq_len) // stride + 1) if shift_windows
                          else self.n_train)
        self.max_shift = min(stride - 1, len(train) - seq_len - 1 - (self.n_shifted - 1) * stride) \
            if shift_windows else 0
        self._perm_epoch, self._perm = -1, None

    def epoch_rows(self, epoch: int) -> int:
        return self.n_train if epoch == 0 else self.n_shifted

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        # Only the current epoch's order is kept: uint32 is 4 bytes a row even for billions of rows.
        if epoch != self._perm_epoch:
            n = self.epoch_rows(epoch)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            self._perm = perm.astype(np.uint32 if n <= 2**32 else np.int64)
            self._perm_epoch = epoch
        return self._perm

    def epoch_shift(self, epoch: int) -> int:
        """Where epoch `epoch`'s windows start: 0 for epoch 0; then each block of max_shift epochs
        takes every offset in [1, max_shift] once, in an order drawn from (seed, block), so that no
        two epochs of a block see the same windows."""
        if epoch == 0 or self.max_shift == 0:
            return 0
        block, i = divmod(epoch - 1, self.max_shift)
        # [seed, block, SHIFT_STREAM]: a stream of its own, apart from the epochs' permutations.
        return 1 + int(np.random.default_rng([self.seed, block,
                                              SHIFT_STREAM]).permutation(self.max_shift)[i])

    def epoch_of(self, k: np.ndarray):
        """(epoch, position in that epoch) of the k-th training row of the run."""
        later = np.maximum(k - self.n_train, 0)
        epochs = np.where(k < self.n_train, 0, 1 + later // self.n_shifted)
        return epochs, np.where(k < self.n_train, k, later % self.n_shifted)

    def train_batch(self, step: int, global_batch: int, start: int, count: int):
        """Rows [start, start+count) of training step `step`'s global batch, as int64 (x, y)."""
        if start < 0 or count < 0 or start + count > global_batch:
            raise ValueError(f"slice [{start}, {start + count}) is outside the global batch of "
                             f"{global_batch}")
        k = step * global_batch + start + np.arange(count, dtype=np.int64)
        epochs, positions = self.epoch_of(k)
        offsets = np.empty(count, np.int64)
        for epoch in np.unique(epochs):  # a batch may straddle an epoch boundary
            hit = epochs == epoch
            rows = self.epoch_permutation(int(epoch))[positions[hit]].astype(np.int64)
            offsets[hit] = rows * self.stride + self.epoch_shift(int(epoch))
        return self.windows(self.train_tokens, offsets, self.train_marks)

    def val_batch(self, start: int, count: int):
        """Fixed validation rows [start, start+count), clipped at n_val."""
        rows = np.arange(start, min(start + count, self.n_val), dtype=np.int64)
        return self.windows(self.val_tokens, rows * self.stride, self.val_marks)

    def windows(self, tokens, offsets: np.ndarray, marks=None):
        """(x, y) of the seq_len + 1 tokens starting at each of `offsets`, y IGNORE where a token
        is not a target; and under document_mask the positions of x's tokens in their documents."""
        # Fancy indexing a memmap reads only the touched pages, never the whole file.
        index = offsets[:, None] + np.arange(self.seq_len + 1)
        block = tokens[index]
        x = np.ascontiguousarray(block[:, :-1], dtype=np.int64)
        y = np.ascontiguousarray(block[:, 1:], dtype=np.int64)
        if marks is not None:
            flags = marks[index]
            y[(flags[:, 1:] & TARGET) == 0] = IGNORE
        if not self.document_mask:
            return torch.from_numpy(x), torch.from_numpy(y)
        starts = (flags[:, :-1] & START) > 0 if marks is not None else self.stream_starts(x)
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(positions_in(starts))

    def stream_starts(self, x: np.ndarray) -> np.ndarray:
        """Where a corpus's documents start in rows x: at a BOS, or after a separator."""
        bos, separator = self.separators
        starts = x == bos if bos is not None else np.zeros(x.shape, bool)
        starts[:, 1:] |= x[:, :-1] == separator
        return starts

    def steps_per_epoch(self, global_batch: int) -> int:
        return -(-self.n_train // global_batch)

    def encode(self, text: str) -> list[int]:
        return encode(self.sp, text)

    def decode(self, ids) -> str:
        return decode(self.sp, ids)


def positions_in(starts: np.ndarray) -> np.ndarray:
    """Each token's position in its document, given where documents start (a row's first token
    starts one): RoPE positions and the model's document mask (model.document_layout)."""
    t = np.arange(starts.shape[1])
    last_start = np.maximum.accumulate(np.where(starts, t, 0), axis=1)
    return t - last_start


def load_tokenizer(tokenizer_path: str):
    """A run's tokenizer without its token files (for sampling): its SentencePiece model or
    tokenizer.json, or None for the synthetic alphabet (a run's tokenizer_path is empty then)."""
    if not tokenizer_path:
        return None
    if not os.path.isfile(tokenizer_path):
        raise DataError(f"tokenizer {tokenizer_path} not found; the run's tokenizer must stay "
                        "where it was trained")
    return open_tokenizer(tokenizer_path)


def open_tokenizer(path, threads=-1):
    """A SentencePiece .model, or a tokenizer.json (a downloaded model's, read by the `tokenizers`
    package) behind the same methods; `threads`: SentencePiece's, -1 for its default."""
    if str(path).endswith(".json"):
        return HFTokenizer(Path(path))
    return spm.SentencePieceProcessor(model_file=str(path), num_threads=threads)


class HFTokenizer:
    """A model directory's tokenizer.json as data.py and sample.py use a SentencePiece model: ids
    as transformers' tokenizer gives them without special tokens; its BOS and EOS from the
    directory's tokenizer_config.json (or config.json)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"{path}: reading a tokenizer.json needs the tokenizers package, "
                            "which is not installed: pip install tokenizers") from None
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library's errors: not JSON, or not a tokenizer
            raise DataError(f"{path}: not a tokenizer.json ({str(e).splitlines()[0]})") from None
        self.path, self.bos, self.eos = path, None, None
        config = read_json_beside(path, "tokenizer_config.json")
        eos = special(config.get("eos_token"))
        if eos is not None:
            self.eos = self.tok.token_to_id(eos)
        if self.eos is None:  # a model's config.json names it by id (one, or the first of a list)
            ids = read_json_beside(path, "config.json").get("eos_token_id")
            self.eos = ids[0] if isinstance(ids, list) and ids else ids
        added = self.tok.encode("x").ids  # the post-processor's own: Llama 3 adds a BOS first
        if len(added) > 1 and added[1:] == self.tok.encode("x", add_special_tokens=False).ids:
            self.bos = added[0]
        elif config.get("add_bos_token") and special(config.get("bos_token")) is not None:
            self.bos = self.tok.token_to_id(special(config["bos_token"]))

    def encode(self, text):
        if isinstance(text, list):
            return [e.ids for e in self.tok.encode_batch(text, add_special_tokens=False)]
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def vocab_size(self):
        return self.tok.get_vocab_size(with_added_tokens=True)

    def id_to_piece(self, i):
        return self.tok.id_to_token(i)

    def piece_to_id(self, piece):
        return self.tok.token_to_id(piece)

    def eos_id(self):
        return -1 if self.eos is None else self.eos

    def bos_id(self):
        return -1 if self.bos is None else self.bos

    def unk_id(self):
        return -1  # byte-level: every text has ids

    def digest(self):
        """sha256 of the tokenizer's definition and of the ids it marks documents with."""
        definition = json.loads(self.tok.to_str())
        return hashlib.sha256(json.dumps([definition, self.bos, self.eos]).encode()).hexdigest()


def read_json_beside(path: Path, name: str) -> dict:
    try:
        return json.loads((path.parent / name).read_text())
    except (OSError, ValueError):
        return {}


def special(token):
    """A special token of tokenizer_config.json: its text, written as a string or a dict."""
    return token.get("content") if isinstance(token, dict) else token


def document_marks(tok, path) -> tuple[list[int], list[int]]:
    """(BOS, separator) of each document. A model directory's tokenizer (tokenizer_config.json
    beside it) marks them as its family does: BOS first where it adds one (Llama, Mistral), EOS
    between. A tokenizer of data.py's own adds no BOS and separates by EOS, else "\n"."""
    if not whole_texts(path):
        return [], [tok.eos_id()] if tok.eos_id() >= 0 else tok.encode("\n")
    config = read_json_beside(Path(path), "tokenizer_config.json")
    adds_bos = isinstance(tok, HFTokenizer) or config.get("add_bos_token", True)  # LlamaTokenizer's
    bos = [tok.bos_id()] if adds_bos and tok.bos_id() >= 0 else []
    if tok.eos_id() < 0:
        raise DataError(f"{path}: the tokenizer names no end-of-sequence token (eos_token in "
                        "tokenizer_config.json, eos_token_id in config.json) to separate documents")
    return bos, [tok.eos_id()]


def whole_texts(path) -> bool:
    """Whether documents are encoded whole, not line by line: a model directory's tokenizer joins
    lines ("\n\n" is one token of byte-level BPE) and marks only a text's start (SentencePiece's
    dummy prefix). data.py's own encode a line as they encode it in a text."""
    beside = read_json_beside(Path(path), "tokenizer_config.json")
    return str(path).endswith(".json") or bool(beside)


def encode(sp, text: str) -> list[int]:
    if sp is not None:
        return sp.encode(text)
    bad = sorted(set(text) - set(SYNTH_CHARS))
    if bad:
        raise DataError(f"characters {bad} are not in the synthetic vocabulary; valid: "
                        f"{SYNTH_CHARS!r}")
    return [SYNTH_CHARS.index(c) for c in text]


def decode(sp, ids) -> str:
    ids = [int(i) for i in ids]
    if sp is not None:
        return sp.decode(ids)
    # "?" marks padding ids
    return "".join(SYNTH_CHARS[i] if i < len(SYNTH_CHARS) else "?" for i in ids)


def check_config(cfg: DataConfig) -> None:
    if cfg.tokenizer_type not in TOKENIZER_TYPES:
        raise DataError(f"--tokenizer-type {cfg.tokenizer_type}: unknown; use one of "
                        f"{', '.join(TOKENIZER_TYPES)}")
    if not 0 < cfg.val_fraction <= 0.5:
        raise DataError(f"--val-fraction {cfg.val_fraction}: must be in (0, 0.5]")
    if cfg.data_workers < 0:
        raise DataError(f"--data-workers {cfg.data_workers}: must be at least 1, or 0 for every "
                        "core")
    if cfg.seq_len < 0:
        raise DataError(f"--seq-len {cfg.seq_len}: must be at least 1, or 0 for the dataset's own")
    if cfg.dataset in ("synthetic", "random") and (cfg.instruct or cfg.document_mask):
        raise DataError(f"--{'instruct' if cfg.instruct else 'document-mask'}: --dataset "
                        f"{cfg.dataset} has no examples or documents; give a corpus")
    if cfg.dataset == "synthetic":
        n = SYNTH_ROW - 1
        if cfg.seq_len not in (0, n):
            raise DataError(f"--seq-len {cfg.seq_len}: the synthetic task's rows are {n} tokens; "
                            f"use 0 or {n}")
        if min(cfg.synthetic_train_samples, cfg.synthetic_val_samples) < 1:
            raise DataError(f"--synthetic-train-samples {cfg.synthetic_train_samples} / "
                            f"--synthetic-val-samples {cfg.synthetic_val_samples}: both must be at "
                            "least 1")


def list_sources(path: str, flag: str) -> list[Path]:
    """The files behind a --dataset/--val-path value, in a stable order: text (.txt, .jsonl,
    .parquet, or a directory of one of those kinds) or token files (.bin, or a directory with
    train.bin)."""
    kinds = (("'synthetic', " if flag == "--dataset" else "") + "a .txt, .jsonl, .parquet or .bin "
             "file, or a directory of .txt, .jsonl or .parquet files or with a train.bin")
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{flag} {path}: no such file or directory; use {kinds}")
    if p.is_dir():
        if flag == "--dataset" and (p / "train.bin").is_file():
            return [(p / "train.bin").resolve()]
        found = {kind: sorted({f.resolve() for f in files_under(p) if f.name.endswith(kind)})
                 for kind in TEXT_KINDS}
        found = {kind: files for kind, files in found.items() if files}
        if len(found) > 1:
            raise DataError(f"{flag} {path}: the directory holds {' and '.join(found)} files; keep "
                            "one kind in it")
        if not found:
            raise DataError(f"{flag} {path}: directory contains no .txt, .jsonl or .parquet files; "
                            f"use {kinds}")
        return next(iter(found.values()))
    if p.suffix not in TEXT_KINDS + (".bin",):
        raise DataError(f"{flag} {path}: unsupported file extension '{p.suffix}'; use {kinds}")
    return [p.resolve()]


def files_under(root: Path) -> list[Path]:
    """The files in root and its subdirectories, a link to a directory followed like a directory
    (Path.rglob skips them); a directory reached twice (a link loop) is read once."""
    seen, files = set(), []

    def unlisted(e):  # os.walk would skip a directory it cannot list, and half a corpus with it
        raise DataError(f"{e.filename}: cannot be listed ({e.strerror}); every directory of a "
                        "corpus must be readable")
    for d, dirs, names in os.walk(root, followlinks=True, onerror=unlisted):
        if os.path.realpath(d) in seen:
            dirs.clear()
            continue
        seen.add(os.path.realpath(d))
        files += [Path(d, n) for n in names if os.path.isfile(os.path.join(d, n))]
    return files


# --- reading the corpus in parts ------------------------------------------------------------------
# A corpus is cut into parts that processes read and tokenise independently: byte ranges that end
# at a line end ("\n") in a .txt or .jsonl file, row groups in a Parquet file. A .txt file is one
# document over all its parts; a .jsonl line or a Parquet row is one document.


class Part(typing.NamedTuple):
    path: Path
    lo: int  # first byte (a row group's index in a Parquet file)
    hi: int  # end byte (the next row group's index)
    size: int  # bytes of text, for the progress bar and the tokenizer's sample


def parts_of(path: Path, texts=True) -> list[Part]:
    if path.suffix == ".parquet":
        meta = parquet_file(path, texts).metadata
        return [Part(path, i, i + 1, meta.row_group(i).total_byte_size)
                for i in range(meta.num_row_groups)]
    size, parts, lo = path.stat().st_size, [], 0
    with open(path, "rb") as f:
        # an empty file is one empty part: an empty .txt is still a document
        while lo < size or not parts:
            f.seek(min(lo + PART_BYTES, size))
            hi = f.tell() + len(f.readline())  # after the next "\n", which always ends a line
            # and after the blank lines that follow it: "\n\n" is one token of byte-level BPE
            while hi < size and f.read(1) in (b"\n", b"\r"):
                f.seek(hi)
                hi += len(f.readline())
            parts.append(Part(path, lo, hi, hi - lo))
            lo = hi
    return parts


def read_part(part: Part):
    """(starts a document, its lines) for each stretch of text in the part; lines keep their
    endings, read as open(path, encoding="utf-8", errors="replace") reads them."""
    if part.path.suffix == ".parquet":
        for text in parquet_texts(part):
            yield True, text.splitlines(keepends=True)
        return
    with open(part.path, "rb") as f:
        f.seek(part.lo)
        raw = f.read(part.hi - part.lo)
    # errors="replace": one bad byte in a large scraped file should not abort hours of tokenizing.
    lines = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors="replace")
    if part.path.suffix == ".txt":
        yield part.lo == 0, lines
        return
    if part.lo == 0:  # a .jsonl file saved with a byte order mark (U+FEFF) starts after it
        lines = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8-sig", errors="replace")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            text = json.loads(line).get("text")
        except (json.JSONDecodeError, AttributeError):
            text = None
        if not isinstance(text, str):
            lineno = line_number(part, raw, i)
            raise DataError(f'{part.path} line {lineno}: not a JSON object with a "text" string; '
                            'every line needs one')
        yield True, text.splitlines(keepends=True)


def line_number(part: Part, raw: bytes, i: int) -> int:
    """The file's line number of line i of the part whose bytes are raw."""
    with open(part.path, "rb") as f:
        before = sum(block.count(b"\n")
                     for block in iter(lambda: f.read(min(1 << 24, part.lo - f.tell())), b""))
    return before + i + 1


def parquet_file(path: Path, texts=True):
    """The Parquet file, checked: readable, with rows, and a string column "text" (unless the rows
    are --instruct examples, texts=False)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow, which is not installed: pip "
                        "install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError: a truncated or foreign file
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    names = pf.schema_arrow.names
    if texts:
        if "text" not in names:
            raise DataError(f'{path}: no "text" column (it has {", ".join(names)}); the text must '
                            'be in "text"')
        kind = pf.schema_arrow.field("text").type
        if str(kind) not in ("string", "large_string", "string_view"):
            raise DataError(f'{path}: column "text" holds {kind}, not strings')
    if pf.metadata.num_rows == 0:
        raise DataError(f"{path}: the shard is empty (no rows); remove it or write it again")
    return pf


def parquet_texts(part: Part) -> list[str]:
    try:
        group = parquet_file(part.path).read_row_group(part.lo, columns=["text"])
    except DataError:
        raise
    except Exception as e:  # pyarrow's OSError or ArrowInvalid: its footer read, its data not
        raise DataError(f"{part.path} row group {part.lo}: cannot be read "
                        f"({str(e).splitlines()[0]}); rewrite or remove the shard") from None
    texts = group.column(0).to_pylist()
    if None in texts:
        row = (sum(parquet_file(part.path).metadata.row_group(i).num_rows for i in range(part.lo))
               + texts.index(None))
        raise DataError(f'{part.path} row {row}: "text" is null; every row needs a string')
    return texts


def has_text(parts: list[Part]) -> bool:
    return any(line.strip() for part in parts for _, lines in read_part(part) for line in lines)


def in_order(fn, items, workers: int, initializer=None, initargs=()):
    """fn over items, results in order, on `workers` processes (in this one for a single item).
    At most two results per worker wait to be taken, so memory does not grow with the corpus."""
    if workers == 1 or len(items) <= 1:
        if initializer:
            initializer(*initargs)
        yield from map(fn, items)
        return
    # forkserver, not fork: the trainer builds in a thread while its main thread waits in a
    # collective, and a fork copies the locks other threads hold, which the child may then need.
    # The server imports the main module once, then forks each worker from one thread.
    server = multiprocessing.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(workers, server, start_pool_worker,
                                                (initializer, initargs)) as pool:
        pending = collections.deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) == 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except concurrent.futures.process.BrokenProcessPool:
            raise BuildFailed(f"a data worker process died (killed, most likely for want of "
                              f"memory); lower --data-workers (it was {workers})") from None
        finally:  # an error, or a reader that stops early: what has not started never will
            for future in pending:
                future.cancel()


def start_pool_worker(initializer, initargs):
    """A worker ends when the process that asked for it does, killed too: it would wait for work
    forever (and keep the fork server, which ends with its last worker, alive with it)."""
    parent = multiprocessing.parent_process()

    def exit_with_parent():
        multiprocessing.connection.wait([parent.sentinel])  # ready when the parent has ended
        os._exit(1)
    threading.Thread(target=exit_with_parent, daemon=True).start()
    if initializer:
        initializer(*initargs)


def data_workers(cfg: DataConfig) -> int:
    return cfg.data_workers or len(os.sched_getaffinity(0))


def progress(parts: list[Part], what: str):
    """A progress bar (MB done, MB/s, time left) that shows itself only when the work is long."""
    return tqdm.tqdm(total=sum(p.size for p in parts), desc=f"data: {what}", unit="B",
                     unit_scale=True, unit_divisor=1024, delay=10, mininterval=2)


# --- identity of the inputs -----------------------------------------------------------------------


def fingerprint(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def content_hashes(paths: list[Path]) -> dict:
    """sha256 of the files, in order, while they fit in HASH_LIMIT bytes in all: catches edits that
    keep size and mtime (cp -p, quick rewrites) in small corpora, while the rest of a large corpus
    is trusted on size + mtime so that a second run still starts at once."""
    hashes, budget = {}, HASH_LIMIT
    for path in paths:
        size = path.stat().st_size
        if size <= budget:
            budget -= size
            hashes[str(path)] = file_sha256(path)
    return hashes


def resolve_inputs(cfg: DataConfig):
    """Source files, validation files and the given tokenizer (or None), plus their fingerprints."""
    train = list_sources(cfg.dataset, "--dataset")
    val = list_sources(cfg.val_path, "--val-path") if cfg.val_path else []
    if train[0].name == "train.bin" and not val and (train[0].parent / "val.bin").is_file():
        val = [train[0].parent / "val.bin"]  # nanoGPT's layout: train.bin and val.bin side by side
    if any(p.suffix == ".bin" for p in train + val) and {p.suffix for p in train + val} != {".bin"}:
        raise DataError(f"--dataset {cfg.dataset} / --val-path {cfg.val_path}: token files (.bin) "
                        "and text cannot be mixed; give both as .bin or both as text")
    model = Path(cfg.tokenizer).expanduser().resolve() if cfg.tokenizer else None
    if model and not model.is_file():
        raise DataError(f"--tokenizer {cfg.tokenizer}: no such file; give a SentencePiece .model "
                        "or a tokenizer.json, or leave it empty")
    if model:
        try:
            document_marks(open_tokenizer(model), model)
        # sentencepiece's own message names neither the flag nor a remedy
        except (RuntimeError, OSError):
            raise DataError(f"--tokenizer {cfg.tokenizer}: not a SentencePiece model; give a "
                            ".model file written by SentencePiece, or leave it empty to train one "
                            "on the corpus") from None
    inputs = {"train": [fingerprint(p) for p in train], "val": [fingerprint(p) for p in val],
              "tokenizer": fingerprint(model) if model else None}
    if cfg.instruct and model:
        inputs["chat template"] = chat_digest(model)
    return train, val, model, inputs


def chat_digest(model: Path) -> str:
    """sha256 of what renders --instruct examples besides the tokenizer: the template and special
    tokens of the tokenizer_config.json (and chat_template.jinja) beside it."""
    h = hashlib.sha256()
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        path = model.parent / name
        h.update(path.read_bytes() if path.is_file() else b"-")
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tokenizer_digest(sp) -> str:
    """sha256 of each id's piece, score and kind: what encoding and decoding depend on. Not of the
    .model file, whose bytes also record where and how it was trained (staging directory,
    threads). A tokenizer.json's: its own (HFTokenizer.digest)."""
    if isinstance(sp, HFTokenizer):
        return sp.digest()
    kinds = (sp.is_unknown, sp.is_control, sp.is_unused, sp.is_byte)
    table = [[sp.id_to_piece(i), sp.get_score(i), [is_kind(i) for is_kind in kinds]]
             for i in range(sp.vocab_size())]
    return hashlib.sha256(json.dumps(table).encode()).hexdigest()


def data_digests(train_paths: list[Path], val_paths: list[Path], hashes: dict, sp,
                 workers: int) -> dict:
    """{source: digest} of what the rows are made of: each corpus file's bytes and the tokenizer's
    pieces. A resumed run compares them with its checkpoint's. Taken once, when the cache is built:
    a large corpus is then read anyway, and an unchanged one gives the same digests again."""
    files = [("corpus", p) for p in train_paths] + [("validation corpus", p) for p in val_paths]
    unhashed = [p for _, p in files if str(p) not in hashes]
    hashes = {**hashes, **dict(zip(map(str, unhashed), in_order(file_sha256, unhashed, workers)))}
    digests = {f"{kind} {p}": hashes[str(p)] for kind, p in files}
    if sp is not None:
        digests["tokenizer"] = tokenizer_digest(sp)
    return digests


def absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve()) if path else ""


def cache_dir_for(cfg: DataConfig) -> Path:
    # Keyed on the settings, not on file contents, so an edited corpus replaces its cache (the
    # manifest catches the change) instead of leaving an orphaned cache behind.
    key = {"format": FORMAT_VERSION, "dataset": absolute(cfg.dataset),
           "val_path": absolute(cfg.val_path),
           "val_fraction": None if cfg.val_path else cfg.val_fraction,
           "tokenizer": absolute(cfg.tokenizer) or [cfg.tokenizer_type, cfg.tokenizer_vocab_size]}
    if cfg.instruct:  # rows are packed when the cache is built
        key["instruct"] = [cfg.seq_len or TEXT_SEQ_LEN, cfg.document_mask, cfg.too_long]
    if Path(cfg.dataset).suffix == ".bin" or (Path(cfg.dataset) / "train.bin").is_file():
        key["token_files"] = [cfg.token_dtype, cfg.tokenizer_vocab_size]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cfg.cache_dir) / f"{Path(cfg.dataset).stem}-{digest}"


def token_files(out: Path, manifest: dict) -> dict:
    """{split: (file, first token, tokens)}: the cache's own .bin files or the given ones."""
    if "token_files" in manifest:
        return {name: (Path(f), lo, n) for name, (f, lo, n) in manifest["token_files"].items()}
    return {"train": (out / "train.bin", 0, manifest["train_tokens"]),
            "val": (out / "val.bin", 0, manifest["val_tokens"])}


def valid_manifest(out: Path, inputs: dict, hashes: dict | None = None):
    """The cache's manifest if built from exactly these inputs, its files complete; else None."""
    # open_dataset passes no hashes: rank 0 just checked them in prepare_data; hashing is slow.
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if manifest.get("format") != FORMAT_VERSION or manifest.get("inputs") != inputs:
        return None
    if hashes is not None and manifest.get("sha256") != hashes:
        return None
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for f, lo, n in token_files(out, manifest).values():
        if not f.is_file() or f.stat().st_size < (lo + n) * itemsize:
            return None
        marks = f.with_suffix(".mask")
        if "examples" in manifest and (not marks.is_file() or marks.stat().st_size < n):
            return None
    return (manifest if not manifest["tokenizer_path"] or Path(manifest["tokenizer_path"]).is_file()
            else None)


# --- the tokenizer --------------------------------------------------------------------------------


def part_sentences(part: Part) -> list[str]:
    """The non-blank lines of a part, without their line endings: what the tokenizer trains on."""
    return [line.rstrip("\r\n") for _, lines in read_part(part) for line in lines if line.strip()]


def tokenizer_sample(parts: list[Part]) -> list[Part]:
    """The whole corpus when it holds at most TOKENIZER_SAMPLE_BYTES, else that many bytes' worth of
    parts spread evenly over it: a tokenizer learns no more from a larger sample."""
    total = sum(p.size for p in parts)
    if total <= TOKENIZER_SAMPLE_BYTES:
        return parts
    keep = max(1, len(parts) * TOKENIZER_SAMPLE_BYTES // total)
    return [parts[i * len(parts) // keep] for i in range(keep)]


def train_tokenizer(cfg: DataConfig, parts: list[Part], out: Path) -> Path:
    sample = tokenizer_sample(parts)
    workers = data_workers(cfg)
    mb = sum(p.size for p in sample) / 2**20
    print(f"data: training a {cfg.tokenizer_type} tokenizer ({cfg.tokenizer_vocab_size} tokens) on "
          f"{mb:.0f} MB of {len({p.path for p in parts})} files, with {workers} processes")
    # sentencepiece turns exceptions from the iterator into a generic RuntimeError; keep ours
    errors = []

    def sentences():
        try:
            for lines in in_order(part_sentences, sample, workers):
                yield from lines
        except Exception as e:  # bad input, an unreadable file, a dead worker: said as such
            errors.append(e)
            raise

    char = cfg.tokenizer_type == "char"
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_prefix=str(out / "tokenizer"),
            model_type=cfg.tokenizer_type, vocab_size=cfg.tokenizer_vocab_size,
            # a char vocabulary is the corpus's alphabet; the size only caps it
            hard_vocab_limit=not char,
            byte_fallback=not char,  # unseen characters become UTF-8 byte tokens instead of <unk>
            character_coverage=1.0 if char else 0.9995,
            # Identity normalization, kept whitespace, no dummy prefix and "\n" as a piece make
            # decode(encode(text)) == text, and make encoding line by line equal to encoding the
            # whole text.
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, user_defined_symbols=["\n"], input_sentence_size=2_000_000,
            shuffle_input_sentence=True, max_sentence_length=16384, num_threads=workers,
            minloglevel=2)
    except RuntimeError as e:
        if errors:
            raise errors[0] from None
        raise DataError(tokenizer_error(cfg, str(e))) from None
    return out / "tokenizer.model"


def tokenizer_error(cfg: DataConfig, message: str) -> str:
    flags = (f"--tokenizer-vocab-size {cfg.tokenizer_vocab_size} with --tokenizer-type "
             f"{cfg.tokenizer_type}")
    if m := re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)",
                      message):
        return (f"{flags} is too large for this corpus; use --tokenizer-vocab-size <= {m[1]} or a "
                "larger corpus")
    if m := re.search(r"smaller than required_chars\. \d+ vs (\d+)", message):
        return (f"{flags} is too small for this corpus's characters; use --tokenizer-vocab-size >= "
                f"{m[1]}")
    return (f"{flags}: sentencepiece could not train a tokenizer: "
            f"{message.splitlines()[0].rsplit('] ', 1)[-1]}")


# --- tokenising -----------------------------------------------------------------------------------

_worker = None  # (tokenizer, (BOS, separator), whole texts?) of this process, once loaded


def start_worker(model: str) -> None:
    global _worker
    tok = open_tokenizer(model, threads=1)  # the processes are the parallelism
    _worker = tok, document_marks(tok, model), whole_texts(model)


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def encode_part(part: Part) -> np.ndarray:
    """The token ids of a part, each document that starts in it preceded by the separator and BOS
    (document_marks); write_tokens drops the stream's first separator, so documents are joined by
    one. Lines are encoded one by one, or a part's text whole (whole_texts)."""
    sp, (bos, separator), whole = _worker
    ids = array.array("i")
    for starts, lines in read_part(part):
        if starts:
            ids.extend(separator + bos)
        if whole:
            ids.extend(sp.encode("".join(lines)))
            continue
        for batch in batched(lines, ENCODE_LINES):
            for line_ids in sp.encode(batch):
                ids.extend(line_ids)
    return np.frombuffer(ids, np.int32).astype(token_dtype(sp.vocab_size()))


def batched(iterable, n: int):
    it = iter(iterable)
    return iter(lambda: list(islice(it, n)), [])


def write_tokens(sp, model: Path, parts: list[Part], dest: Path, workers: int, bar) -> int:
    """Tokenise the parts into dest, in order, on `workers` processes; returns the tokens' count."""
    n, skip = 0, len(document_marks(sp, model)[1])  # the stream starts with a separator: drop it
    encoded = in_order(encode_part, parts, workers, start_worker, (str(model),))
    with open(dest, "wb") as f:
        for part, tokens in zip(parts, encoded):
            kept = tokens[skip:]
            kept.tofile(f)
            n += len(kept)
            skip = max(0, skip - len(tokens))
            bar.update(part.size)
    return n


def split_tail(src: Path, dest: Path, dtype, n_total: int, n_tail: int) -> None:
    """Move the last n_tail tokens of src into dest, truncating src in place (no second copy)."""
    tokens = np.memmap(src, dtype=dtype, mode="r", shape=(n_total,))
    with open(dest, "wb") as f:
        for i in range(n_total - n_tail, n_total, 1 << 24):
            np.asarray(tokens[i:min(i + (1 << 24), n_total)]).tofile(f)
    del tokens
    os.truncate(src, (n_total - n_tail) * np.dtype(dtype).itemsize)


def held_out(cfg: DataConfig, n: int) -> int:
    """Tokens of the --val-fraction held out from a stream of n."""
    return min(n, max(1, math.ceil(n * cfg.val_fraction)))


# --- instruction examples (--instruct) ------------------------------------------------------------
# An example is a prompt and its answer ({"prompt", "completion"}: the two texts joined, as TRL
# joins them, then EOS) or a chat ({"messages"}: rendered by the tokenizer's chat template). Its
# targets are the answer's tokens: the completion and its EOS, or each assistant turn with its
# end-of-turn mark. Examples are packed in order into rows of --seq-len + 1 tokens, padded.

ROLES = ("system", "user", "assistant", "tool")
# For a tokenizer without a chat_template (one data.py trained, or a base model's).
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}"
                  "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}Assistant: {% endif %}")

_examples = None  # (tokenizer, BOS ids, template, its BOS and EOS texts, the model's own?)


def chat_template(model: str, tok):
    """(template, variables, own?): the tokenizer's chat template (chat_template in the
    tokenizer_config.json beside it, or chat_template.jinja) compiled as transformers compiles
    it, or PLAIN_TEMPLATE (own False); the variables give tok's BOS and EOS as text."""
    try:
        import jinja2
        import jinja2.sandbox
    except ImportError:
        raise DataError("--instruct renders chats with jinja2, which is not installed: pip install "
                        "jinja2") from None
    source = read_json_beside(Path(model), "tokenizer_config.json").get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    jinja_file = Path(model).parent / "chat_template.jinja"
    if jinja_file.is_file():  # transformers' newer layout, which wins over the JSON's
        source = jinja_file.read_text()

    def raise_exception(message):
        raise jinja2.TemplateError(message)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    try:
        template = env.from_string(source or PLAIN_TEMPLATE)
    except jinja2.TemplateError as e:
        raise DataError(f"{model}: its chat template is not valid Jinja ({e})") from None
    names = {"bos_token": tok.bos_id(), "eos_token": tok.eos_id()}
    variables = {k: tok.id_to_piece(i) if i >= 0 else "" for k, i in names.items()}
    return template, variables, bool(source)


def start_examples_worker(model: str) -> None:
    global _examples
    tok = open_tokenizer(model, threads=1)
    template, variables, own = chat_template(model, tok)
    if tok.eos_id() < 0:
        raise DataError(f"{model}: the tokenizer names no end-of-sequence token to end answers "
                        "with (eos_token in tokenizer_config.json)")
    # A model's own template writes its BOS; the plain one and prompt/completion rows need ours.
    bos = [tok.bos_id()] if tok.bos_id() >= 0 and document_marks(tok, model)[0] else []
    _examples = tok, bos, template, variables, own


def chat_prompt(model: str, messages) -> tuple[list[int], set[int]]:
    """(ids, end-of-turn ids) of a chat to continue (sample.py --chat): rendered as examples are,
    up to the assistant's turn; a turn ends at EOS, or an eos_token_id of generation_config.json."""
    start_examples_worker(model)
    tok, bos, template, variables, own = _examples
    if not (isinstance(messages, list) and messages):
        raise DataError(f"the chat {messages!r:.80} is not a list of {{\"role\", \"content\"}} "
                        "messages")
    check_messages(messages, lambda: "the chat")
    text = render(template, messages, True, variables, lambda: "the chat")
    ends = read_json_beside(Path(model), "generation_config.json").get("eos_token_id", [])
    return ([] if own else bos) + encode_text(tok, text, variables), {
        tok.eos_id(), *(ends if isinstance(ends, list) else [ends])}


def example_rows(part: Part):
    """(where, row) for each example of a part; where() names its file and line, or Parquet row."""
    if part.path.suffix == ".parquet":
        pf = parquet_file(part.path, texts=False)
        first = sum(pf.metadata.row_group(i).num_rows for i in range(part.lo))
        names = [n for n in ("messages", "prompt", "completion") if n in pf.schema_arrow.names]
        for i, row in enumerate(pf.read_row_group(part.lo, columns=names).to_pylist()):
            yield (lambda i=i: f"{part.path} row {first + i}"), row
        return
    with open(part.path, "rb") as f:
        f.seek(part.lo)
        raw = f.read(part.hi - part.lo)
    encoding = "utf-8-sig" if part.lo == 0 else "utf-8"
    for i, line in enumerate(io.TextIOWrapper(io.BytesIO(raw), encoding, errors="replace")):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            yield (lambda i=i: f"{part.path} line {line_number(part, raw, i)}"), row


def encode_examples(part: Part):
    """(ids, marks, lengths) of a part's examples, one after another."""
    ids, marks, lengths = array.array("i"), array.array("B"), []
    for where, row in example_rows(part):
        example, targets = example_ids(row, where)
        ids.extend(example)
        marks.extend([TARGET if t else 0 for t in targets])
        marks[len(marks) - len(example)] = START  # never a target: the example before never sees it
        lengths.append(len(example))
    return (np.frombuffer(ids, np.int32), np.frombuffer(marks, np.uint8),
            np.array(lengths, np.int64))


def example_ids(row, where) -> tuple[list[int], list[bool]]:
    """The example's ids and whether each is a target. Its text is encoded whole, as transformers
    encodes a rendered chat and TRL a prompt with its completion (encoding the pieces apart would
    start each with its own SentencePiece "▁"); a token overlapping the answer is a target."""
    tok, bos, template, variables, own = _examples
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        ids, targets = encode_marked(tok, chat_pieces(row["messages"], template, variables, where),
                                     variables)
        first = [] if own else bos  # a model's own template writes its BOS
        return first + ids, [False] * len(first) + targets
    if not (isinstance(row, dict) and isinstance(row.get("prompt"), str)
            and isinstance(row.get("completion"), str)):
        raise DataError(f'{where()}: not an example; each row needs "prompt" and "completion" '
                        'strings, or "messages", a list of {"role", "content"}')
    if not row["completion"].strip():
        raise DataError(f"{where()}: the completion is empty; every example needs an answer")
    ids, targets = encode_marked(tok, [(row["prompt"], False), (row["completion"], True)], {})
    return bos + ids + [tok.eos_id()], [False] * len(bos) + targets + [True]


def encode_marked(tok, pieces, variables) -> tuple[list[int], list[bool]]:
    """The ids of the pieces' text encoded as one, and which belong to target pieces: a piece's
    tokens start where the text before it, encoded alone, stops agreeing with the whole (so a
    token that straddles a prompt's end and an answer's start is the answer's)."""
    text = "".join(t for t, _ in pieces)
    ids, targets, at, start = encode_text(tok, text, variables), [], 0, 0
    for piece, target in pieces:
        at += len(piece)
        before = encode_text(tok, text[:at], variables) if at < len(text) else ids
        end = next((k for k, (a, b) in enumerate(zip(ids, before)) if a != b),
                   min(len(ids), len(before)))
        targets += [target] * (end - start)
        start = end
    return ids, targets + [False] * (len(ids) - start)


def chat_pieces(messages, template, variables, where) -> list[tuple[str, bool]]:
    """The rendered chat in pieces, each assistant turn a target: the text the template adds for
    that turn after the generation prompt that precedes it."""
    check_messages(messages, where)
    if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
        raise DataError(f"{where()}: an assistant message is empty; every answer needs text")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where()}: no assistant message, so nothing to learn from the row")
    pieces, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(template, messages[:i], True, variables, where)
        full = render(template, messages[:i + 1], False, variables, where)
        if not (head.startswith(done) and full.startswith(head)):
            raise DataError(f"{where()}: the chat template renders a conversation's start "
                            "differently inside a longer one, so the answers cannot be marked")
        pieces += [(head[len(done):], False), (full[len(head):], True)]
        done = full
    return pieces


def check_messages(messages, where) -> None:
    """Each message a {"role", "content"} of a known role."""
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("content"), str)
                and m.get("role") in ROLES):
            role = m.get("role") if isinstance(m, dict) else None
            raise DataError(f"{where()}: message {m!r:.60} is not a {{\"role\", \"content\"}} with "
                            f"a known role (role {role!r}; valid: {', '.join(ROLES)})")


def render(template, messages, generation_prompt, variables, where) -> str:
    try:
        return template.render(messages=messages, add_generation_prompt=generation_prompt,
                               **variables)
    except Exception as e:  # jinja2's errors, and the template's own raise_exception
        raise DataError(f"{where()}: the chat template failed on this row: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def encode_text(tok, text: str, variables: dict) -> list[int]:
    """Ids of rendered text whose special tokens are written out: a tokenizer.json reads them as
    their ids; for SentencePiece, the BOS and EOS texts are cut out and put back as ids."""
    specials = {v: tok.piece_to_id(v) for v in variables.values() if v}
    if isinstance(tok, HFTokenizer) or not specials or not text:
        return tok.encode(text) if text else []
    ids = []
    for chunk in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        ids += [specials[chunk]] if chunk in specials else tok.encode(chunk) if chunk else []
    return ids


def write_examples(cfg, model: Path, dtype, parts: list[Part], dest: Path, workers: int, counts,
                   bar) -> int:
    """Pack the parts' examples, in order, into rows of --seq-len + 1 tokens (several a row under
    --document-mask, else one), padded; ids into dest, marks into dest.mask. Returns the rows."""
    width = (cfg.seq_len or TEXT_SEQ_LEN) + 1
    row, row_marks = np.zeros(width, dtype), np.zeros(width, np.uint8)
    fill, rows = 0, 0  # tokens in the row so far, rows written
    seen, targets = collections.Counter(), collections.Counter()  # examples, targets by file
    encoded = in_order(encode_examples, parts, workers, start_examples_worker, (str(model),))
    with open(dest, "wb") as f, open(dest.with_suffix(".mask"), "wb") as fm:
        def flush():
            nonlocal fill, rows
            row[fill:], row_marks[fill:] = 0, 0
            row_marks[fill:fill + 1] = START  # padding: a document of its own
            row.tofile(f)
            row_marks.tofile(fm)
            fill, rows = 0, rows + 1
        for part, (ids, marks, lengths) in zip(parts, encoded):
            seen[part.path] += len(lengths)
            for lo, n in zip(np.cumsum(lengths) - lengths, lengths):
                if n > width:
                    counts["too long"] += 1
                    if cfg.too_long == "drop":
                        continue
                    n = width
                wanted = int((marks[lo + 1:lo + n] & TARGET).sum())
                if not wanted:  # its answer was cut off
                    counts["without a target"] += 1
                    continue
                if fill + n > width or (fill and not cfg.document_mask):
                    flush()
                row[fill:fill + n], row_marks[fill:fill + n] = ids[lo:lo + n], marks[lo:lo + n]
                fill += n
                counts["examples"] += 1
                counts["targets"] += wanted
                targets[part.path] += wanted
            bar.update(part.size)
        if fill:
            flush()
    for path in seen:
        if not seen[path]:
            raise DataError(f"{path}: the file holds no examples (blank lines at most); give rows "
                            "of examples, or remove it")
        if not targets[path]:
            raise DataError(f"{path}: no example keeps a target token within --seq-len "
                            f"{width - 1} (the answers come later); raise --seq-len, or remove "
                            "the file")
    counts["tokens"] += rows * width
    return rows


def check_examples_input(cfg, paths: list[Path], model) -> None:
    """What --instruct needs before any tokenising: rows (.jsonl, .parquet), a tokenizer, jinja2."""
    if model is None:
        raise DataError("--instruct: give --tokenizer, the tokenizer of the model being "
                        "fine-tuned (--init-from a model directory sets it)")
    if bad := [p for p in paths if p.suffix not in (".jsonl", ".parquet")]:
        raise DataError(f"--instruct: {bad[0]} is not a .jsonl or .parquet file of examples")
    chat_template(str(model), open_tokenizer(model, threads=1))


def build_examples(cfg, sources: dict, identity: dict, tmp: Path, out: Path) -> dict:
    """train.bin, train.mask, val.bin, val.mask and manifest.json of --instruct examples, as
    build_cache does for a corpus; --val-fraction holds out the last rows. Returns the manifest."""
    parts, workers, model = sources["parts"], data_workers(cfg), sources["model"]
    tok, counts = open_tokenizer(model), collections.Counter()
    width, dtype = (cfg.seq_len or TEXT_SEQ_LEN) + 1, token_dtype(tok.vocab_size())
    print(f"data: packing the examples of {len(sources['train']) + len(sources['val'])} files "
          f"into {out} with {workers} processes")
    with progress(parts["train"] + parts["val"], "tokenising") as bar:
        n_train = write_examples(cfg, model, dtype, parts["train"], tmp / "train.bin", workers,
                                 counts, bar)
        if parts["val"]:
            n_val = write_examples(cfg, model, dtype, parts["val"], tmp / "val.bin", workers,
                                   counts, bar)
    if not parts["val"]:
        n_val = min(n_train, math.ceil(n_train * cfg.val_fraction))
        for suffix, kind in ((".bin", dtype), (".mask", np.uint8)):
            split_tail(tmp / f"train{suffix}", tmp / f"val{suffix}", kind, n_train * width,
                       n_val * width)
        n_train -= n_val
    digests = data_digests(sources["train"], sources["val"], identity["sha256"], tok, workers)
    digests["chat template"] = identity["inputs"]["chat template"]  # a resume refuses a new one
    manifest = {"format": FORMAT_VERSION, **identity, "tokenizer": {},
                "tokenizer_path": str(model), "vocab_size": tok.vocab_size(),
                "dtype": np.dtype(dtype).name, "train_tokens": n_train * width,
                "val_tokens": n_val * width, "val_fraction": None if parts["val"] else
                cfg.val_fraction, "examples": dict(counts, rows=n_train + n_val),
                "digests": digests}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def examples_summary(cfg: DataConfig, manifest: dict) -> str:
    c = collections.Counter(manifest["examples"])
    kept = "dropped" if cfg.too_long == "drop" else "truncated"
    layout = "packed, document-masked" if cfg.document_mask else "one a row, padded"
    return (f"data: {c['examples']:,} examples in {c['rows']:,} rows of "
            f"{cfg.seq_len or TEXT_SEQ_LEN} tokens ({layout}); "
            f"{c['too long']:,} longer than a row {kept}, {c['without a target']:,} left without "
            f"a target dropped; {c['targets']:,} of {c['tokens']:,} tokens are targets "
            f"({c['targets'] / max(1, c['tokens']):.1%})")


def check_lengths(cfg: DataConfig, manifest: dict, val_given: bool) -> None:
    """Both splits must hold at least one row of --seq-len + 1 tokens."""
    seq_len = cfg.seq_len or TEXT_SEQ_LEN
    more_val = "a larger --val-path corpus" if val_given else "a larger --val-fraction"
    splits = {"training": (manifest["train_tokens"], "a larger corpus"),
              "validation": (manifest["val_tokens"], more_val)}
    for name, (n, remedy) in splits.items():
        if n < seq_len + 1:
            raise DataError(f"{name} split has {n} tokens, fewer than --seq-len {seq_len} + 1; "
                            f"use a smaller --seq-len or {remedy}")


def missing_dirs(path: Path) -> list[Path]:
    """The directories that path.mkdir(parents=True) would create, innermost first."""
    missing, p = [], path.absolute()
    while not p.exists():
        missing.append(p)
        p = p.parent
    return missing


def remove_dead_builds(root: Path, prefix: str) -> None:
    """Remove this host's build directories whose process no longer runs (killed by SIGKILL)."""
    for d in root.glob(prefix + "*"):
        try:
            pid = int(d.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            pass


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished build over the cache directory (a stale cache of the same settings, or
    one that a concurrent build has just published, is moved aside and deleted)."""
    for _ in range(3):
        try:
            os.rename(tmp, out)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        aside = out.with_name(f".old-{out.name}-{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(out, aside)
        except FileNotFoundError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(tmp, out)


def prepare_data(cfg: DataConfig) -> None:
    """Build the token cache for cfg (rank 0 only); a no-op for synthetic data and an up-to-date
    cache. Bad input writes nothing: what needs no tokenising is checked first, and the rest is
    built in a private temporary directory, renamed into place when complete and deleted on any
    failure. A file or directory this process may not read or write is DataError (bad input)."""
    try:
        build_if_stale(cfg)
    except PermissionError as e:  # a corpus file, or the cache directory
        raise DataError(f"{e.filename}: {e.strerror}; the corpus must be readable and "
                        "--cache-dir writable by this process") from None


def build_if_stale(cfg: DataConfig) -> None:
    check_config(cfg)
    if cfg.dataset in ("synthetic", "random"):
        return
    train_paths, val_paths, model, inputs = resolve_inputs(cfg)
    out = cache_dir_for(cfg)
    hashes = content_hashes(train_paths + val_paths + ([model] if model else []))
    if manifest := valid_manifest(out, inputs, hashes):
        check_lengths(cfg, manifest, bool(val_paths))
        if cfg.instruct:
            print(examples_summary(cfg, manifest))
        return
    sources = {"train": train_paths, "val": val_paths, "model": model}
    if cfg.instruct:
        check_examples_input(cfg, train_paths + val_paths, model)
    if train_paths[0].suffix == ".bin":
        build = check_token_files
    else:
        build = build_examples if cfg.instruct else build_cache
        sources["parts"] = {split: [part for p in sources[split]
                                    for part in parts_of(p, texts=not cfg.instruct)]
                            for split in ("train", "val")}
        for flag, value, split in (("--dataset", cfg.dataset, "train"),
                                   ("--val-path", cfg.val_path, "val")):
            if not cfg.instruct and sources[split] and not has_text(sources["parts"][split]):
                raise DataError(f"{flag} {value}: the corpus is empty (no text); give files with "
                                "text in them")
    created = missing_dirs(out.parent)
    prefix = f".tmp-{out.name}-{socket.gethostname()}-"
    tmp = out.with_name(f"{prefix}{os.getpid()}")
    try:
        remove_dead_builds(out.parent, prefix)
        tmp.mkdir(parents=True)
        manifest = build(cfg, sources, {"inputs": inputs, "sha256": hashes}, tmp, out)
        check_lengths(cfg, manifest, bool(val_paths))
        publish(tmp, out)
        if cfg.instruct:
            print(examples_summary(cfg, manifest))
    except BaseException as e:  # bad input found mid-build, a full disk, Ctrl-C: leave nothing
        free = None if isinstance(e, (DataError, KeyboardInterrupt)) else free_if_full(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:
            try:
                d.rmdir()
            except OSError:  # not empty: something else is using it now
                break
        if free is not None:  # numpy says "N requested and M written", sentencepiece other things
            raise BuildFailed(f"{os.strerror(errno.ENOSPC)}: the disk of {tmp.parent} is full "
                              f"({free:,} bytes free) while building the token cache; nothing was "
                              "kept: free space, or give --cache-dir on another disk") from None
        raise


def free_if_full(path: Path) -> int | None:
    """The bytes free on path's disk when they are too few to write on (< 1 MiB), else None."""
    existing = next(p for p in [path, *path.parents] if p.exists())
    free = shutil.disk_usage(existing).free
    return free if free < 2**20 else None


def build_cache(cfg, sources: dict, identity: dict, tmp: Path, out: Path) -> dict:
    """Tokenizer (trained unless given), train.bin, val.bin and manifest.json, written into tmp for
    the final directory `out`. `sources`: the training and validation files and their parts, and the
    given tokenizer or None; `identity`: the manifest's inputs and sha256. Returns the manifest."""
    parts, workers = sources["parts"], data_workers(cfg)
    model = sources["model"] or train_tokenizer(cfg, parts["train"], tmp)
    sp = open_tokenizer(model)
    dtype = token_dtype(sp.vocab_size())
    print(f"data: tokenizing {len(sources['train']) + len(sources['val'])} files into {out} with "
          f"{workers} processes")
    with progress(parts["train"] + parts["val"], "tokenising") as bar:
        n_train = write_tokens(sp, model, parts["train"], tmp / "train.bin", workers, bar)
        if parts["val"]:
            n_val = write_tokens(sp, model, parts["val"], tmp / "val.bin", workers, bar)
    if not parts["val"]:
        n_val = held_out(cfg, n_train)
        split_tail(tmp / "train.bin", tmp / "val.bin", dtype, n_train, n_val)
        n_train -= n_val
    digests = data_digests(sources["train"], sources["val"], identity["sha256"], sp, workers)
    settings = ({"type": cfg.tokenizer_type, "vocab_size": cfg.tokenizer_vocab_size}
                if not cfg.tokenizer else {})
    # where the trained one will be after the rename
    tokenizer_path = model if cfg.tokenizer else out / model.name
    manifest = {"format": FORMAT_VERSION, **identity, "tokenizer": settings,
                "tokenizer_path": str(tokenizer_path), "vocab_size": sp.vocab_size(),
                "dtype": np.dtype(dtype).name, "train_tokens": n_train, "val_tokens": n_val,
                "val_fraction": None if parts["val"] else cfg.val_fraction, "digests": digests}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def looks_like_uint32(path: Path, n: int) -> bool:
    """Ids below 65,536 written as uint32 make every second uint16 a zero (the high halves): over
    1,024 pairs or more, a uint16 stream does not look so."""
    head = np.memmap(path, dtype=np.uint16, mode="r", shape=(min(n, 1 << 20) // 2 * 2,))
    return len(head) >= 2048 and not head[1::2].any() and bool(head[0::2].any())


def largest_id(chunk) -> int:
    path, dtype, lo, hi = chunk
    return int(np.memmap(path, dtype=dtype, mode="r", offset=lo * np.dtype(dtype).itemsize,
                         shape=(hi - lo,)).max())


def check_token_files(cfg, sources: dict, identity: dict, tmp: Path, out: Path) -> dict:
    """The manifest of token files written elsewhere (nanoGPT's flat train.bin and val.bin), used
    where they are, not copied. Checked, not trusted: every id must be below the vocabulary, read on
    every core at disk speed."""
    dtype, model = np.dtype(cfg.token_dtype), sources["model"]
    sp = open_tokenizer(model) if model else None
    vocab = sp.vocab_size() if sp else cfg.tokenizer_vocab_size
    if vocab > np.iinfo(dtype).max + 1:  # no uint16 reaches such ids: they would pass unseen
        raise DataError(f"a vocabulary of {vocab:,} tokens does not fit --token-dtype "
                        f"{dtype.name} (ids below {np.iinfo(dtype).max + 1:,}); a tokenizer this "
                        "large writes uint32: pass --token-dtype uint32")
    counts = {}
    for path in sources["train"] + sources["val"]:
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise DataError(f"{path}: {size} bytes is not a whole number of {dtype.name} tokens; "
                            "check --token-dtype (uint16 or uint32)")
        counts[path] = size // dtype.itemsize
        if dtype == np.uint16 and looks_like_uint32(path, counts[path]):
            raise DataError(f"{path} looks like uint32 token ids read as uint16 (every second "
                            "uint16 of its first 1M is 0); pass --token-dtype uint32")
    step = PART_BYTES // dtype.itemsize
    chunks = [(str(p), dtype.name, lo, min(n, lo + step)) for p, n in counts.items()
              for lo in range(0, n, step)]
    print(f"data: checking {sum(counts.values())} tokens of {len(counts)} token files against the "
          f"vocabulary ({vocab})")
    for chunk, top in zip(chunks, in_order(largest_id, chunks, data_workers(cfg))):
        if top >= vocab:
            raise DataError(f"{chunk[0]}: token id {top} is not below the vocabulary size {vocab}; "
                            "give the --tokenizer-vocab-size (or --tokenizer) of the tokenizer "
                            "that wrote it, and its --token-dtype")
    train = sources["train"][0]
    if sources["val"]:
        files = {"train": [str(train), 0, counts[train]],
                 "val": [str(sources["val"][0]), 0, counts[sources["val"][0]]]}
    else:
        n_val = held_out(cfg, counts[train])
        files = {"train": [str(train), 0, counts[train] - n_val],
                 "val": [str(train), counts[train] - n_val, n_val]}
    manifest = {"format": FORMAT_VERSION, **identity, "tokenizer": {},
                "tokenizer_path": str(model or ""), "vocab_size": vocab, "dtype": dtype.name,
                "train_tokens": files["train"][2], "val_tokens": files["val"][2],
                "val_fraction": None if sources["val"] else cfg.val_fraction,
                "digests": data_digests(sources["train"], sources["val"], identity["sha256"], sp,
                                        data_workers(cfg)), "token_files": files}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


RANDOM_ROWS = (4096, 64)  # training and validation rows of --dataset random


def random_tokens(cfg: DataConfig, seed: int) -> Dataset:
    """Uniform random token ids: a benchmark input whose loading costs nothing. Nothing to learn
    beyond the unigram distribution; the loss should sit near log(vocab)."""
    seq_len, vocab = cfg.seq_len or TEXT_SEQ_LEN, cfg.tokenizer_vocab_size
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    train = np.random.default_rng(seed).integers(0, vocab, RANDOM_ROWS[0] * (seq_len + 1),
                                                 dtype=dtype)
    val = np.random.default_rng(SYNTH_VAL_SEED).integers(0, vocab, RANDOM_ROWS[1] * (seq_len + 1),
                                                         dtype=dtype)
    return Dataset(train, val, seq_len, seq_len + 1, vocab, seed)


def open_dataset(cfg: DataConfig, seed: int) -> Dataset:
    """The dataset for cfg, read-only; for text, prepare_data must have built the cache first."""
    check_config(cfg)
    if cfg.dataset == "synthetic":
        train = synthetic_rows(cfg.synthetic_train_samples, np.random.default_rng(seed))
        val = synthetic_rows(cfg.synthetic_val_samples, np.random.default_rng(SYNTH_VAL_SEED))
        return Dataset(train.reshape(-1), val.reshape(-1), SYNTH_ROW - 1, SYNTH_ROW, SYNTH_VOCAB,
                       seed)
    if cfg.dataset == "random":
        return random_tokens(cfg, seed)
    _, val_paths, _, inputs = resolve_inputs(cfg)
    out = cache_dir_for(cfg)
    manifest = valid_manifest(out, inputs)
    if manifest is None:
        raise DataError(f"--dataset {cfg.dataset}: no valid token cache in {out} (missing, or the "
                        "corpus or tokenizer changed); run prepare_data first")
    check_lengths(cfg, manifest, bool(val_paths))
    seq_len, dtype = cfg.seq_len or TEXT_SEQ_LEN, np.dtype(manifest["dtype"])
    train, val = (np.memmap(f, dtype=dtype, mode="r", offset=lo * dtype.itemsize, shape=(n,))
                  for f, lo, n in token_files(out, manifest).values())
    path = manifest["tokenizer_path"]
    sp = open_tokenizer(path) if path else None
    if cfg.instruct:
        marks = (np.memmap(f.with_suffix(".mask"), dtype=np.uint8, mode="r", offset=lo, shape=(n,))
                 for f, lo, n in token_files(out, manifest).values())
        return Dataset(train, val, seq_len, seq_len + 1, manifest["vocab_size"], seed, (sp, path),
                       digests=manifest["digests"], marks=tuple(marks),
                       document_mask=cfg.document_mask)
    return Dataset(train, val, seq_len, seq_len, manifest["vocab_size"], seed, (sp, path),
                   shift_windows=True, digests=manifest["digests"],
                   document_mask=cfg.document_mask, separators=separators(cfg, sp, path))


def separators(cfg: DataConfig, sp, path: str):
    """(BOS or None, separator) ids of a corpus's documents, for --document-mask."""
    if not cfg.document_mask:
        return None, None
    if sp is None:
        raise DataError(f"--document-mask: the token files of --dataset {cfg.dataset} come "
                        "without a tokenizer to say where documents start; give --tokenizer")
    bos, separator = document_marks(sp, path)
    if len(separator) != 1:
        raise DataError(f"--document-mask: the tokenizer {path} separates documents by "
                        f"{len(separator)} tokens, not one end-of-sequence token")
    return (bos or [None])[0], separator[0]


def main(argv=None) -> int:
    """python data.py: build the token cache that train_fsdp.py with the same data flags builds, as
    a CPU job ahead of the training job (docs/data.md)."""
    parser = OneLineParser(
        description="Build the token cache that train_fsdp.py builds for the same data flags (its "
        "[data] section), on this machine's cores, ahead of the training job.")
    parser.add_argument("--config", default="", help="TOML file whose [data] table sets these "
                        "flags, as the trainer's --config (the command line wins)")
    for f in dataclasses.fields(DataConfig):
        kind = ({"action": argparse.BooleanOptionalAction} if isinstance(f.default, bool) else
                {"type": type(f.default), "choices": f.metadata["choices"]})
        parser.add_argument("--" + f.name.replace("_", "-"), default=argparse.SUPPRESS,
                            help=f.metadata["help"], **kind)
    args = vars(parser.parse_args(argv))
    try:
        values = config_data_table(args.pop("config"))
        cfg = DataConfig(**{**values, **args})
        prepare_data(cfg)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the machine's fault (a full disk, a killed worker): one line, exit 1
        print(f"error: {fault_line(e)}", file=sys.stderr)
        return 1
    if cfg.dataset in ("synthetic", "random"):
        print(f"data: --dataset {cfg.dataset} is generated by every run; there is nothing to build")
    else:
        print(f"data: the token cache is ready in {cache_dir_for(cfg)}")
    return 0


def fault_line(e: Exception) -> str:
    if isinstance(e, BuildFailed):
        return str(e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class OneLineParser(argparse.ArgumentParser):
    """Bad flags are one error line and exit 2, as the trainer's."""

    def error(self, message):
        print(f"error: {message} (python data.py --help lists the flags)", file=sys.stderr)
        sys.exit(2)


def config_data_table(path: str) -> dict:
    """The [data] table of a trainer's --config file, checked against DataConfig's fields."""
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f).get("data", {})
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        utf8 = ", TOML files are UTF-8" if isinstance(e, UnicodeDecodeError) else ""
        raise DataError(f"--config {path}: not valid TOML{utf8} ({e})") from None
    fields = {f.name: f for f in dataclasses.fields(DataConfig)}
    for key, value in table.items():
        if key not in fields:
            raise DataError(f"--config {path}: [data] has no setting '{key}'; valid: "
                            f"{', '.join(fields)}")
        want = type(fields[key].default)
        if not isinstance(value, want) or isinstance(value, bool) != (want is bool):
            if not (want is float and isinstance(value, int)):
                raise DataError(f"--config {path}: [data] {key} = {value!r} must be a "
                                f"{want.__name__}")
    return table


if __name__ == "__main__":
    # As the module `data`: what the worker processes send back (a DataError) is then pickled by a
    # name that this process can import, whatever runs it (it would be __main__.DataError).
    import data
    sys.exit(data.main())
