"""Stand-in for datasets.distributed (see __init__.py)."""


def split_dataset_by_node(*args, **kwargs):
    raise RuntimeError("datasets stub (tools/torchtune_sft_stubs): split_dataset_by_node is not available")
