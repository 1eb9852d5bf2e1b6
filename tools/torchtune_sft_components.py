"""torchtune components for the torchtune-vs-ours SFT benchmark (tools/torchtune_sft_full.yaml, run by
tools/torchtune_sft_gpu.sh). With tools/ on PYTHONPATH the YAML names them `torchtune_sft_components.X`.

- `hf_json_tokenizer`: a model tokenizer around torchtune's HuggingFaceBaseTokenizer (tokenizer.json +
  tokenizer_config.json) with what the recipe and datasets use: encode/decode, bos_id, eos_id, pad_id,
  max_seq_len, special_tokens, tokenize_messages, __call__.
- `jsonl_sft_dataset`: the {"prompt", "completion"} JSONL of tools/torchtune_sft_data.py, tokenised by its
  `tokenize_row` (prompt labelled -100), wrapped in torchtune's PackedDataset when packed=True. Needs no
  Hugging Face `datasets` (torchtune still imports it: see tools/torchtune_sft_stubs).
- `NoSaveHFCheckpointer`: FullModelHFCheckpointer that loads as usual (all shards of the index when
  checkpoint_files is empty) and skips the end-of-epoch save (the recipe always saves; 2.5 GB at 1B).
- `TimedDiskLogger`: DiskLogger adding `step_time_s`, the wall time between successive log_dict calls.
"""
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torchtune_sft_data  # noqa: E402
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, Message  # noqa: E402
from torchtune.datasets import PackedDataset  # noqa: E402
from torchtune.modules.transforms.tokenizers import (  # noqa: E402
    HuggingFaceBaseTokenizer,
    tokenize_messages_no_special_tokens,
)
from torchtune.training import FullModelHFCheckpointer  # noqa: E402
from torchtune.training.metric_logging import DiskLogger  # noqa: E402
from torchtune.utils import get_logger  # noqa: E402

log = get_logger("INFO")
assert CROSS_ENTROPY_IGNORE_IDX == torchtune_sft_data.IGNORE_INDEX


class HFJsonModelTokenizer:
    """torchtune ModelTokenizer + Transform over a Hugging Face tokenizer.json."""

    def __init__(self, path: str, tokenizer_config_path: Optional[str] = None, max_seq_len: Optional[int] = None):
        cfg_path = tokenizer_config_path or os.path.join(os.path.dirname(path), "tokenizer_config.json")
        self.base = HuggingFaceBaseTokenizer(path, tokenizer_config_json_path=cfg_path)
        self.tokenizer = self.base.tokenizer  # tokenizers.Tokenizer
        self.bos_id, self.eos_id = self.base.bos_id, self.base.eos_id
        with open(cfg_path) as fh:
            pad = json.load(fh).get("pad_token")
        pad = pad["content"] if isinstance(pad, dict) else pad
        pad_id = self.tokenizer.token_to_id(pad) if pad else None
        self.pad_id = pad_id if pad_id is not None else 0
        self.max_seq_len = max_seq_len
        self.special_tokens = {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        self.stop_tokens = [self.eos_id]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True, **kwargs) -> List[int]:
        return self.base.encode(text, add_bos=add_bos, add_eos=add_eos)

    def decode(self, token_ids: List[int], **kwargs) -> str:
        return self.base.decode(token_ids)

    def tokenize_messages(self, messages: List[Message], *, add_end_tokens: bool = True, **kwargs
                          ) -> Tuple[List[int], List[bool]]:
        tokens, mask = tokenize_messages_no_special_tokens(
            self, messages, bos_id=self.bos_id, eos_id=self.eos_id if add_end_tokens else None)
        if self.max_seq_len is not None:
            tokens, mask = tokens[:self.max_seq_len], mask[:self.max_seq_len]
        return tokens, mask

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        tokens, mask = self.tokenize_messages(sample.pop("messages"), add_end_tokens=not inference)
        sample["tokens"], sample["mask"] = tokens, mask
        return sample


def hf_json_tokenizer(path: str, tokenizer_config_path: Optional[str] = None,
                      max_seq_len: Optional[int] = None) -> HFJsonModelTokenizer:
    return HFJsonModelTokenizer(path, tokenizer_config_path, max_seq_len)


