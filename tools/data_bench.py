"""Token-cache build throughput against one thread of the tokenizer (BENCHMARKS.md, "Data").

python tools/data_bench.py OUT --mb 1000 [--workers 16 4 1] [--train-tokenizer] [--first-step]

Builds OUT/corpus-<mb>.txt (the Python standard library's .py files, repeated to the size), a
BPE-4096 tokenizer trained on its first MB, then times:
- one thread: SentencePiece's encode of the corpus's first 256 MB line by line in one process,
  results kept as lists (the cores' limit is this times the cores);
- `python data.py` given that tokenizer, once per --workers, each into an empty cache: MB/s, its
  ratio to the cores' limit, and the peak memory of the build's processes together (PSS, sampled);
- --train-tokenizer: `python data.py` training the tokenizer too (the trainer's default);
- --first-step: `python train_fsdp.py` on the corpus from a cold cache to its first step.
"""
import argparse
import json
import os
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import data  # noqa: E402


def build_corpus(path: Path, mb: int) -> None:
    if path.exists() and path.stat().st_size >= mb << 20:
        return
    stdlib, chunks = sysconfig.get_paths()["stdlib"], []
    for root, dirs, files in sorted(os.walk(stdlib)):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        chunks += [Path(root, f).read_bytes() for f in sorted(files) if f.endswith(".py")]
    block = b"".join(chunks)
    with open(path, "wb") as f:
        while f.tell() < mb << 20:
            f.write(block[:(mb << 20) - f.tell()])
        f.write(b"\n")


def tree_pss(pid: int) -> int:
    """Proportional set size of a process and its descendants, from /proc: the memory they use
    together, each page shared by forked processes counted once."""
    children = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0, [pid]
    while todo:
        q = todo.pop()
        todo += children.get(q, [])
        try:
            pss = next(line for line in open(f"/proc/{q}/smaps_rollup") if line.startswith("Pss:"))
            total += int(pss.split()[1]) << 10
        except (OSError, StopIteration):
            pass
    return total


def timed(cmd, env=None):
    """(seconds, peak resident bytes of the command's processes together, output)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.5):
            peak[0] = max(peak[0], tree_pss(proc.pid))
    threading.Thread(target=sample, daemon=True).start()
    out, _ = proc.communicate()
    done.set()
    if proc.returncode:
        raise SystemExit(f"{cmd} failed:\n{out[-3000:]}")
    return time.perf_counter() - t0, peak[0], out


def one_thread_mb_s(corpus: Path, model: Path) -> float:
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(model), num_threads=1)
    with open(corpus, encoding="utf-8", errors="replace") as f:
        lines = f.readlines(256 << 20)
    mb = sum(len(line.encode()) for line in lines) / 2**20
    t0 = time.perf_counter()
    ids = [sp.encode(lines[i:i + 8192], num_threads=1) for i in range(0, len(lines), 8192)]
    dt = time.perf_counter() - t0
    assert ids
    return mb / dt


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--mb", type=int, default=1000)
    p.add_argument("--workers", type=int, nargs="*", default=[len(os.sched_getaffinity(0))])
    p.add_argument("--train-tokenizer", action="store_true")
    p.add_argument("--first-step", action="store_true")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / f"corpus-{args.mb}.txt"
    build_corpus(corpus, args.mb)
    small = out / "tok.txt"
    with open(corpus, "rb") as f:
        small.write_bytes(f.read(1 << 20))
    tok_dir = out / "tok"
    tok_dir.mkdir(exist_ok=True)
    model = data.train_tokenizer(data.DataConfig(dataset=str(small)), data.parts_of(small), tok_dir)
    mb = corpus.stat().st_size / 2**20
    one = one_thread_mb_s(corpus, model)
    rows = [{"what": "one thread", "mb_s": round(one, 2)}]
    print(json.dumps(rows[-1]), flush=True)
    for w in args.workers:
        cache = out / f"cache-{w}"
        subprocess.run(["rm", "-rf", str(cache)])
        cmd = [sys.executable, "data.py", "--dataset", str(corpus), "--tokenizer", str(model), "--cache-dir",
               str(cache), "--data-workers", str(w)]
        secs, peak, _ = timed(cmd)
        rows.append({"what": f"data.py, {w} processes, given tokenizer", "mb": round(mb), "s": round(secs, 1),
                     "mb_s": round(mb / secs, 1), "of_limit": round(mb / secs / (w * one), 3),
                     "peak_pss_gib": round(peak / 2**30, 2)})
        print(json.dumps(rows[-1]), flush=True)
    if args.train_tokenizer:
        cache = out / "cache-trained"
        subprocess.run(["rm", "-rf", str(cache)])
        cmd = [sys.executable, "data.py", "--dataset", str(corpus), "--tokenizer-vocab-size", "32000",
               "--cache-dir", str(cache)]
        secs, peak, log = timed(cmd)
        rows.append({"what": "data.py, tokenizer (BPE 32000) trained too, every core", "mb": round(mb),
                     "s": round(secs, 1), "peak_pss_gib": round(peak / 2**30, 2), "log": log.strip()[-300:]})
        print(json.dumps(rows[-1]), flush=True)
    if args.first_step:
        cache, run = out / "cache-first", out / "run-first"
        subprocess.run(["rm", "-rf", str(cache), str(run)])
        cmd = [sys.executable, "train_fsdp.py", "--dataset", str(corpus), "--tokenizer-vocab-size", "32000",
               "--cache-dir", str(cache), "--strategy", "none", "--size", "small", "--max-steps", "1",
               "--eval-every", "0", "--log-every", "1", "--out-dir", str(run)]
        secs, peak, log = timed(cmd)
        startup = [line for line in log.splitlines() if "start-up" in line]
        rows.append({"what": "train_fsdp.py to its first step, cold cache", "mb": round(mb), "s": round(secs, 1),
                     "peak_pss_gib": round(peak / 2**30, 2), "start_up": startup[-1] if startup else ""})
        print(json.dumps(rows[-1]), flush=True)
    (out / f"data_bench-{args.mb}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
