"""Instruction fine-tuning (--instruct) and document masking (--document-mask): the answers are
the only targets, with masks built the same on any number of processes; packed examples do not see
each other; the loss is the mean over every target of the step, so FSDP1, FSDP2, DDP and one
process, and accumulation 1 against 4, give the same losses (fp32, 1e-5) on examples of unequal
length; bad rows are one error line naming the file and line, and nothing is written.
"""
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
import model as model_lib  # noqa: E402
from test_distributed import assert_same_run, clean_env, launch  # noqa: E402
from test_trackers import missing_packages  # noqa: E402

pytest.importorskip("jinja2", reason="pip install jinja2 (.ci/run does)")

WORDS = "the a cat dog sat ran on under mat big small red blue what why how then".split()
SEQ = 160


def words(rng, lo, hi):
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def examples(rng, n, long_every=0):
    """Rows of both kinds, of unequal lengths (prompts of 1-12 words, answers of 1-8); every
    long_every-th a prompt longer than a row."""
    rows = []
    for i in range(n):
        if i % 3 == 0:
            rows.append({"messages": [{"role": "system", "content": "be short"},
                                      {"role": "user", "content": words(rng, 1, 3)},
                                      {"role": "assistant", "content": words(rng, 1, 3)},
                                      {"role": "user", "content": words(rng, 1, 2)},
                                      {"role": "assistant", "content": words(rng, 1, 2)}]})
        else:
            long = long_every and i % long_every == 0
            rows.append({"prompt": words(rng, 40, 50) if long else words(rng, 1, 12),
                         "completion": " " + words(rng, 1, 8)})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A character tokenizer (data.py's own, trained on a small corpus) and example files."""
    tmp = tmp_path_factory.mktemp("sft")
    rng = random.Random(0)
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(words(rng, 5, 15) + ".\n" for _ in range(300)) + "System: User: Assistant:\n")
    cfg = data.DataConfig(dataset=str(corpus), tokenizer_type="char", tokenizer_vocab_size=64, seq_len=32,
                          cache_dir=str(tmp / "cache"))
    data.prepare_data(cfg)
    tokenizer = next((tmp / "cache").glob("*/tokenizer.model"))
    train = write_jsonl(tmp / "train.jsonl", examples(rng, 240, long_every=20))
    val = write_jsonl(tmp / "val.jsonl", examples(rng, 40))
    return {"tmp": tmp, "tokenizer": str(tokenizer), "train": str(train), "val": str(val)}


def build(sft, cache, **kw):
    cfg = data.DataConfig(**{"dataset": sft["train"], "val_path": sft["val"], "seq_len": SEQ,
                             "tokenizer": sft["tokenizer"], "instruct": True, "cache_dir": str(cache), **kw})
    data.prepare_data(cfg)
    return data.open_dataset(cfg, 0)


def all_rows(ds, split="train"):
    n = ds.n_train if split == "train" else ds.n_val
    if split == "train":
        return ds.windows(ds.train_tokens, np.arange(n) * ds.stride, ds.train_marks)
    return ds.val_batch(0, n)


def test_the_answers_are_the_only_targets(sft, tmp_path):
    ds = build(sft, tmp_path / "c")
    sp = ds.sp
    x, y = all_rows(ds, "val")
    rows = [json.loads(line) for line in Path(sft["val"]).read_text().splitlines()]
    eos, nl = sp.eos_id(), sp.encode("\n")
    for row, xs, ys in zip(rows, x.tolist(), y.tolist()):  # one example a row, in order
        targets = [t for t in ys if t != data.IGNORE]
        if "completion" in row:
            assert targets == sp.encode(row["completion"]) + [eos]
            assert sp.decode(xs[:len(sp.encode(row["prompt"]))]) == row["prompt"]
        else:  # the plain template: each assistant turn and its end of turn, nothing else
            answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
            assert targets == sum((sp.encode(a) + [eos] + nl for a in answers), [])


