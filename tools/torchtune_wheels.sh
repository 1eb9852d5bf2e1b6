# Sourced by tools/torchtune_sft_gpu.sh and tools/lora_gpu.sh, from the repository root with ROOT and OUT
# set: torchtune and the wheels it needs, from .whl/ into /tmp/site (offline); TT_PYTHONPATH, the path
# torchtune's side runs with; the versions into $OUT/versions.txt.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl 2>&1 | grep -v "Running pip as the 'root' user" || true
TT_PYTHONPATH=/tmp/site:$ROOT/tools
# torchtune imports Hugging Face `datasets` at import time; our dataset never uses it: a stub where it is missing
python3 -c "import datasets" 2>/dev/null || TT_PYTHONPATH=$TT_PYTHONPATH:$ROOT/tools/torchtune_sft_stubs
PYTHONPATH=$TT_PYTHONPATH python3 -c "
import torch, torchtune, torchao, tokenizers
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')
print('torchtune', torchtune.__version__, 'torchao', torchao.__version__, 'tokenizers', tokenizers.__version__)
from torchtune.utils._import_guard import _SUPPORTS_FLEX_ATTENTION
print('flex attention (packed rows: per-document causal mask):', _SUPPORTS_FLEX_ATTENTION)
" 2>&1 | tee "$OUT/versions.txt"
