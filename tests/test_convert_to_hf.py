"""convert_to_hf.py with the real transformers: a baseline trained a few steps on text converts to a
directory that AutoModelForCausalLM and AutoTokenizer load with no custom code, and it computes
what this project's model computes (fp32 logits within 1e-4, the same greedy tokens) from the
same ids as the run's SentencePiece tokenizer. Bad input: one line, exit 2, nothing written.

One launch of 2 gloo processes trains every run: `char` (FSDP1, char tokenizer, tied embeddings,
GQA, another --norm-eps), `bpe` (FSDP2, BPE tokenizer, untied, no GQA, --vocab-size padded past
the tokenizer's, another --rope-theta), `synthetic` (the built-in task's alphabet, its vocabulary
padded to 32) and `free` (a Free Transformer, to be refused). The text runs save at steps 2
(sharded only) and 4 (sharded plus the consolidated model.pt), so both reading paths are converted.
"""
import json
import os
import random
import shutil
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import script_runner  # noqa: E402

import convert_to_hf  # noqa: E402
import data as data_lib  # noqa: E402
import sample  # noqa: E402
import train_fsdp  # noqa: E402
from test_distributed import clean_env, launch  # noqa: E402

transformers = pytest.importorskip("transformers")  # .ci/run installs it: the tests run there

TEXT = ["--seq-len", "32", "--max-steps", "4", "--save-every", "2"]
RUNS = {"char": TEXT + ["--tokenizer-type", "char", "--n-kv-head", "1", "--tie-embeddings", "--norm-eps", "1e-6"],
        "bpe": TEXT + ["--strategy", "fsdp2", "--tokenizer-vocab-size", "400", "--vocab-size", "408",
                       "--rope-theta", "500"],
        "synthetic": ["--max-steps", "2"],
        "free": ["--arch", "free", "--latent-bits", "4", "--max-steps", "1"]}
# Spaces (leading, trailing, doubled), newlines, a tab and characters the corpus never has
# (unknown to the char tokenizer, UTF-8 bytes to BPE/unigram); the last one spells special pieces.
PROBES = ["Kalo  mi\n\nthe vi, sa! Quzz toru.", "  leading and trailing  ", "\n \n\n", "tab\tthere",
          "é中🙂 ü", "", "a<s>b</s>c<unk>d<0x41>"]


def corpus_text(n_lines=600, seed=0):
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "the", "and", "ing", "er", "qu", "x", "zz"]
    lines = []
    for _ in range(n_lines):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(3, 10))]
        lines.append(rng.choice([" ", " ", "  ", ", ", ". "]).join(words).capitalize() + rng.choice(".!? "))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("convert_to_hf")
    corpus = tmp / "corpus.txt"
    corpus.write_text(corpus_text())
    spec = {name: (["--dataset", str(corpus)] + args if args[:1] == TEXT[:1] else args) for name, args in RUNS.items()}
    return {name: Path(run_dir) for name, (_, _, run_dir) in launch(tmp, 2, spec, "hf").items()} | {"tmp": tmp}


def step(run_dir, n):
    return str(run_dir / "checkpoints" / f"step_{n:07d}")


@pytest.fixture(scope="module")
def converted(runs):
    """{name: (checkpoint, OUT_DIR)}: char's step 2 through the command line (FSDP1 DCP shards),
    bpe's step 2 (FSDP2 DCP shards) and latest (step 4: model.pt) in this process."""
    out = {name: runs["tmp"] / f"converted-{name}" for name in ("char", "bpe", "bpe_full", "synthetic")}
    res = script_runner.run("convert_to_hf.py", [step(runs["char"], 2), out["char"]], ROOT, clean_env())
    assert res.returncode == 0 and res.stdout.startswith(f"wrote {out['char']}"), res.stdout + res.stderr
    assert convert_to_hf.run([step(runs["bpe"], 2), str(out["bpe"])]) == 0
    assert convert_to_hf.run([str(runs["bpe"] / "checkpoints" / "latest"), str(out["bpe_full"])]) == 0
    assert convert_to_hf.run([step(runs["synthetic"], 2), str(out["synthetic"])]) == 0
    return {"char": (step(runs["char"], 2), out["char"]), "bpe": (step(runs["bpe"], 2), out["bpe"]),
            "bpe_full": (step(runs["bpe"], 4), out["bpe_full"]), "synthetic": (step(runs["synthetic"], 2),
                                                                               out["synthetic"])}


