"""Stand-in for the Hugging Face `datasets` package, for tools/torchtune_sft_gpu.sh only.

torchtune 0.6.1 imports `load_dataset` (torchtune.data._utils, torchtune.datasets.*) and
`datasets.distributed.split_dataset_by_node` at import time, although our benchmark's dataset
(tools/torchtune_sft_components.py) never calls them. The GPU machine has no `datasets`; this
lets `import torchtune` succeed without carrying datasets, dill, multiprocess and their pins.
Put it on PYTHONPATH only where the real package is missing. Any call fails loudly.
"""
__version__ = "0.0.0+torchtune_sft_stub"


def load_dataset(*args, **kwargs):
    raise RuntimeError("datasets stub (tools/torchtune_sft_stubs): load_dataset is not available; "
                       "use tools.torchtune_sft_components.jsonl_sft_dataset")


class Dataset:  # isinstance checks only
    pass


class IterableDataset:
    pass