class JsonlSFTDataset(Dataset):
    """Map-style: item i is {"tokens", "labels"} of row i, tokenised by torchtune_sft_data.tokenize_row."""

    def __init__(self, tokenizer: HFJsonModelTokenizer, source: str, max_seq_len: Optional[int] = None,
                 max_rows: Optional[int] = None):
        with open(source) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        if max_rows:
            rows = rows[:max_rows]
        self.samples = [torchtune_sft_data.tokenize_row(tokenizer.tokenizer, r, tokenizer.bos_id,
                                                        tokenizer.eos_id, max_seq_len) for r in rows]
        n = sum(len(t) for t, _ in self.samples)
        trained = sum(sum(x != CROSS_ENTROPY_IGNORE_IDX for x in lab) for _, lab in self.samples)
        log.info(f"jsonl_sft_dataset: {source}: {len(self.samples)} rows, {n} tokens, "
                 f"{trained} trained (labelled) tokens ({trained / max(n, 1):.3f})")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Dict[str, List[int]]:
        tokens, labels = self.samples[i]
        return {"tokens": list(tokens), "labels": list(labels)}


def jsonl_sft_dataset(tokenizer: HFJsonModelTokenizer, *, source: str, packed: bool = False,
                      max_seq_len: Optional[int] = None, split_across_pack: bool = False,
                      max_rows: Optional[int] = None, max_packs: Optional[int] = None):
    max_seq_len = max_seq_len or tokenizer.max_seq_len
    ds = JsonlSFTDataset(tokenizer, source, max_seq_len, max_rows)
    if not packed:
        return ds
    if max_seq_len is None:
        raise ValueError("packed=True needs max_seq_len (dataset.max_seq_len or tokenizer.max_seq_len)")
    packed_ds = PackedDataset(ds, max_seq_len=max_seq_len, padding_idx=tokenizer.pad_id,
                              split_across_pack=split_across_pack, max_packs=max_packs)
    n = max(len(packed_ds), 1)
    labelled = sum(int((p["labels"] != CROSS_ENTROPY_IGNORE_IDX).sum()) for p in packed_ds.packs)
    # pads continue input_pos from the last document, so a pack's real tokens are those before its pad tail
    pad_tail = sum(_pad_tail(p["tokens"], p["labels"], tokenizer.pad_id) for p in packed_ds.packs)
    log.info(f"jsonl_sft_dataset: {len(packed_ds)} packs of {max_seq_len}; per pack: labelled tokens "
             f"{labelled / n:.0f}, non-pad tokens {max_seq_len - pad_tail / n:.0f}, "
             f"non-pad fraction {1 - pad_tail / (n * max_seq_len):.4f}, labelled fraction "
             f"{labelled / (n * max_seq_len):.4f}")
    return packed_ds


def _pad_tail(tokens, labels, pad_id):
    """Number of padding positions PackedDataset appended at the end of a pack."""
    tokens, labels = (x.tolist() if isinstance(x, torch.Tensor) else x for x in (tokens, labels))
    k = len(tokens)
    while k > 0 and tokens[k - 1] == pad_id and labels[k - 1] == CROSS_ENTROPY_IGNORE_IDX:
        k -= 1
    return len(tokens) - k


class NoSaveHFCheckpointer(FullModelHFCheckpointer):
    """Loads like FullModelHFCheckpointer; save_checkpoint does nothing (benchmark runs only)."""

    def __init__(self, checkpoint_dir: str, checkpoint_files: Optional[List[str]] = None, **kwargs):
        if not checkpoint_files:
            index = Path(checkpoint_dir) / "model.safetensors.index.json"
            if index.exists():
                checkpoint_files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            else:
                checkpoint_files = ["model.safetensors"]
        super().__init__(checkpoint_dir, list(checkpoint_files), **kwargs)

    def save_checkpoint(self, state_dict: Dict[str, Any], epoch: int, intermediate_checkpoint: bool = False,
                        **kwargs) -> None:
        log.info(f"NoSaveHFCheckpointer: epoch {epoch} checkpoint not written (benchmark)")


class TimedDiskLogger(DiskLogger):
    """DiskLogger; each log_dict line also has step_time_s, the wall time since the previous log_dict
    (with log_every_n_steps=1: one optimizer step, as the recipe synchronises on loss.item() first)."""

    def __init__(self, log_dir: str, filename: Optional[str] = None, **kwargs):
        super().__init__(log_dir, filename, **kwargs)
        self._last = time.perf_counter()

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        now = time.perf_counter()
        payload = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in payload.items()}
        payload["step_time_s"] = now - self._last
        self._last = now
        super().log_dict(payload, step)
