"""Convert a baseline checkpoint to the Hugging Face layout, so lm-eval-harness, vLLM and
`transformers` run it with no custom code:

    python convert_to_hf.py RUN/checkpoints/step_N OUT_DIR      # or RUN/checkpoints/latest, best

OUT_DIR gets config.json (the family the model came from with --init-from a model directory:
Llama, Mistral, Qwen2 with its q/k/v biases, Qwen3 with its q/k norms; LlamaForCausalLM for a
model trained here from scratch), model.safetensors (the checkpoint's fp32 weights) and the run's
tokenizer: a downloaded model's own files, or, for one data.py trained, a `tokenizers`
tokenizer.json that gives the ids of the run's SentencePiece model. It reads sharded and full
checkpoints of every strategy through the trainer's own loading (train_fsdp.init_weights_from),
in this one CPU process.

A file of its own, not a train_fsdp.py flag: the trainer is the one file researchers copy into
their repo, with any model; this converter knows this project's model and tokenizer and needs
packages the trainer does not (transformers, safetensors, protobuf), imported only here.
(The trainer's --export is another thing: it consolidates a sharded checkpoint into model.pt.)

The baseline is Llama's architecture and its conventions already match, so every weight is
copied unchanged (model.py's hf_name gives each its name):
- rotary: model.apply_rope rotates (first half, second half) pairs of a head with
  inv_freq = theta^(-2i/head_dim), which is HF's rotate_half. The row permutation of Meta's
  checkpoints converts the interleaved layout, which this model does not use: none here.
- grouped-query attention: query head h reads key/value head h // (n_head / n_kv_head) in both
  (SDPA's enable_gqa, HF's repeat_kv); heads are contiguous rows of wq/wk/wv in both.
- RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, computed in fp32: rms_norm_eps = norm_eps.
- attention scale 1/sqrt(head_dim) (SDPA's default), SwiGLU w1/w3/w2 = gate/up/down; Qwen2's
  q/k/v biases and Qwen3's per-head q/k RMSNorm under their own names.
- tied embeddings: one tensor in the file, tie_word_embeddings in the config.
- RoPE scaling (Llama 3.1's llama3) and a head size other than hidden / heads, in the config.
- vocabulary: a --vocab-size padded past the tokenizer keeps its rows, so the logits (and their
  softmax) are the model's; the tokenizer never produces the padded ids.
The Free Transformer is refused: its latent path has no Hugging Face architecture.
"""

import json
import os
import shutil
import sys
import warnings

import torch
from torch.distributed.checkpoint.api import CheckpointException

import data as data_lib
import model as model_lib
import train_fsdp
from train_fsdp import BadInput, RunFailed

USAGE = "usage: python convert_to_hf.py CHECKPOINT_DIR OUT_DIR"
# A downloaded model's tokenizer files, copied as they are (data.whole_texts tells such a tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")


def import_optional():
    """The packages only this command needs, or BadInput naming what to install."""
    try:
        import safetensors.torch  # noqa: F401
        import transformers  # noqa: F401
        from sentencepiece import sentencepiece_model_pb2  # noqa: F401  (needs protobuf)
    except ImportError as e:
        raise BadInput(f"convert_to_hf.py needs transformers, safetensors and protobuf ({e}); "
                       "install them with: pip install transformers safetensors protobuf")


def hf_config(cfg, meta, tokenizer):
    """config.json of the model's family (model.hf_config) for the model config `cfg`, with the
    tokenizer's BOS and EOS ids. max_position_embeddings: the training length, to which lm-eval
    truncates inputs; a downloaded model's own when it was longer."""
    data = meta["config"]["data"]
    seq_len = data["seq_len"] or (data_lib.SYNTH_ROW - 1 if data["dataset"] == "synthetic" else data_lib.TEXT_SEQ_LEN)
    if cfg.rope_scaling == "llama3":
        seq_len = max(seq_len, int(cfg.rope_original_context * cfg.rope_factor))
    special = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos")
               if getattr(tokenizer, f"{name}_token_id") is not None}
    return model_lib.hf_config(cfg, seq_len, special)


def hf_weights(state, cfg):
    """Our state dict -> the family's names; tensors unchanged (see the module docstring)."""
    out = {}
    for name, tensor in state.items():
        new = model_lib.hf_name(name)
        if new is None:
            raise RunFailed(f"parameter {name} has no Hugging Face name (model.py changed?); update convert_to_hf.py")
        if not (new == "lm_head.weight" and cfg.tie_embeddings):  # tied: the file holds the embedding once
            out[new] = tensor.detach().contiguous()
    return out


