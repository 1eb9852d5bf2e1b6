"""The small-model entries of `bench.py --suite small` that use every GPU of the node (DDP, FSDP1,
FSDP2, each backend's whole model as one unit), without the one-GPU entries: issue 15's
multi-GPU comparison. Run from the repository root: `python tools/gpu_small_multi.py`."""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import bench  # noqa: E402
import train_fsdp  # noqa: E402

args = bench.build_arg_parser().parse_args(["--out", "/tmp/multi", "--timeout-s", "100"])
os.makedirs(args.out, exist_ok=True)
gemm = bench.gemm_tflops()
peak = train_fsdp.peak_flops(torch.device("cuda", 0)) / 1e12
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, GEMM {gemm:.0f} TFLOP/s", flush=True)
rows = []
for entry in bench.suite("small", torch.cuda.device_count()):
    if entry[1] > 1 and "SHARD_GRAD_OP" not in entry[0]:
        rows.append(bench.run_entry(entry, args, peak, gemm))
        print(json.dumps(rows[-1]), flush=True)
print(bench.markdown(rows, "small, all GPUs"))
