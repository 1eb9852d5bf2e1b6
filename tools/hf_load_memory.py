"""Host memory of each rank while --init-from reads a Hugging Face model directory under fsdp2 with
--meta-init (docs/fine-tuning.md): 2 CPU ranks (gloo), a Llama-shaped model of over 1 GB written here
in bf16 safetensors shards with their index, random weights.

    python tools/hf_load_memory.py OUT_DIR [--layers 22] [--width 2048] [--ffn 5632] [--vocab 32000]

Each rank builds the model on the meta device, shards it as the trainer does (train_fsdp.wrap_model:
fully_shard per block, to_empty), then loads it with hf_checkpoint.load; its peak resident memory
during the load alone (Linux VmHWM, reset before it) is compared with its share of the parameters
(fp32), the largest tensor of the files and the whole model. Prints one line per rank and writes
OUT_DIR/memory.json.
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def llama_config(layers, width, ffn, vocab, heads, kv_heads, **more):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": width,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "max_position_embeddings": 2048, **more}


def write_model(out, config):
    """config.json, model-0000N-of-0000M.safetensors (about 1 GB each) and the index, random bf16
    weights (made on the GPU when there is one), for a Llama `config`."""
    from safetensors.torch import save_file
    if os.path.isfile(os.path.join(out, "model.safetensors.index.json")):
        return
    os.makedirs(out, exist_ok=True)
    width, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * width // config["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (vocab, width), "model.norm.weight": (width,),
              "lm_head.weight": (vocab, width)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (width,), p + "post_attention_layernorm.weight": (width,),
                       p + "self_attn.q_proj.weight": (width, width), p + "self_attn.k_proj.weight": (kv, width),
                       p + "self_attn.v_proj.weight": (kv, width), p + "self_attn.o_proj.weight": (width, width),
                       p + "mlp.gate_proj.weight": (ffn, width), p + "mlp.up_proj.weight": (ffn, width),
                       p + "mlp.down_proj.weight": (width, ffn)})
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        current[name] = shape
        size += 2 * torch.Size(shape).numel()
        if size > 1 << 30:
            shards.append(current)
            current, size = {}, 0
    shards.append(current)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: (torch.randn(s, device=device) * 0.02).to(torch.bfloat16).cpu() for n, s in names.items()},
                  os.path.join(out, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)


def kib(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def measure(model_dir, out):
    """One rank (under torchrun): wrap as the trainer does, load, report the load's peak memory."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    import hf_checkpoint
    import train_fsdp
    dist.init_process_group("gloo")
    cfg = train_fsdp.parse_config(["--strategy", "fsdp2", "--meta-init", "--auto-wrap", "module",
                                   "--init-from", model_dir, "--tokenizer", "unused"])  # no data is read
    hf_checkpoint.configure(cfg, train_fsdp)
    topo = train_fsdp.setup_distributed(cfg)
    data = type("Data", (), {"steps_per_epoch": lambda self, b: 1, "vocab_size": cfg.model.vocab_size})()
    train_fsdp.resolve_config(cfg, topo, data)
    topo = dataclasses.replace(topo, mesh=train_fsdp.device_mesh(cfg, topo))
    with torch.device("meta"):
        model, wrap, ckpt = train_fsdp.build_model(cfg)
    model = train_fsdp.wrap_model(model, wrap, ckpt, cfg, topo, model.init_module)
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    files = HuggingFaceStorageReader(model_dir).read_metadata().state_dict_metadata
    largest = max(m.size.numel() * m.properties.dtype.itemsize for m in files.values())
    with open("/proc/self/clear_refs", "w") as fh:  # VmHWM from here on
        fh.write("5")
    before = kib("VmRSS")
    hf_checkpoint.load(model_dir, model)
    peak = kib("VmHWM")
    gib = 2 ** 30
    row = {"rank": dist.get_rank(), "rss_before_gib": before / 2 ** 20, "peak_during_load_gib": peak / 2 ** 20,
           "added_gib": (peak - before) / 2 ** 20, "shard_fp32_gib": shard / gib, "largest_file_tensor_gib": largest / gib,
           "whole_model_fp32_gib": full / gib}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        for r in rows:
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
        with open(os.path.join(out, "memory.json"), "w") as fh:
            json.dump(rows, fh, indent=1)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--measure", default="")
    args = p.parse_args()
    if args.measure:
        return measure(args.measure, args.out)
    model_dir = os.path.join(args.out, "model")
    write_model(model_dir, llama_config(args.layers, args.width, args.ffn, args.vocab, args.width // 64,
                                        args.width // 256))
    on_disk = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir))
    print(f"model: {model_dir}, {on_disk / 2 ** 30:.2f} GiB of safetensors (bf16)")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    __file__, args.out, "--measure", model_dir], env=env, check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