def sentencepiece_tokenizer(path):
    """A `tokenizers` Tokenizer with the ids of the SentencePiece model at `path`, for the settings
    data.py trains with. One difference is left, in Unigram models only: a text that spells a control
    or byte piece ("<s>", "<0x41>") gets its id; HF's Unigram cannot keep a piece out of its lattice."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    with open(path, "rb") as fh:
        proto = sentencepiece_model_pb2.ModelProto.FromString(fh.read())
    spec, norm, kind = proto.trainer_spec, proto.normalizer_spec, proto.SentencePiece.Type
    settings = {"normalization": (norm.precompiled_charsmap, b""), "add_dummy_prefix": (norm.add_dummy_prefix, False),
                "remove_extra_whitespaces": (norm.remove_extra_whitespaces, False),
                "escape_whitespaces": (norm.escape_whitespaces, True),
                "treat_whitespace_as_suffix": (spec.treat_whitespace_as_suffix, False)}
    unsupported = [name for name, (value, wanted) in settings.items() if value != wanted]
    if spec.model_type not in (spec.UNIGRAM, spec.BPE, spec.CHAR):
        unsupported.append("model_type")
    if unsupported:
        raise BadInput(f"tokenizer {path}: its {', '.join(unsupported)} setting is not one data.py trains with; "
                       "convert_to_hf.py converts SentencePiece models trained by data.py (bpe, unigram, char)")
    pieces = [(p.piece, p.score) for p in proto.pieces]
    # BPE merges ranked by the merged piece's score; a char model is BPE without merges. Byte
    # fallback and fused unknowns as SentencePiece does.
    if spec.model_type == spec.UNIGRAM:
        model = models.Unigram(pieces, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    else:
        normal = {p.piece: (p.score, i) for i, p in enumerate(proto.pieces) if p.type == kind.NORMAL}
        ranked = sorted((-score, i, piece[:k], piece[k:]) for piece, (score, i) in normal.items()
                        for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal)
        model = models.BPE({piece: i for i, (piece, _) in enumerate(pieces)}, [(a, b) for *_, a, b in ranked],
                           unk_token=spec.unk_piece, fuse_unk=True, byte_fallback=spec.byte_fallback)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", "▁")
    # SentencePiece decodes an unknown piece as its unk_surface (" ⁇ "), a byte run as its UTF-8.
    tok.decoder = decoders.Sequence([decoders.Replace(spec.unk_piece, spec.unk_surface), decoders.Replace("▁", " "),
                                     decoders.ByteFallback(), decoders.Fuse()])
    # User-defined pieces ("\n") are matched first, whole; control pieces are special tokens that
    # text never produces (split_special_tokens).
    tok.add_tokens([AddedToken(p.piece, normalized=False, special=False)
                    for p in proto.pieces if p.type == kind.USER_DEFINED])
    tok.add_special_tokens([AddedToken(p.piece, normalized=False, special=True)
                            for p in proto.pieces if p.type in (kind.CONTROL, kind.UNKNOWN)])
    # No bos_token: training never saw <s>, only EOS between documents (data.token_chunks), so
    # tools that start a text with BOS when there is one (lm-eval's prefix) take EOS instead.
    named = {"unk_token": spec.unk_id, "eos_token": spec.eos_id, "pad_token": spec.pad_id}
    return tok, {name: proto.pieces[i].piece for name, i in named.items() if i >= 0}


def synthetic_tokenizer():
    """The synthetic task's alphabet (data.SYNTH_CHARS), one id per character. A character
    outside it, which data.encode refuses, becomes <unk> at the first padding id (a tokenizer
    cannot refuse; dropping it would be silent)."""
    from tokenizers import Tokenizer, decoders, models
    vocab = {c: i for i, c in enumerate(data_lib.SYNTH_CHARS)} | {"<unk>": len(data_lib.SYNTH_CHARS)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return tok, {"unk_token": "<unk>"}


def hf_tokenizer(tokenizer_path):
    """The run's tokenizer (meta.json's "tokenizer": a SentencePiece .model or a downloaded model's
    tokenizer, or "" for the synthetic task) as a transformers tokenizer; data.py's own add no
    BOS/EOS."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    if tokenizer_path and not os.path.isfile(tokenizer_path):
        raise BadInput(f"tokenizer {tokenizer_path} not found; the run's tokenizer must stay where it was trained")
    if tokenizer_path and data_lib.whole_texts(tokenizer_path):  # a downloaded model's, as it came
        return AutoTokenizer.from_pretrained(os.path.dirname(tokenizer_path))
    tok, special = sentencepiece_tokenizer(tokenizer_path) if tokenizer_path else synthetic_tokenizer()
    return PreTrainedTokenizerFast(tokenizer_object=tok, split_special_tokens=True,
                                   clean_up_tokenization_spaces=False, **special)


