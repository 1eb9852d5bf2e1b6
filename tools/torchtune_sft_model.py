"""A random-weight Llama-3.2-1B-shaped model directory in the Hugging Face layout, for the torchtune-vs-ours
SFT benchmark (tools/torchtune_sft_gpu.sh): tools/hf_load_memory.py's write_model (bf16 safetensors
shards + index, random weights) with Llama 3.2's config.json (tied embeddings, llama3 RoPE scaling),
then lm_head.weight dropped from the files, as the real checkpoint has none (torchtune's LLAMA3_2
checkpointer and a tied model refuse an extra output weight).

    python3 tools/torchtune_sft_model.py OUT_DIR [--tiny] [--tokenizer-dir DIR]

--tiny writes a 2-layer, width-64 model (vocab 128256 still) for CPU checks. --tokenizer-dir copies
tokenizer.json and tokenizer_config.json beside the weights and sets bos/eos ids in config.json.
"""
import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from hf_load_memory import llama_config, write_model  # noqa: E402

LLAMA32_1B = dict(layers=16, width=2048, ffn=8192, vocab=128256, heads=32, kv_heads=8)
TINY = dict(layers=2, width=64, ffn=256, vocab=128256, heads=4, kv_heads=2)
LLAMA32_EXTRA = {"rope_theta": 500000.0, "tie_word_embeddings": True, "max_position_embeddings": 131072,
                 "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                 "torch_dtype": "bfloat16"}


def config_for(shape, bos_id=None, eos_id=None):
    extra = dict(LLAMA32_EXTRA, head_dim=shape["width"] // shape["heads"])
    if bos_id is not None:
        extra.update(bos_token_id=bos_id, eos_token_id=eos_id)
    return llama_config(**shape, **extra)


def drop_lm_head(out):
    """Remove lm_head.weight from its shard and from the index (tied embeddings)."""
    from safetensors.torch import load_file, save_file
    index_path = os.path.join(out, "model.safetensors.index.json")
    with open(index_path) as fh:
        index = json.load(fh)
    file = index["weight_map"].pop("lm_head.weight", None)
    if file is None:
        return
    tensors = load_file(os.path.join(out, file))
    tensors.pop("lm_head.weight")
    save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
    with open(index_path, "w") as fh:
        json.dump(index, fh)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--tokenizer-dir", default="")
    args = ap.parse_args()
    bos = eos = None
    if args.tokenizer_dir:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(args.tokenizer_dir, "tokenizer.json"))
        with open(os.path.join(args.tokenizer_dir, "tokenizer_config.json")) as fh:
            tc = json.load(fh)
        bos, eos = tok.token_to_id(tc["bos_token"]), tok.token_to_id(tc["eos_token"])
    cfg = config_for(TINY if args.tiny else LLAMA32_1B, bos, eos)
    write_model(args.out, cfg)  # returns at once if the directory already has an index
    drop_lm_head(args.out)
    with open(os.path.join(args.out, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    if args.tokenizer_dir and os.path.abspath(args.tokenizer_dir) != os.path.abspath(args.out):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(args.tokenizer_dir, f), os.path.join(args.out, f))
    with open(os.path.join(args.out, "model.safetensors.index.json")) as fh:
        files = sorted(set(json.load(fh)["weight_map"].values()))
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in files)
    print(f"model: {args.out} files={files} {size / 2 ** 30:.2f} GiB bf16, tied embeddings, vocab {cfg['vocab_size']}")


if __name__ == "__main__":
    main()
