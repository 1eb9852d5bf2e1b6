"""float8 training for train_fsdp.py's --float8 (torchao). The trainer imports this file only for
that flag: copy it beside the trainer to use it in your repo."""

import importlib

import torch


def to_float8(blocks, recipe):
    """The blocks' Linear layers cast to float8 for each matmul (sides multiples of 16), before
    wrapping as torchtitan does; the head stays as it is. torchao swaps in new layers: each keeps
    the marks its model set on the old (model.py's residual_out, read by --meta-init's init).
    Returns how many layers it converted."""
    float8 = importlib.import_module("torchao.float8")
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    for b in blocks:
        old = dict(b.named_modules())
        float8.convert_to_float8_training(
            b, config=config,
            module_filter_fn=lambda m, _: type(m) is torch.nn.Linear and m.in_features % 16 == 0
            and m.out_features % 16 == 0)  # not a subclass: LoRA's would lose its adapters
        for name, new in b.named_modules():
            new.__dict__.update({k: v for k, v in vars(old[name]).items() if k not in vars(new)})
    return sum(type(m).__name__ == "Float8Linear" for b in blocks for m in b.modules())