def test_masks_are_the_same_on_any_number_of_processes(sft, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "PART_BYTES", 500)  # many parts, cut inside the files
    one = build(sft, tmp_path / "one", data_workers=1)
    three = build(sft, tmp_path / "three", data_workers=3)
    assert len(data.parts_of(Path(sft["train"]))) > 5
    for a, b in ((one.train_tokens, three.train_tokens), (one.train_marks, three.train_marks),
                 (one.val_marks, three.val_marks)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_packed_rows_hold_the_same_targets_and_restart_positions(sft, tmp_path):
    padded = build(sft, tmp_path / "padded")
    packed = build(sft, tmp_path / "packed", document_mask=True)
    assert packed.n_train < padded.n_train / 2
    x, y, pos = all_rows(packed)
    xp, yp = all_rows(padded)
    # Every example's targets, in order: the same whether packed or one a row.
    assert [t for t in y.flatten().tolist() if t >= 0] == [t for t in yp.flatten().tolist() if t >= 0]
    starts = (packed.train_marks[np.arange(packed.n_train)[:, None] * packed.stride
                                 + np.arange(SEQ)] & data.START) > 0
    starts[:, 0] = True  # a row's first token starts its padding, or an example
    assert np.array_equal(pos.numpy() == 0, starts)
    # No example's first token is a target: the example before it never learns across.
    assert not ((y.numpy() != data.IGNORE)[:, :-1] & starts[:, 1:]).any()


def test_parquet_and_a_directory_of_shards_give_the_same_rows_as_one_jsonl_file(sft, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pip install pyarrow (.ci/run does)")
    import pyarrow as pa
    rows = [json.loads(line) for line in Path(sft["train"]).read_text().splitlines()]
    prompts = [r for r in rows if "prompt" in r]
    chats = [r for r in rows if "messages" in r]
    write_jsonl(tmp_path / "one.jsonl", prompts + chats)
    pq.write_table(pa.Table.from_pylist(prompts), tmp_path / "prompts.parquet", row_group_size=50)
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "shards_chats.parquet")
    shards = tmp_path / "shards"
    shards.mkdir()
    (tmp_path / "prompts.parquet").rename(shards / "a.parquet")
    (tmp_path / "shards_chats.parquet").rename(shards / "b.parquet")
    one = build(sft, tmp_path / "c1", dataset=str(tmp_path / "one.jsonl"), document_mask=True)
    parquet = build(sft, tmp_path / "c2", dataset=str(shards), document_mask=True)
    for a, b in ((one.train_tokens, parquet.train_tokens), (one.train_marks, parquet.train_marks)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    bad = prompts[:60]
    bad[55] = {"prompt": "hi", "completion": ""}
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet", row_group_size=20)
    r = data_py(["--dataset", str(tmp_path / "bad.parquet"), "--instruct", "--tokenizer", sft["tokenizer"],
                 "--cache-dir", "cache"], tmp_path)
    assert r.returncode == 2 and r.stderr == f"error: {tmp_path / 'bad.parquet'} row 55: the completion is empty; " \
        "every example needs an answer\n", r.stderr


def test_a_run_saved_before_these_settings_resumes(tmp_path):
    """Runs saved before --instruct existed have no such [data] fields: they ran with them off."""
    out = tmp_path / "run"
    base = [sys.executable, os.path.join(ROOT, "train_fsdp.py"), "--arch", "baseline", "--n-layer", "2", "--d-model",
            "32", "--n-head", "2", "--global-batch", "4", "--eval-every", "0", "--eval-samples", "4", "--out-dir",
            str(out), "--cache-dir", str(tmp_path / "cache")]
    run = dict(cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert subprocess.run(base + ["--max-steps", "2"], **run).returncode == 0
    for meta in [out / "config.json", *out.glob("checkpoints/step_*/meta.json")]:
        saved = json.loads(meta.read_text())
        config = saved.get("config", saved)
        for key in ("instruct", "document_mask", "too_long"):
            del config["data"][key]
        meta.write_text(json.dumps(saved))
    r = subprocess.run(base + ["--max-steps", "3"], **run)
    assert r.returncode == 0 and "resumed from" in r.stdout and "changed on resume: data" not in r.stdout, r.stderr


def test_too_long_examples_are_truncated_or_dropped_and_counted(sft, tmp_path, capsys):
    build(sft, tmp_path / "t", seq_len=60)
    truncated = capsys.readouterr().out
    build(sft, tmp_path / "d", seq_len=60, too_long="drop")
    dropped = capsys.readouterr().out
    assert "longer than a row truncated" in truncated and "longer than a row dropped" in dropped
    numbers = [[int(n.replace(",", "")) for n in re.search(
        r"data: ([\d,]+) examples .*; ([\d,]+) longer than a row \w+, ([\d,]+) left without", out).groups()]
        for out in (truncated, dropped)]
    assert numbers[0][1] == numbers[1][1] >= 8  # the long prompts, and chats longer than 60 tokens
    # Dropped: none kept. Truncated: kept, except those whose answer was cut off entirely.
    assert numbers[0][0] - numbers[1][0] == numbers[1][1] - numbers[0][2] > 0
    assert numbers[1][2] == 0


def test_packed_documents_do_not_see_each_other_and_restart_rope():
    cfg = model_lib.resolve_model_config(model_lib.ModelConfig(arch="free", vocab_size=50, n_kv_head=2,
                                                               latent_bits=4))
    torch.manual_seed(0)
    m = model_lib.build_model(cfg).eval()
    a, b = torch.randint(0, 50, (1, 7)), torch.randint(0, 50, (1, 5))
    z = torch.randint(0, 16, (1, 12))
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    packed, _ = m(torch.cat([a, b], 1), z=z, positions=positions)
    alone = [m(a, z=z[:, :7])[0], m(b, z=z[:, 7:])[0]]
    torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=1e-5, atol=1e-5)
    # The encoder too: its Z of b's tokens is read from b alone.
    cos, sin, (mask, enc_mask) = m.layout(torch.cat([a, b], 1), None, positions)
    h = m.tok_emb(torch.cat([a, b], 1))
    for block in m.blocks[:2]:
        h = block(h, cos, sin, mask=mask)
    torch.testing.assert_close(m.latent.encoder(h, cos, sin, enc_mask)[:, 7:], m.encoder_logits(b),
                               rtol=1e-5, atol=1e-5)


def test_a_corpus_restarts_positions_after_each_separator(sft, tmp_path):
    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"text": words(random.Random(i), 3, 9)} for i in range(60)])
    cfg = data.DataConfig(dataset=str(corpus), tokenizer=sft["tokenizer"], seq_len=32, document_mask=True, val_fraction=0.2,
                          cache_dir=str(tmp_path / "c"))
    data.prepare_data(cfg)
    ds = data.open_dataset(cfg, 0)
    x, y, pos = ds.train_batch(0, 4, 0, 4)
    eos = ds.sp.eos_id()
    after = torch.zeros_like(x, dtype=torch.bool)
    after[:, 1:] = x[:, :-1] == eos
    after[:, 0] = True
    assert ((pos == 0) == after).all() and (y != data.IGNORE).all()
    plain = data.open_dataset(data.DataConfig(**{**cfg.__dict__, "document_mask": False}), 0)
    assert all(torch.equal(p, q) for p, q in zip(plain.train_batch(0, 4, 0, 4), (x, y)))


