"""--init-from a Hugging Face model directory: Llama (3.1's RoPE scaling), Mistral, Qwen2 (q/k/v
biases, tied embeddings) and Qwen3 (q/k norms, a head size that is not hidden / heads), each built
here by transformers' own config and model classes with random weights and a tokenizer made here
(no download). Checked: our logits equal transformers' (fp32); the tokenizer's ids equal
AutoTokenizer's and documents are marked as the family marks them; every strategy starts from the
same weights; bad directories are one line with nothing written; convert_to_hf.py writes each
family back with identical tensors; a model trained here, exported and fine-tuned from the
export starts at the loss the run ended at."""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import script_runner  # noqa: E402

import data  # noqa: E402
import hf_checkpoint  # noqa: E402
import model as model_lib  # noqa: E402
from test_data import english  # noqa: E402
from test_distributed import clean_env, run_ranks  # noqa: E402
from test_trackers import missing_packages  # noqa: E402

transformers = pytest.importorskip("transformers", reason="pip install transformers (.ci/run does)")
tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers (.ci/run does)")
pytest.importorskip("safetensors", reason="pip install safetensors (.ci/run does)")

# Llama 3's and Qwen's pre-tokenizer splits (their tokenizer.json's), before byte-level BPE: digits in
# threes, or one by one.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-5, max_position_embeddings=512)
SAMPLES = ["The river ran quickly past the silver garden.\nA second line,  with a double space.\n\nAnd 2024 more.",
           "Привет, мир! 你好，世界。 مرحبا بالعالم 🎉 Ελληνικά",
           "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3), [i for i in range(10)])\n"]
TEXT = ["--seq-len", "64", "--global-batch", "8", "--eval-every", "0", "--eval-samples", "16", "--log-every", "1",
        "--param-dtype", "fp32", "--reduce-dtype", "fp32"]