def project_model(ckpt):
    """The reference: this project's model from the checkpoint's consolidated model.pt, written
    by the trainer's own --export where the step has none (after convert_to_hf.py read the shards)."""
    if not os.path.exists(os.path.join(ckpt, "model.pt")):
        exported = script_runner.run("train_fsdp.py", ["--export", ckpt], ROOT, clean_env())
        assert exported.returncode == 0, exported.stderr[-3000:]
    return sample.load_model(ckpt, "cpu")


@pytest.mark.parametrize("name", ["char", "bpe", "bpe_full", "synthetic"])
def test_converted_model_computes_what_the_project_model_computes(converted, name):
    ckpt, out = converted[name]
    ours, saved = project_model(ckpt)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    sp = data_lib.load_tokenizer(saved["tokenizer"])  # None for the synthetic task
    assert type(theirs).__name__ == "LlamaForCausalLM" and theirs.dtype == torch.float32
    assert theirs.config.tie_word_embeddings == ours.cfg.tie_embeddings
    assert (theirs.config.num_key_value_heads, theirs.config.vocab_size) == (ours.cfg.n_kv_head, ours.cfg.vocab_size)
    texts = ([corpus_text(40, seed=1)[:300], PROBES[0] + PROBES[1]] if sp else
             ["\nK>__KKKKKKKK____!_____", "\nB>____!__BBBBBBBB___"])
    ids = [data_lib.encode(sp, t)[:20] for t in texts]
    assert [tok.encode(t)[:20] for t in texts] == ids and tok.decode(ids[0]) == data_lib.decode(sp, ids[0])
    if sp is None:  # a character outside the task's alphabet is <unk> at the first padding id, not dropped
        assert tok.encode("K?") == [data_lib.encode(None, "K")[0], len(data_lib.SYNTH_CHARS)]
    x = torch.tensor(ids)
    with torch.no_grad():
        ref = ours(x)[0]
        got = theirs(x).logits
    assert got.shape == ref.shape and ref.std() > 0.1
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    greedy, _ = ours.generate(x, 12, temperature=0)
    # eos_token_id=None: this project's generate does not stop at EOS, so neither does theirs here.
    hf_greedy = theirs.generate(x, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert hf_greedy.tolist() == greedy.tolist()


def check_ids(out, sp_path, probes):
    tok = transformers.AutoTokenizer.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=sp_path)
    for text in probes:
        ids = sp.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == sp.decode(ids), text
    assert len(tok) == sp.vocab_size() and tok.bos_token is None and tok.eos_token_id == sp.eos_id()


@pytest.mark.parametrize("name", ["char", "bpe"])
def test_converted_tokenizer_gives_the_runs_ids(converted, name):
    ckpt, out = converted[name]
    check_ids(out, train_fsdp.check_checkpoint(ckpt)["tokenizer"], PROBES + [corpus_text(60, seed=2)])