@pytest.fixture(scope="module")
def runs(sft, tmp_path_factory):
    """The same global batch of unequal examples on 1 and 2 processes, every strategy."""
    tmp = tmp_path_factory.mktemp("runs")
    sft_args = ["--dataset", sft["train"], "--val-path", sft["val"], "--instruct", "--tokenizer", sft["tokenizer"],
                "--seq-len", str(SEQ), "--eval-every", "5"]
    packed = sft_args + ["--document-mask"]
    one = launch(tmp, 1, {"none": ["--strategy", "none"] + sft_args,
                          "none_accum4": ["--strategy", "none", "--micro-batch", "2"] + sft_args,
                          "packed": ["--strategy", "none"] + packed,
                          "packed_compiled": ["--strategy", "none", "--compile", "--activation-checkpointing"]
                          + packed}, "one")
    two = launch(tmp, 2, {"fsdp": sft_args, "fsdp2": ["--strategy", "fsdp2"] + sft_args,
                          "ddp": ["--strategy", "ddp"] + sft_args,
                          "fsdp_accum": ["--micro-batch", "1"] + sft_args,
                          "fsdp2_accum": ["--strategy", "fsdp2", "--micro-batch", "2"] + sft_args,
                          "fsdp2_packed": ["--strategy", "fsdp2", "--micro-batch", "2"] + packed}, "two")
    return {**one, **two}