def byte_bpe(texts, specials, bos=None, split=LLAMA3_SPLIT):
    """A byte-level BPE tokenizer.json in Llama 3's and Qwen's layout, trained on `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:  # Llama 3's post-processor puts <|begin_of_text|> first
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def llama2_sentencepiece(path: Path, texts):
    """A tokenizer.model with Llama 2's and Mistral's SentencePiece settings (dummy prefix, byte fallback)."""
    import sentencepiece as spm
    corpus = path.parent / "sp.txt"
    corpus.write_text("".join(texts))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(path.with_suffix("")), vocab_size=500,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
                                   allow_whitespace_only_pieces=True, minloglevel=2)
    corpus.unlink()


def save_model(directory: Path, config, shard=None):
    """transformers' model of `config`, random (norms and biases too), saved as safetensors."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(directory, max_shard_size=shard) if shard else model.save_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """{family: (directory, transformers' model)} and a text corpus."""
    tmp = tmp_path_factory.mktemp("hf")
    texts = [english(200, seed=i) for i in range(5)]
    out = {}
    tok = byte_bpe(texts, ["<|begin_of_text|>", "<|end_of_text|>"], bos="<|begin_of_text|>")
    llama = transformers.LlamaConfig(
        **SMALL, vocab_size=tok.get_vocab_size(), architectures=["LlamaForCausalLM"],
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    tok_qwen = byte_bpe(texts, ["<|endoftext|>"], split=QWEN_SPLIT)
    qwen2 = transformers.Qwen2Config(**SMALL, vocab_size=tok_qwen.get_vocab_size() + 12, tie_word_embeddings=True,
                                     architectures=["Qwen2ForCausalLM"])
    qwen3 = transformers.Qwen3Config(**SMALL, head_dim=32, vocab_size=tok_qwen.get_vocab_size(),
                                     architectures=["Qwen3ForCausalLM"])
    mistral = transformers.MistralConfig(**SMALL, vocab_size=500, sliding_window=None, architectures=["MistralForCausalLM"])
    for name, config, tokenizer, special, shard in (
            ("llama", llama, tok, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, "60KB"),
            ("qwen2", qwen2, tok_qwen, {"bos_token": None, "eos_token": "<|endoftext|>"}, None),
            ("qwen3", qwen3, tok_qwen, {"bos_token": None, "eos_token": "<|endoftext|>"}, None),
            ("mistral", mistral, None, {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>",
                                        "tokenizer_class": "LlamaTokenizer", "legacy": False}, None)):
        directory = tmp / name
        hf = save_model(directory, config, shard)
        if tokenizer is None:
            llama2_sentencepiece(directory / "tokenizer.model", texts)
        else:
            tokenizer.save(str(directory / "tokenizer.json"))
            special = {**special, "tokenizer_class": "PreTrainedTokenizerFast"}
        (directory / "tokenizer_config.json").write_text(json.dumps(special))
        out[name] = (directory, hf)
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": english(6, seed=100 + i)}) + "\n" for i in range(300)))
    return out, corpus


def ours(directory, seq_len=64):
    cfg = model_lib.ModelConfig(**{k: v for k, (v, _) in model_lib.hf_fields(
        json.loads((directory / "config.json").read_text()), seq_len).items()})
    net = model_lib.build_model(model_lib.resolve_model_config(cfg))
    hf_checkpoint.load(str(directory), net)
    return net.eval()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_logits_equal_transformers(families, family):
    """The same weights, read from the model's safetensors (sharded for llama), give transformers'
    logits in fp32: RoPE with Llama 3.1's scaling, GQA, Qwen2's biases, Qwen3's q/k norms and head size,
    tied and untied embeddings."""
    directory, hf = families[0][family]
    ids = torch.randint(0, 400, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(directory)(ids)[0], hf(ids).logits, rtol=1e-5, atol=1e-5)
    if family == "llama":
        assert (directory / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tokenizer_ids_equal_autotokenizer_and_documents_are_marked_by_the_family(families, family, tmp_path):
    """A tokenizer.json (Llama 3, Qwen) or tokenizer.model (Llama 2, Mistral) from a model directory
    gives AutoTokenizer's ids on English, other scripts and code; the token cache joins documents as
    the family does: BOS first where it adds one, its EOS between."""
    directory, _ = families[0][family]
    path = directory / ("tokenizer.model" if family == "mistral" else "tokenizer.json")
    tok, auto = data.open_tokenizer(path), transformers.AutoTokenizer.from_pretrained(directory)
    for text in SAMPLES:
        assert tok.encode(text) == auto(text, add_special_tokens=False).input_ids, text
    docs = [english(4, seed=i) + "\n" + SAMPLES[i % 3] for i in range(6)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = data.DataConfig(dataset=str(tmp_path / "d.jsonl"), tokenizer=str(path), seq_len=8, val_fraction=0.5,
                          cache_dir=str(tmp_path / "cache"))
    data.prepare_data(cfg)
    ds = data.open_dataset(cfg, 0)
    stream = np.concatenate([ds.train_tokens, ds.val_tokens]).tolist()
    bos = [auto.bos_token_id] if family != "qwen2" else []
    expected = []
    for i, doc in enumerate(docs):
        expected += ([auto.eos_token_id] if i else []) + bos + auto(doc, add_special_tokens=False).input_ids
    assert stream == expected


def launch(args, nproc=1, cwd=ROOT):
    if nproc == 1:
        return [script_runner.run("train_fsdp.py", [str(a) for a in args], cwd, clean_env())]
    return run_ranks("train_fsdp.py", [str(a) for a in args], nproc, cwd=cwd)


def val_losses(run_dir):
    return [r["val_loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "val_loss" in r]


def hf_val_loss(hf, cfg_data, n=16):
    """transformers' model's mean loss on the first n validation rows of the run's data."""
    x, y = data.open_dataset(cfg_data, 1337).val_batch(0, n)
    with torch.no_grad():
        logits = hf(x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # untied, tied
def test_every_strategy_starts_from_the_models_weights(families, family, tmp_path):
    """fsdp2 and fsdp with --meta-init (each rank reads its shards), ddp and none (the whole model):
    one step at a rate too small to move a weight, then the validation loss is the downloaded model's,
    as transformers computes it on the same rows."""
    (directory, hf), corpus = families[0][family], families[1]
    base = [*TEXT, "--dataset", corpus, "--cache-dir", tmp_path / "cache", "--init-from", directory,
            "--max-steps", "1", "--lr", "1e-30", "--warmup-steps", "0"]
    runs = {"none": (["--strategy", "none"], 1), "ddp": (["--strategy", "ddp"], 2),
            "fsdp": (["--strategy", "fsdp", "--meta-init", "--auto-wrap", "module"], 2),
            "fsdp2": (["--strategy", "fsdp2", "--meta-init", "--auto-wrap", "module"], 2)}
    losses = {}
    for name, (flags, nproc) in runs.items():
        res = launch(base + flags + ["--out-dir", tmp_path / name], nproc)
        assert all(r.returncode == 0 for r in res), res[0].stderr[-3000:]
        losses[name] = val_losses(tmp_path / name)[-1]
    cfg = data.DataConfig(dataset=str(corpus), tokenizer=str(directory / "tokenizer.json"), seq_len=64,
                          cache_dir=str(tmp_path / "cache"))
    reference = hf_val_loss(hf, cfg)
    for name, loss in losses.items():
        assert abs(loss - reference) <= 1e-5 * reference, (name, loss, reference)


def bad_copy(families, tmp_path, edit):
    """A copy of the llama directory, edited by edit(directory)."""
    directory = tmp_path / "model"
    shutil.copytree(families[0]["llama"][0], directory)
    edit(directory)
    return directory


def set_config(**changes):
    def edit(directory):
        config = json.loads((directory / "config.json").read_text())
        config.update(changes)
        (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return edit


def int8_shard(directory):
    from safetensors.torch import save_file
    (directory / "model.safetensors.index.json").unlink()
    for f in directory.glob("*.safetensors"):
        f.unlink()
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4, dtype=torch.int8)}, str(directory / "model.safetensors"))