def test_unigram_tokenizer_gives_the_same_ids(runs):
    """No run needed: data.py's unigram tokenizer on the same corpus, converted alone. HF's Unigram
    matches a control or byte piece spelled in the text (convert_to_hf.sentencepiece_tokenizer says
    so): the last probe is left out."""
    tmp = runs["tmp"]
    cfg = data_lib.DataConfig(dataset=str(tmp / "corpus.txt"), tokenizer_type="unigram", tokenizer_vocab_size=400)
    (tmp / "unigram").mkdir()
    model = data_lib.train_tokenizer(cfg, data_lib.parts_of(tmp / "corpus.txt"), tmp / "unigram")
    convert_to_hf.hf_tokenizer(str(model)).save_pretrained(tmp / "hf-unigram")
    check_ids(tmp / "hf-unigram", str(model), PROBES[:-1] + [corpus_text(60, seed=2)])


def test_bad_input_one_line_exit_2_nothing_written(runs, tmp_path, capsys, monkeypatch):
    (tmp_path / "not_a_checkpoint").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    free = step(runs["free"], 1)
    cases = {("Free Transformer", "python train_fsdp.py --export"): [free, str(tmp_path / "o1")],
             ("not a checkpoint directory",): [str(tmp_path / "not_a_checkpoint"), str(tmp_path / "o2")],
             ("is a run directory",): [str(runs["bpe"]), str(tmp_path / "o3")],
             ("not an empty directory",): [step(runs["bpe"], 4), str(tmp_path / "full")],
             ("usage",): [step(runs["bpe"], 4)]}
    before = sorted(os.listdir(free)), sorted(os.listdir(step(runs["bpe"], 4))), sorted(os.listdir(tmp_path))
    for expected, argv in cases.items():
        assert convert_to_hf.run(argv) == 2, expected
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and all(e in err for e in expected), err
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    assert convert_to_hf.run([step(runs["bpe"], 4), str(tmp_path / "o4")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install transformers safetensors" in err, err
    after = sorted(os.listdir(free)), sorted(os.listdir(step(runs["bpe"], 4))), sorted(os.listdir(tmp_path))
    assert after == before


def one_error_line(capsys, *expected):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and all(e in err for e in expected), err


def test_a_full_disk_is_one_line_exit_1_and_nothing_left(runs, tmp_path, capsys, monkeypatch):
    """safetensors fails mid-file with its own error type (not OSError), as on a full disk."""
    import safetensors
    import safetensors.torch

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"\0" * 100)
        raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                          'message: "No space left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty"):
        assert convert_to_hf.run([step(runs["bpe"], 4), str(out)]) == 1
        one_error_line(capsys, f"cannot write {out}", "No space left on device", "nothing was written")
        assert sorted(os.listdir(tmp_path)) == ["empty"] and os.listdir(tmp_path / "empty") == []


def test_a_checkpoint_of_your_own_model_is_refused_in_one_line(runs, tmp_path, capsys):
    """A run of the user's own model (run(build_model=...)) records its own settings in the
    config's model section, or none, and no `arch`; its own data no `dataset`."""
    sections = {"none": {"model": {}}, "own settings": {"model": {"n_embd": 48, "n_layer": 2}},
                "own data": {"data": {}}}
    for name, section in sections.items():
        ckpt = tmp_path / name / "step_0000004"
        shutil.copytree(step(runs["bpe"], 4), ckpt)
        meta = json.loads((ckpt / "meta.json").read_text())
        meta["config"].update(section)
        (ckpt / "meta.json").write_text(json.dumps(meta))
        assert convert_to_hf.run([str(ckpt), str(tmp_path / name / "hf")]) == 2, name
        one_error_line(capsys, "converts only this project's baseline model")
        assert sorted(os.listdir(tmp_path / name)) == ["step_0000004"]


def test_out_dir_a_symlink_to_an_empty_directory_is_written_through(runs, tmp_path):
    target, link = tmp_path / "target", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    assert convert_to_hf.run([step(runs["synthetic"], 2), str(link)]) == 0
    assert link.is_symlink() and link.resolve() == target
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(target))
    assert sorted(os.listdir(tmp_path)) == ["link", "target"]
    assert type(transformers.AutoModelForCausalLM.from_pretrained(link)).__name__ == "LlamaForCausalLM"