@pytest.mark.parametrize("name", ["none_accum4", "fsdp", "fsdp2", "ddp", "fsdp_accum", "fsdp2_accum"])
def test_every_strategy_and_accumulation_give_the_same_losses(runs, name):
    assert_same_run(runs[name], runs["none"])
    assert runs[name][1]["val_loss"] == pytest.approx(runs["none"][1]["val_loss"], rel=1e-5)


def test_packed_rows_give_the_same_losses_on_two_processes_and_compiled(runs):
    assert_same_run(runs["fsdp2_packed"], runs["packed"])
    assert_same_run(runs["packed_compiled"], runs["packed"], rel=1e-4, norm_rel=1e-3)


def test_sample_chat_renders_the_prompt_and_prints_replies(sft, runs):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), "--ckpt", runs["none"][2], "--chat",
                        "--prompt", "the cat", "--num-samples", "3", "--max-new-tokens", "12", "--temperature", "0",
                        "--device", "cpu"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) == 3, r.stderr[-2000:]
    assert "User:" not in r.stdout  # the replies alone, not the rendered prompt


def test_the_loss_is_the_mean_over_the_targets_of_the_validation_answers(sft, runs):
    """The final validation loss, recomputed by hand from the saved model: the mean CE over every
    answer token of the validation rows, not a mean of the micro-batches' (2 rows) means."""
    run_dir = runs["none_accum4"][2]
    ckpt = torch.load(next(Path(run_dir, "checkpoints").glob("step_*/model.pt")), weights_only=True)
    m = model_lib.build_model(model_lib.ModelConfig(**ckpt["config"]["model"]))
    m.load_state_dict(ckpt["model"])
    m.eval()
    ds = data.open_dataset(data.DataConfig(**ckpt["config"]["data"]), 0)
    x, y = ds.val_batch(0, 16)
    with torch.no_grad():
        logits, _ = m(x)
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=data.IGNORE)
    per_micro = torch.stack([F.cross_entropy(lr.flatten(0, 1), yr.flatten(), ignore_index=data.IGNORE)
                             for lr, yr in zip(logits.split(2), y.split(2))])
    assert runs["none_accum4"][1]["val_loss"] == pytest.approx(ce.item(), rel=1e-5)
    assert abs(per_micro.mean().item() - ce.item()) > 2e-5 * ce.item()  # twice the tolerance: they differ


def data_py(args, cwd):
    return subprocess.run([sys.executable, os.path.join(ROOT, "data.py"), *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=300)


BAD_ROWS = {
    "no_fields": ({"question": "hi"}, 'not an example; each row needs "prompt" and "completion"'),
    "empty_completion": ({"prompt": "hi", "completion": "  "}, "the completion is empty"),
    "unknown_role": ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]},
                     "role 'robot'"),
    "no_answer": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_bad_row_is_one_line_naming_file_and_line_and_writes_nothing(sft, tmp_path, case):
    row, message = BAD_ROWS[case]
    good = examples(random.Random(1), 6)
    path = write_jsonl(tmp_path / "bad.jsonl", good[:4] + [row] + good[4:])
    r = data_py(["--dataset", str(path), "--instruct", "--tokenizer", sft["tokenizer"], "--cache-dir", "cache"],
                tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path} line 5: ") and message in lines[0], lines
    assert not (tmp_path / "cache").exists()