@pytest.mark.parametrize("edit, flags, message", [
    (set_config(architectures=["MixtralForCausalLM"]), [], "architecture MixtralForCausalLM is not one this decoder loads; "
                                                            "supported: LlamaForCausalLM, MistralForCausalLM"),
    (set_config(architectures=["GemmaForCausalLM"]), [], "architecture GemmaForCausalLM is not one"),
    (set_config(architectures=["GPT2LMHeadModel"]), [], "architecture GPT2LMHeadModel is not one"),
    (set_config(architectures=None), [], "architecture (none: no architectures) is not one"),
    (set_config(architectures=["MistralForCausalLM"], sliding_window=32), [],
     "a sliding window of 32 tokens, shorter than --seq-len 64"),
    (set_config(), ["--n-layer", "3"], "--n-layer 3 disagrees with"),
    (set_config(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0}), [],
     "config.json of a LlamaForCausalLM has no rope_parameters.factor"),
    (set_config(num_hidden_layers=None), [], "config.json of a LlamaForCausalLM has no num_hidden_layers"),
    (lambda d: next(d.glob("model-00002-*.safetensors")).unlink(), [], "model.safetensors.index.json names model-00002"),
    (lambda d: next(d.glob("model-00001-*.safetensors")).write_bytes(b"not safetensors"), [],
     "a safetensors file cannot be read"),
    (int8_shard, [], "tensors of torch.int8 (quantised?)"),
    (lambda d: (d / "tokenizer.json").unlink(), [], "no tokenizer.model or tokenizer.json in it"),
])
def test_a_bad_model_directory_is_one_line_and_writes_nothing(families, tmp_path, edit, flags, message):
    directory = bad_copy(families, tmp_path, edit)
    res = launch([*TEXT, "--dataset", families[1], "--cache-dir", tmp_path / "cache", "--init-from", directory,
                  "--strategy", "none", "--out-dir", tmp_path / "run", *flags])[0]
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("package, message", [
    ("tokenizers", "tokenizer.json: reading a tokenizer.json needs the tokenizers package, which is not installed: "
                   "pip install tokenizers"),
    ("safetensors", "error: --init-from needs the safetensors package, which is not installed: pip install safetensors")])