def load_model(path, meta):
    """The project's model with the checkpoint's weights, read by the trainer's --init-from
    loader (sharded: DCP in this one process; full: model.pt). Every parameter starts as NaN,
    so one that the checkpoint lacks is found instead of exported at its initial value."""
    cfg = model_lib.ModelConfig(**model_lib.saved_fields(meta["config"]["model"]))
    if cfg.lora_rank:  # adapters only (sharded): merged into the base, as --export merges them
        export = train_fsdp.import_optional("ckpt_export", "convert_to_hf.py")
        state, meta = export.merged_lora(path, meta, export.saved_model(path, train_fsdp), train_fsdp)
        model = model_lib.build_model(model_lib.ModelConfig(**meta["config"]["model"]))
        model.load_state_dict(state)
        return model.eval()
    model = model_lib.build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is")
        try:
            train_fsdp.init_weights_from(path, model)
        except (BadInput, RunFailed):
            raise
        except (Exception, CheckpointException) as e:  # bytes that do not load (CheckpointException is a
            # BaseException)
            raise RunFailed(f"checkpoint {path} is incomplete or corrupted: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}")
    missing = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if missing:
        raise RunFailed(f"checkpoint {path}: weights missing or not finite: {', '.join(missing[:4])}")
    return model.eval()


def check_convertible(path, meta):
    """BadInput unless the checkpoint holds this project's baseline model trained on its data: a
    model of the user's own (run(build_model=...)) records no `arch`, its own data no `dataset`."""
    model, data = meta["config"].get("model") or {}, meta["config"].get("data") or {}
    if model.get("arch") not in ("baseline", "free") or "dataset" not in data:
        raise BadInput(f"{path} holds a model or data of your own (its config has no model arch or no dataset): "
                       "convert_to_hf.py converts only this project's baseline model (model.py) with its tokenizer")
    if model["arch"] != "baseline":
        raise BadInput(f"{path} holds a Free Transformer: its latent path (encoder, binary mapper, post-sampler) "
                       "has no Hugging Face architecture; consolidate its weights with python train_fsdp.py --export "
                       f"{path} and sample it with sample.py")


def convert(path, out_dir):
    """Check everything, then write OUT_DIR through a staging directory renamed into place."""
    import safetensors.torch
    path = train_fsdp.follow_marker(path)
    train_fsdp.require_checkpoint_dir(path, "CHECKPOINT_DIR", "a checkpoint directory such as RUN/checkpoints/step_N")
    meta = train_fsdp.check_checkpoint(path)
    check_convertible(path, meta)
    if os.path.isfile(out_dir) or (os.path.isdir(out_dir) and os.listdir(out_dir)):
        raise BadInput(f"OUT_DIR {out_dir} exists and is not an empty directory; give a new or empty one")
    tokenizer = hf_tokenizer(meta["tokenizer"])
    model = load_model(path, meta)
    config, weights = hf_config(model.cfg, meta, tokenizer), hf_weights(model.state_dict(), model.cfg)
    # A symlink is written through: the directory it names gets the files, the link stays.
    target = os.path.realpath(out_dir)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(target)}-{os.getpid()}")
    try:
        os.makedirs(tmp)
        write_json(os.path.join(tmp, "config.json"), config)
        safetensors.torch.save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        # safetensors creates its file owner-only (0600); give it the mode of the files beside it
        shutil.copymode(os.path.join(tmp, "config.json"), os.path.join(tmp, "model.safetensors"))
        copy_or_save_tokenizer(meta["tokenizer"], tokenizer, tmp)
        os.replace(tmp, target)  # replaces an empty OUT_DIR too
    except Exception as e:  # a full disk: safetensors raises its own error type, not OSError
        shutil.rmtree(tmp, ignore_errors=True)
        reason = str(e).splitlines()[0] if str(e) else ""
        raise RunFailed(f"cannot write {out_dir} ({type(e).__name__}: {reason}); nothing was written") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {out_dir} ({config['architectures'][0]}, step {meta['step']}, "
          f"{model_lib.count_params(model):,} parameters)")


def write_json(path, obj):
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")


def copy_or_save_tokenizer(tokenizer_path, tokenizer, out_dir):
    """A downloaded model's tokenizer files as they are; one data.py made, saved by transformers."""
    if tokenizer_path and data_lib.whole_texts(tokenizer_path):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(os.path.dirname(tokenizer_path), name)):
                shutil.copy(os.path.join(os.path.dirname(tokenizer_path), name), out_dir)
        return
    tokenizer.save_pretrained(out_dir)
    pin_tokenizer_class(out_dir)


def pin_tokenizer_class(out_dir):
    """transformers 5 names its fast tokenizer TokenizersBackend, which transformers 4 does not
    know; PreTrainedTokenizerFast is the name both load tokenizer.json with."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as fh:
        config = json.load(fh)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_json(path, config)


def run(argv):
    """Command-line entry: bad input is one line on stderr and exit 2; a checkpoint that does
    not load, one line and exit 1. Returns the exit code."""
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    try:
        if len(argv) != 2 or any(a.startswith("-") for a in argv):
            raise BadInput(USAGE)
        import_optional()
        convert(*argv)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return train_fsdp.EXIT_BAD_INPUT
    except (RunFailed, OSError) as e:  # a checkpoint that does not load, a full disk
        print(f"error: {e}", file=sys.stderr)
        return train_fsdp.EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