def test_without_jinja2_instruct_is_one_line_and_writes_nothing(sft, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_fsdp.py"), "--dataset", sft["train"], "--instruct",
                        "--tokenizer", sft["tokenizer"], "--cache-dir", "cache", "--out-dir", str(out)],
                       cwd=tmp_path, env=missing_packages(tmp_path, "jinja2"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == ("error: --instruct renders chats with jinja2, which is not "
                                                      "installed: pip install jinja2"), r.stderr[-2000:]
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_a_template_that_fails_and_a_shard_without_targets_are_refused(sft, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.model").write_bytes(Path(sft["tokenizer"]).read_bytes())
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role here') }}{% endif %}x"
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    path = write_jsonl(tmp_path / "chat.jsonl", examples(random.Random(2), 4))
    r = data_py(["--dataset", str(path), "--instruct", "--tokenizer", str(model_dir / "tokenizer.model"),
                 "--cache-dir", "cache"], tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"{path} line 1: the chat template failed on this row" in r.stderr and "no system role here" in r.stderr
    # Every answer of this shard lies past --seq-len: no target is left in it.
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x " * 80, "completion": " y"}] * 3)
    r = data_py(["--dataset", str(long), "--val-path", sft["val"], "--instruct", "--tokenizer", sft["tokenizer"],
                 "--seq-len", "32", "--cache-dir", "cache"], tmp_path)
    assert r.returncode == 2 and f"error: {long}: no example keeps a target token" in r.stderr, r.stderr
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    r = data_py(["--dataset", str(blank), "--val-path", sft["val"], "--instruct", "--tokenizer", sft["tokenizer"],
                 "--cache-dir", "cache"], tmp_path)
    assert r.returncode == 2 and r.stderr == f"error: {blank}: the file holds no examples (blank lines at most); " \
        "give rows of examples, or remove it\n", r.stderr
    assert not (tmp_path / "cache").exists()


def test_a_models_chat_template_renders_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers", reason="pip install transformers (.ci/run does)")
    pytest.importorskip("tokenizers", reason="pip install tokenizers (.ci/run does)")
    from test_hf import byte_bpe
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    texts = [words(random.Random(i), 5, 20) for i in range(200)]
    tok = byte_bpe(texts, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": chatml, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    messages = examples(random.Random(3), 1)[0]["messages"]
    data.start_examples_worker(str(tmp_path / "tokenizer.json"))
    ours, marks = data.example_ids({"messages": messages}, lambda: "row")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours == hf.apply_chat_template(messages, tokenize=True, return_dict=False)
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    targets = [i for i, target in zip(ours, marks) if target]
    assert targets.count(im_end) == 2  # each assistant turn ends its target with <|im_end|>
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert hf.decode(targets) == "".join(a + "<|im_end|>\n" for a in answers)
    prompt, stop = data.chat_prompt(str(tmp_path / "tokenizer.json"), messages[:2])
    assert prompt == hf.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    assert stop == {im_end}


def test_generation_stops_once_every_row_ended_its_turn():
    cfg = model_lib.resolve_model_config(model_lib.ModelConfig(arch="baseline", vocab_size=30))
    torch.manual_seed(0)
    m = model_lib.build_model(cfg).eval()
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    full, _ = m.generate(prompt, 12, temperature=0)
    first = [row[3:].index(row[5]) for row in full.tolist()]  # where each row's third token first is
    stop = {full[0, 5].item(), full[1, 5].item()}
    ends = [min(row[3:].index(t) for t in stop if t in row[3:]) for row in full.tolist()]
    early, _ = m.generate(prompt, 12, temperature=0, stop=stop)
    assert early.shape[1] == 3 + max(ends) + 1 < full.shape[1] or max(first) == 9  # ended at the later row
    assert torch.equal(early, full[:, :early.shape[1]])


def test_a_new_chat_template_rebuilds_the_cache_and_a_resume_sees_it(sft, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.model").write_bytes(Path(sft["tokenizer"]).read_bytes())
    cfg = data.DataConfig(dataset=sft["val"], val_path=sft["val"], tokenizer=str(model_dir / "tokenizer.model"),
                          instruct=True, seq_len=SEQ, cache_dir=str(tmp_path / "cache"))
    data.prepare_data(cfg)
    before = data.open_dataset(cfg, 0)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "chat_template": "{% for m in messages %}{{ m.role }}> {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant> {% endif %}"}))
    data.prepare_data(cfg)
    after = data.open_dataset(cfg, 0)
    assert not np.array_equal(np.asarray(before.val_tokens), np.asarray(after.val_tokens))
    assert before.digests["chat template"] != after.digests["chat template"]


def test_a_prompt_and_its_completion_are_encoded_as_one_text(tmp_path):
    """SentencePiece with a dummy prefix (Llama 2, Mistral) would give the completion its own "▁"
    if encoded apart: the ids are those of the joined text, the targets the completion's."""
    from test_data import english
    from test_hf import llama2_sentencepiece
    model = tmp_path / "tokenizer.model"
    llama2_sentencepiece(model, [english(200, seed=i) for i in range(5)])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>",
                                                                "eos_token": "</s>"}))
    data.start_examples_worker(str(model))
    sp = data._examples[0]
    ids, marks = data.example_ids({"prompt": "the cat", "completion": " sat on the mat"}, lambda: "row")
    assert ids == [sp.bos_id()] + sp.encode("the cat sat on the mat") + [sp.eos_id()]
    assert sp.decode([i for i, t in zip(ids, marks) if t]) == "sat on the mat"