def test_a_missing_optional_package_is_one_line(families, tmp_path, package, message):
    """tokenizers (a model directory's tokenizer.json) and safetensors (its weights) are optional."""
    out = tmp_path / "run"
    res = script_runner.run("train_fsdp.py", [*TEXT, "--dataset", families[1], "--cache-dir", tmp_path / "cache",
                                              "--init-from", families[0]["llama"][0], "--out-dir", out], ROOT,
                            missing_packages(tmp_path, package))
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().endswith(message), res.stderr[-3000:]
    assert len(res.stderr.strip().splitlines()) == 1 and not out.exists() and not (tmp_path / "cache").exists()


def run_once(tmp_path, corpus, name, extra):
    """One step at a rate too small to move a weight; returns the run directory."""
    run = tmp_path / name
    res = launch([*TEXT, "--dataset", corpus, "--cache-dir", tmp_path / "cache", "--strategy", "none",
                  "--max-steps", "1", "--lr", "1e-30", "--warmup-steps", "0", "--out-dir", run, *extra])[0]
    assert res.returncode == 0, res.stderr[-3000:]
    return run


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_in_then_out_gives_the_same_tensors_and_family(families, family, tmp_path):
    """--init-from the directory, no training to speak of, convert_to_hf.py: the same tensors, the same
    architecture and settings (RoPE scaling, head size, biases, q/k norms, tied embeddings), a tokenizer
    with the same ids; transformers loads it and computes the same logits."""
    from safetensors.torch import load_file
    directory, hf = families[0][family]
    run = run_once(tmp_path, families[1], "run", ["--init-from", directory])
    out = tmp_path / "out"
    res = script_runner.run("convert_to_hf.py", [run / "checkpoints" / "latest", out], ROOT, clean_env())
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = {}
    for f in directory.glob("*.safetensors"):
        theirs.update(load_file(str(f)))
    mine = load_file(str(out / "model.safetensors"))
    assert mine.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert torch.equal(mine[key], tensor), key
    before, after = (json.loads((d / "config.json").read_text()) for d in (directory, out))
    assert after["architectures"] == before["architectures"]
    before.setdefault("head_dim", before["hidden_size"] // before["num_attention_heads"])  # Qwen2's has none
    for key in ("head_dim", "tie_word_embeddings", "num_key_value_heads", "vocab_size", "rms_norm_eps"):
        assert after[key] == before[key], key
    if family == "llama":
        assert after["rope_parameters"] == before["rope_parameters"]
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 400, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto(SAMPLES[2]).input_ids == transformers.AutoTokenizer.from_pretrained(directory)(SAMPLES[2]).input_ids


def test_sample_starts_the_prompt_as_the_family_starts_a_document(families, tmp_path):
    """sample.py on a run fine-tuned from Llama 3 (whose tokenizer adds a BOS): greedy samples are
    transformers' greedy continuation of BOS + the prompt, printed without the BOS."""
    directory, hf = families[0]["llama"]
    run = run_once(tmp_path, families[1], "run", ["--init-from", directory])
    res = script_runner.run("sample.py", ["--ckpt", run, "--prompt", "The river", "--num-samples", "1",
                                          "--max-new-tokens", "12", "--top-k", "1"], ROOT, clean_env())
    assert res.returncode == 0, res.stderr[-3000:]
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    ids = auto("The river", return_tensors="pt").input_ids
    assert ids[0, 0].item() == auto.bos_token_id
    with torch.no_grad():
        greedy = hf.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    assert res.stdout.strip() == repr(auto.decode(greedy[0, 1:])), (res.stdout, auto.decode(greedy[0]))


def test_an_exported_run_fine_tuned_starts_where_it_ended(tmp_path):
    """Trained here (baseline, its own tokenizer), exported to the Hugging Face format, then a new run
    --init-from that directory on the same data, with the export's tokenizer: its first validation (after
    a step too small to move a weight) is the loss the exported run ended at."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(english(2000, seed=3))
    first = launch([*TEXT, "--dataset", corpus, "--cache-dir", tmp_path / "cache", "--strategy", "none", "--arch",
                    "baseline", "--n-layer", "2", "--d-model", "64", "--n-head", "4", "--tokenizer-vocab-size", "400",
                    "--max-steps", "20", "--out-dir", tmp_path / "first"])[0]
    assert first.returncode == 0, first.stderr[-3000:]
    res = script_runner.run("convert_to_hf.py", [tmp_path / "first" / "checkpoints" / "latest", tmp_path / "hf"], ROOT,
                            clean_env())
    assert res.returncode == 0, res.stderr[-3000:]
    second = run_once(tmp_path, corpus, "second", ["--init-from", tmp_path / "hf"])
    assert json.loads((second / "config.json").read_text())["data"]["tokenizer"] == str(tmp_path / "hf" / "tokenizer.json")
    ended, started = val_losses(tmp_path / "first")[-1], val_losses(second)[-1]
    assert abs(started - ended) <= 1e-5 * ended, (started, ended)


def test_instruct_fine_tuning_of_a_downloaded_model_starts_at_transformers_loss_on_the_answers(families, tmp_path):
    """--instruct from a Llama directory whose tokenizer_config.json has a chat template: after one
    step at a rate too small to move a weight (fsdp2, --meta-init, 2 ranks), the validation loss is
    transformers' cross-entropy over the answers of the same rows (labels -100 elsewhere)."""
    source, hf = families[0]["llama"]
    directory = tmp_path / "llama"
    shutil.copytree(source, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}"
                               "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    rows = [{"prompt": english(4, seed=i), "completion": " " + english(3, seed=500 + i)} if i % 2 else
            {"messages": [{"role": "user", "content": english(3, seed=i)},
                          {"role": "assistant", "content": english(2, seed=900 + i)}]} for i in range(120)]
    examples = tmp_path / "sft.jsonl"
    examples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    res = launch([*TEXT, "--dataset", examples, "--instruct", "--val-fraction", "0.2", "--cache-dir", tmp_path / "cache",
                  "--init-from", directory, "--max-steps", "1", "--lr", "1e-30", "--warmup-steps", "0",
                  "--strategy", "fsdp2", "--meta-init", "--auto-wrap", "module", "--out-dir", run], 2)
    assert all(r.returncode == 0 for r in res), res[0].stderr[-3000:]
    assert "examples in" in res[0].stdout and "tokens are targets" in res[0].stdout
    cfg = data.DataConfig(dataset=str(examples), tokenizer=str(directory / "tokenizer.json"), seq_len=64,
                          instruct=True, val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    ds = data.open_dataset(cfg, 1337)
    x, y = ds.val_batch(0, 16)
    assert (y == data.IGNORE).any() and (y != data.IGNORE).any()
    with torch.no_grad():
        logits = hf(x).logits
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=data.IGNORE)
    assert abs(val_losses(run)[-1] - reference.item()) <= 1e-5 * reference.item()


