"""--init-from a Hugging Face model directory, for train_fsdp.py: its config.json and safetensors
(one file, or shards with their index), as downloaded, never converted. The trainer imports this
file only for such a directory: copy it beside the trainer to fine-tune one in your repo.

- configure: the model's settings from config.json (model.py's hf_fields: Llama, Mistral, Qwen2,
  Qwen3), a model flag that disagrees refused; the tokenizer from the directory.
- shapes: the tensors the files hold, checked before anything is written.
- load: the weights into the wrapped model through torch.distributed.checkpoint's
  HuggingFaceStorageReader, which reads from each file only the slices of the tensors this rank
  holds (its FSDP shards), cast to the parameters' dtype as they are copied.
"""

import json
import os

import safetensors  # noqa: F401  (HuggingFaceStorageReader reads through it: missing, one line)
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import model as model_lib

DTYPES = {"torch.float32", "torch.bfloat16", "torch.float16"}  # what a fine-tune starts from
INDEX = "model.safetensors.index.json"


def configure(cfg, trainer):
    """Set cfg.model from DIR/config.json, and cfg.data.tokenizer from DIR unless one is given;
    bad input is the trainer's BadInput."""
    try:
        configure_from(cfg.checkpoint.init_from, cfg)
    except ValueError as e:
        raise trainer.BadInput(str(e)) from None


def configure_from(path, cfg):
    if not hasattr(cfg.model, "hf_architecture"):
        raise ValueError(f"--init-from {path} is a Hugging Face model directory: it builds this "
                         "project's model.py, not a model of your own")
    config = read_json(os.path.join(path, "config.json"))
    seq_len = getattr(cfg.data, "seq_len", 0) or 512  # data.py's text rows, when it gives none
    try:
        fields = model_lib.hf_fields(config, seq_len)
    except ValueError as e:
        raise ValueError(f"--init-from {path}: {e}") from None
    default = type(cfg.model)()
    for name, (value, key) in fields.items():
        mine = getattr(cfg.model, name)
        if mine != getattr(default, name) and mine != value:
            raise ValueError(f"--{name.replace('_', '-')} {mine} disagrees with {path}'s "
                             f"config.json ({key}: {value}): drop the flag, or give another "
                             "model directory")
        setattr(cfg.model, name, value)
    if hasattr(cfg.data, "tokenizer") and not cfg.data.tokenizer:
        names = [n for n in ("tokenizer.model", "tokenizer.json")
                 if os.path.isfile(os.path.join(path, n))]
        generated = cfg.data.dataset in ("synthetic", "random")  # they need no tokenizer
        if not names and not generated:
            raise ValueError(f"--init-from {path}: no tokenizer.model or tokenizer.json in it; "
                             "give the model's tokenizer with --tokenizer")
        cfg.data.tokenizer = os.path.join(path, names[0]) if names else ""


def read_json(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e})") from None


def file_name(name, keys):
    """The name in the files (`keys`) of one of our parameters; a head they lack is the embedding,
    which a model with tied embeddings stores alone."""
    key = model_lib.hf_name(name)
    return "model.embed_tokens.weight" if key == "lm_head.weight" and key not in keys else key


def shapes(path, names):
    """{our name: shape} for `names` that the files hold. ValueError for a shard that is missing
    (named by the index) or cannot be read, and for a dtype this trainer does not fine-tune from."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        shards = set(read_json(index).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not os.path.isfile(os.path.join(path, s)))
        if missing:
            raise ValueError(f"--init-from {path}: {INDEX} names {', '.join(missing)}, which is "
                             "not there (an interrupted download?)")
    try:
        metadata = HuggingFaceStorageReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # safetensors' own errors: a truncated or foreign file
        raise ValueError(f"--init-from {path}: a safetensors file cannot be read "
                         f"({str(e).splitlines()[0]})") from None
    odd = sorted({str(m.properties.dtype) for m in metadata.values()} - DTYPES)
    if odd:
        raise ValueError(f"--init-from {path}: tensors of {', '.join(odd)} (quantised?); a "
                         "fine-tune starts from float32, bfloat16 or float16 weights")
    found = {n: file_name(n, metadata) for n in names}
    return {n: tuple(metadata[key].size) for n, key in found.items() if key in metadata}


def load(path, model):
    """The directory's weights into `model` (wrapped or not): each rank reads only what it holds."""
    reader = HuggingFaceStorageReader(path)
    keys = reader.read_metadata().state_dict_metadata
    state = get_model_state_dict(model)  # FSDP: this rank's shards; DDP and none: all of it
    named = {file_name(n, keys): t for n, t in state.items()}
    dcp.load({k: t for k, t in named.items() if k in keys}, storage_reader=reader)  # not adapters
    set_model_state_dict(model, state)