@pytest.fixture(scope="module")
def bf16_weights(tmp_path_factory):
    """--weights-dtype bf16 (torchtune's full fine-tune keeps everything in bf16) under each strategy."""
    tmp = tmp_path_factory.mktemp("bf16w")
    bf16 = ["--weights-dtype", "bf16", "--param-dtype", "bf16", "--checkpoint-type", "full"]
    one = launch(tmp, 1, {"none": ["--strategy", "none"] + bf16,
                          "none_fp32": ["--strategy", "none", "--param-dtype", "bf16"]}, "one")
    two = launch(tmp, 2, {"fsdp": bf16, "fsdp2": ["--strategy", "fsdp2"] + bf16,
                          "fsdp2_meta": ["--strategy", "fsdp2", "--meta-init"] + bf16,
                          "ddp": ["--strategy", "ddp"] + bf16}, "two")
    return {**one, **two}


@pytest.mark.parametrize("name", ["none", "fsdp", "fsdp2", "fsdp2_meta", "ddp"])
def test_bf16_weights_keep_weights_and_adam_in_bf16_and_train_alike(bf16_weights, name):
    losses, val, run_dir = bf16_weights[name]
    ckpt = torch.load(next(Path(run_dir, "checkpoints").glob("step_*/model.pt")), weights_only=True)
    assert {t.dtype for t in ckpt["model"].values()} == {torch.bfloat16}
    state = [t for s in ckpt["optim"]["state"].values() for k, t in s.items() if k.startswith("exp_avg")]
    assert state and {t.dtype for t in state} == {torch.bfloat16}
    # bf16 sums in another order round otherwise: the same run to within bf16's precision (and
    # --meta-init draws its init in bf16, not in fp32 and then rounded: further)
    reference, tol = bf16_weights["none"][0], 5e-2 if "meta" in name else 5e-3
    assert all(abs(a - b) <= tol * b for a, b in zip(losses, reference)), (losses, reference)
    assert losses[-1] < losses[0] - 0.3
    fp32 = bf16_weights["none_fp32"][0]
    assert all(abs(a - b) <= 5e-2 * b for a, b in zip(losses, fp32)), (losses, fp32)
