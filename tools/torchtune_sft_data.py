"""Synthetic instruction data and a byte-level BPE tokenizer for the torchtune-vs-ours SFT benchmark
(tools/torchtune_sft_gpu.sh). Offline, deterministic by seed, needs only the `tokenizers` package.

    python3 tools/torchtune_sft_data.py OUT_DIR [--rows 4000] [--seed 0] [--vocab 32000] [--tokenizer-dir DIR]
                                        [--jsonl PATH]

Writes OUT_DIR/sft.jsonl (or --jsonl PATH), one {"prompt": ..., "completion": ...} a line (prompts 20-400 words,
completions 20-600 words of random English-like words, so that an example stays well under 2048
tokens and several pack into a row), and a tokenizer trained on that text: tokenizer.json (byte-level
BPE, special tokens <|begin_of_text|>, <|end_of_text|>, <|eot_id|>, <|finetune_right_pad_id|>) and
tokenizer_config.json (bos_token, eos_token, pad_token) in --tokenizer-dir (default OUT_DIR).

The tokenisation both trainers must use for one row is `tokenize_row`:
    tokens = [BOS] + ids(prompt) + ids(completion) + [EOS]
    labels = [-100] * (1 + len(ids(prompt))) + ids(completion) + [EOS]
(labels aligned with tokens, unshifted; the trainer shifts; -100 is the ignore index), each text
encoded on its own by tokenizer.json with no special tokens added, truncated to max_seq_len.
"""
import argparse
import json
import os
import random

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>"]
BOS, EOS, EOT, PAD = SPECIALS
IGNORE_INDEX = -100

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y",
           "z", "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "pl", "pr", "sc", "sh", "sl", "sp", "st",
           "str", "th", "tr", "wh"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "oo", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt", "ss", "th"]
_FUNCTION = ["the", "of", "and", "to", "a", "in", "is", "that", "for", "it", "as", "with", "was", "on",
             "be", "by", "this", "are", "or", "from", "at", "which", "an", "not", "but", "have", "we", "can"]


def make_lexicon(rng, n=20000):
    """n distinct pseudo-words of 1-4 syllables; Zipf-like weights; common English function words first."""
    words, seen = list(_FUNCTION), set(_FUNCTION)
    while len(words) < n:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                    for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4))))
        if 2 <= len(w) <= 14 and w not in seen:
            seen.add(w)
            words.append(w)
    weights = [1.0 / (k + 2) ** 1.05 for k in range(n)]
    return words, weights


def text(rng, lexicon, n_words):
    """n_words words in sentences of 4-24 words: capitalised, commas, '.', '?' or '!' at the end."""
    words, weights = lexicon
    picked = rng.choices(words, weights, k=n_words)
    out, start = [], True
    left = rng.randint(4, 24)
    for i, w in enumerate(picked):
        if start:
            w = w.capitalize()
            start = False
        left -= 1
        if left == 0 or i == n_words - 1:
            w += rng.choice(".....?!")
            start, left = True, rng.randint(4, 24)
        elif rng.random() < 0.06:
            w += ","
        out.append(w)
    return " ".join(out)


def make_rows(rows, seed):
    rng = random.Random(seed)
    lexicon = make_lexicon(random.Random(seed + 1_000_003))
    for _ in range(rows):
        prompt = text(rng, lexicon, rng.randint(20, 400))
        completion = text(rng, lexicon, rng.randint(20, 600))
        yield {"prompt": prompt, "completion": completion}


def train_tokenizer(texts, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer_config(out_dir, max_len=131072):
    cfg = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": True,
           "model_max_length": max_len,
           "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)


def special_ids(tok):
    """{'bos': id, 'eos': id, 'eot': id, 'pad': id} of a tokenizers.Tokenizer built here."""
    return {k: tok.token_to_id(t) for k, t in zip(("bos", "eos", "eot", "pad"), SPECIALS)}


def tokenize_row(tok, row, bos_id, eos_id, max_seq_len=None):
    """(tokens, labels) of one {"prompt", "completion"} row: see the module's docstring."""
    p = tok.encode(row["prompt"], add_special_tokens=False).ids
    c = tok.encode(row["completion"], add_special_tokens=False).ids
    tokens = [bos_id] + p + c + [eos_id]
    labels = [IGNORE_INDEX] * (1 + len(p)) + c + [eos_id]
    if max_seq_len is not None and len(tokens) > max_seq_len:
        tokens, labels = tokens[:max_seq_len], labels[:max_seq_len]
    return tokens, labels


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokenizer-dir", default="")
    ap.add_argument("--jsonl", default="", help="the JSONL's path (default OUT/sft.jsonl)")
    ap.add_argument("--max-seq-len", type=int, default=2048, help="only for the statistics printed")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tok_dir = args.tokenizer_dir or args.out
    os.makedirs(tok_dir, exist_ok=True)
    rows = list(make_rows(args.rows, args.seed))
    path = args.jsonl or os.path.join(args.out, "sft.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    tok = train_tokenizer((t for r in rows for t in (r["prompt"], r["completion"])), args.vocab)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    write_tokenizer_config(tok_dir)
    ids = special_ids(tok)
    lens, trained = [], 0
    for r in rows:
        t, lab = tokenize_row(tok, r, ids["bos"], ids["eos"])
        lens.append(len(t))
        trained += sum(x != IGNORE_INDEX for x in lab)
    over = sum(n > args.max_seq_len for n in lens)
    print(f"data: {path} rows={len(rows)} tokens={sum(lens)} mean={sum(lens) / len(lens):.0f} "
          f"max={max(lens)} over_{args.max_seq_len}={over} trained_fraction={trained / sum(lens):.3f}; "
          f"tokenizer: {tok_dir}/tokenizer.json vocab={tok.get_vocab_size()} specials={ids}")


if __name__ == "__main__":
    main()