def test_lora_on_a_downloaded_model_converts_to_its_family_with_the_adapters_merged(families, tmp_path):
    """LoRA on every projection of Qwen2 (q/k/v biases, tied embeddings) under fsdp2 --meta-init on 2
    ranks: each rank reads the base's slices (the files have no adapters), and convert_to_hf.py writes the
    merged model, whose validation loss under transformers is the run's last."""
    (directory, _), corpus = families[0]["qwen2"], families[1]
    run = tmp_path / "run"
    res = launch([*TEXT, "--dataset", corpus, "--cache-dir", tmp_path / "cache", "--init-from", directory,
                  "--strategy", "fsdp2", "--meta-init", "--auto-wrap", "module", "--max-steps", "3", "--lr", "1e-2",
                  "--lora-rank", "4", "--lora-targets", "wq,wk,wv,wo,w1,w2,w3", "--out-dir", run], 2)
    assert all(r.returncode == 0 for r in res), res[0].stderr[-3000:]
    out = tmp_path / "out"
    res = script_runner.run("convert_to_hf.py", [run / "checkpoints" / "latest", out], ROOT, clean_env())
    assert res.returncode == 0, res.stderr[-3000:]
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg = data.DataConfig(dataset=str(corpus), tokenizer=str(directory / "tokenizer.json"), seq_len=64,
                          cache_dir=str(tmp_path / "cache"))
    ended = val_losses(run)[-1]
    assert abs(hf_val_loss(merged, cfg) - ended) <= 1e-5 * ended
    assert abs(hf_val_loss(families[0]["qwen2"][1], cfg) - ended) > 1e-4 * ended  # the adapters moved it
