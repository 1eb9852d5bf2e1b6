"""Issue 27's optional float8 question, measured before any flag is added: train_fsdp.py with the
blocks' linear layers swapped for torchao's Float8Linear (tensorwise scaling; the LM head stays
bf16, as torchao advises), everything else as given on the command line. Compare its logged
tokens/s and losses with the same command without this wrapper.
    python tools/float8_probe.py train_fsdp.py ARGS      (needs torchao and an H100-class GPU)"""
import os
import sys

sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
import torch  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

import train_fsdp  # noqa: E402

build = train_fsdp.build_model


def build_float8(cfg):
    model, wrap, ckpt = build(cfg)
    blocks = {m for b in model.modules() if type(b) in ckpt for m in b.modules()}
    residual = {name for name, m in model.named_modules() if getattr(m, "residual_out", False)}
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda m, fqn: m in blocks and isinstance(m, torch.nn.Linear))
    for name, m in model.named_modules():  # the swap drops this mark of the model's (scaled init)
        if name in residual:
            m.residual_out = True
    n = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    print(f"float8_probe: {n} linear layers in float8", flush=True)
    return model, wrap, ckpt


train_fsdp.build_model = build_float8
train_fsdp.run()
