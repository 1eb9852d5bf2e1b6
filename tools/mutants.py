#!/usr/bin/env python3
"""Plants realistic bugs (mutants), one at a time, in a scratch copy of the repository and reports
which ones the test suite catches. Runnable by hand (`make mutants`), never part of `make test`.

    python tools/mutants.py [--only ID,...] [--tests mapped|all] [--baseline] [--cpu 1] [--jobs 1]
                            [--timeout-s 1500] [--out FILE] [--keep] [--list] [--check]

Each mutant replaces one exact snippet (`old`, which must occur exactly once in its file: a stale
mutant, whose source moved, is named and not run) by `new`. The scratch copy holds the working
tree as it is (tracked and untracked files that git does not ignore, uncommitted changes included),
not HEAD. pytest then runs the mutant's mapped tests (`tests`; --tests all: the whole suite) with
-x -q -p no:cacheprovider and a timeout: "caught" (the tests failed), "missed" (they passed),
"timeout", or "error" (the mutation did not apply, or pytest found no test). --baseline first runs
the same tests unmutated: a mutant whose tests already fail there is "baseline-fails", not caught.
--cpu LIST runs pytest (and every process it starts) under `taskset -c LIST`; OMP_NUM_THREADS=1.
Results: a JSON file (--out, default runs/mutants.json) and a table on stdout.
"""
import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# id, file, area, what (the bug, one line), old (an exact snippet, unique in file), new, tests (files or node ids).
MUTANTS = [
    # ---------------------------------------------------------------------------------------------
    # train_fsdp.py: distributed paths (accumulation, clipping, no_sync, state-dict options, resume)
    dict(id="accum-row-offset", file="train_fsdp.py", area="accumulation",
         what="micro-batch row offset forgets the world size: ranks read overlapping rows, some never",
         old="start = (m * topo.world + topo.rank) * plan.micro",
         new="start = (m + topo.rank) * plan.micro",
         tests=["tests/test_distributed.py::test_accumulation_layouts_are_equal"]),
    dict(id="accum-loss-divisor", file="train_fsdp.py", area="accumulation",
         what="each micro-batch loss divided by its rows (already a mean) instead of its share of the step",
         old="scaled = loss / share",
         new="scaled = loss / x.shape[0]",
         tests=["tests/test_distributed.py::test_accumulation_layouts_are_equal"]),
    dict(id="accum-logged-loss-summed", file="train_fsdp.py", area="accumulation",
         what="logged losses summed over the micro-batches, not averaged",
         old="totals[k] = totals.get(k, 0.0) + v.float() / share",
         new="totals[k] = totals.get(k, 0.0) + v.float()",
         tests=["tests/test_distributed.py::test_accumulation_layouts_are_equal"]),
    dict(id="targets-mean-of-means", file="train_fsdp.py", area="accumulation",
         what="a mean of the micro-batches' means, not of the step's targets: equal only without IGNORE",
         old="share = of_step / (targets[m] * dist.get_world_size())",
         new="share = len(batches)",
         tests=["tests/test_instruct.py::test_every_strategy_and_accumulation_give_the_same_losses"]),
    dict(id="targets-of-this-rank", file="train_fsdp.py", area="accumulation",
         what="the step's targets counted on this rank alone (no all-reduce): each rank its own mean",
         old="    dist.all_reduce(of_step)\n",
         new="    of_step = of_step * dist.get_world_size()\n",
         tests=["tests/test_instruct.py::test_every_strategy_and_accumulation_give_the_same_losses"]),
    dict(id="val-mean-of-rows", file="train_fsdp.py", area="evaluation",
         what="validation weighted by rows, not by targets: a mean of the rows' means",
         old="targets = (y != IGNORE).sum().float() if count else 0",
         new="targets = count",
         tests=["tests/test_instruct.py::test_the_loss_is_the_mean_over_the_targets_of_the_validation_answers"]),
    dict(id="packed-documents-see-each-other", file="model.py", area="document masking",
         what="the decoder's document mask loses its documents: packed examples attend across",
         old="return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1), (same & causal, same)",
         new="return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1), (causal, same)",
         tests=["tests/test_instruct.py::test_packed_documents_do_not_see_each_other_and_restart_rope"]),
    dict(id="no-sync-last-off-by-one", file="train_fsdp.py", area="no_sync",
         what="the last micro-batch is never recognised: every one runs under no_sync, no reduction",
         old='reduce = m == len(batches) - 1 or cfg.train.grad_accum_mode == "sync"',
         new='reduce = m == len(batches) or cfg.train.grad_accum_mode == "sync"',
         tests=["tests/test_distributed.py::test_accumulation_layouts_are_equal"]),
    dict(id="no-sync-never-entered", file="train_fsdp.py", area="no_sync",
         what="FSDP1 never enters no_sync on the non-last micro-batches (same numbers, a reduction each)",
         old="resolve=resolve_fsdp1, no_sync=lambda model: model.no_sync()",
         new="resolve=resolve_fsdp1, no_sync=lambda model: contextlib.nullcontext()",
         tests=["tests/test_distributed.py::test_no_sync_reduces_gradients_once_per_step"]),
    dict(id="fsdp2-sync-not-restored", file="train_fsdp.py", area="no_sync",
         what="FSDP2's gradient sync is turned off for a micro-batch and never turned back on",
         old="model.set_requires_gradient_sync(True)",
         new="pass",
         tests=["tests/test_distributed.py::test_fsdp2_equals_one_process"]),
    dict(id="clip-before-unscale", file="train_fsdp.py", area="clipping",
         what="fp16: gradients clipped (and their norm logged) before the scaler unscales them",
         old="    if scaler:\n        scaler.unscale_(optimizer)\n    grad_norm = strategy.clip(model, cfg.train.grad_clip or math.inf)",
         new="    grad_norm = strategy.clip(model, cfg.train.grad_clip or math.inf)\n    if scaler:\n        scaler.unscale_(optimizer)",
         tests=["tests/test_distributed.py::test_fp16_with_sharded_grad_scaler"]),
    dict(id="clip-fsdp1-local-norm", file="train_fsdp.py", area="clipping",
         what="FSDP1 clipped with torch.nn.utils.clip_grad_norm_: each rank clips by its own shard's norm",
         old="clip=lambda model, limit: model.clip_grad_norm_(limit)",
         new="clip=clip_norm",
         tests=["tests/test_distributed.py::test_fsdp_two_processes_equal_one_process"]),
    dict(id="clip-limit-ignored", file="train_fsdp.py", area="clipping",
         what="--grad-clip is never applied: the norm is computed and logged, the gradients left unclipped",
         old="grad_norm = strategy.clip(model, cfg.train.grad_clip or math.inf)",
         new="grad_norm = strategy.clip(model, math.inf)",
         tests=["tests/test_train_misc.py::test_grad_clip_scales_the_gradients_to_the_limit",
                "tests/test_train_misc.py::test_log_records_and_start_up_summary",
                "tests/test_distributed.py::test_fsdp_two_processes_equal_one_process"]),
    dict(id="sdo-offload-no-shard", file="train_fsdp.py", area="state-dict options",
         what="sharded save offloads FSDP1's state to the host under NO_SHARD too (the moments themselves)",
         old='copies = strategy_of(cfg).copies_shards and cfg.fsdp.sharding_strategy != "NO_SHARD"',
         new='copies = strategy_of(cfg).copies_shards',
         tests=["tests/test_checkpoint.py::test_only_a_sharding_fsdp1_on_a_gpu_offloads_the_state_of_a_sharded_save"]),
    dict(id="sdo-full-save-sharded", file="train_fsdp.py", area="state-dict options",
         what="the consolidated model.pt is saved without full_state_dict: each rank's shards, not the model",
         old='self.full = StateDictOptions(full_state_dict=True, cpu_offload=topo.device.type != "cpu")',
         new='self.full = StateDictOptions(cpu_offload=topo.device.type != "cpu")',
         tests=["tests/test_seams.py::test_meta_init_keeps_the_tie_and_refuses_an_uninitialised_module",
                "tests/test_distributed.py::test_full_state_dict_loads_into_unwrapped_model"]),
    dict(id="resume-rng-not-restored", file="train_fsdp.py", area="resume RNG",
         what="a same-world-size resume re-seeds instead of restoring the saved RNG states",
         old='set_rng_state(load_weights_only(os.path.join(path, f"rng_rank{topo.rank}.pt")))',
         new='torch.manual_seed(seed + topo.rank)',
         tests=["tests/test_checkpoint.py::test_free_transformer_resume_restores_the_sampling_rng"]),
    dict(id="resume-reseed-ignores-step", file="train_fsdp.py", area="resume RNG",
         what="a resume at another world size re-seeds from the seed alone: the run's first RNG streams again",
         old="torch.manual_seed(seed + topo.rank + 1_000_003 * meta[\"step\"])",
         new="torch.manual_seed(seed + topo.rank)",
         tests=["tests/test_checkpoint.py::test_resume_on_one_process"]),
    dict(id="resume-save-step-off-by-one", file="train_fsdp.py", area="resume data order",
         what="the checkpoint after step N is saved as step N-1: a resume trains step N's batch twice",
         old="checkpointer.save(step + 1, tokens_seen, model, optimizer",
         new="checkpointer.save(step, tokens_seen, model, optimizer",
         tests=["tests/test_seams.py::test_strategies_on_two_processes_sigterm_and_resume"]),
    # ---------------------------------------------------------------------------------------------
    # train_fsdp.py: checkpoint safety (atomic publish, fallback, the lock, refusal of unsafe pickles)
    dict(id="ckpt-latest-before-rename", file="train_fsdp.py", area="atomic publish",
         what="`latest` is written before the staging directory is renamed into place",
         old='    os.replace(tmp, path)\n    fsync_path(root)\n    write_text_atomic(os.path.join(root, "latest"), '
             'name + "\\n")  # last: it names a complete one',
         new='    write_text_atomic(os.path.join(root, "latest"), name + "\\n")\n    os.replace(tmp, path)\n'
             '    fsync_path(root)',
         tests=["tests/test_checkpoint.py::test_latest_is_written_after_the_checkpoint_is_in_place"]),
    dict(id="ckpt-latest-in-place", file="train_fsdp.py", area="atomic publish",
         what="markers (latest, best, meta.json) are rewritten in place, not through a temporary file and a rename",
         old='    with open(path + ".tmp", "w") as fh:\n        fh.write(text)\n        fh.flush()\n'
             '        os.fsync(fh.fileno())\n    os.replace(path + ".tmp", path)',
         new='    with open(path, "w") as fh:\n        fh.write(text)\n        fh.flush()\n'
             '        os.fsync(fh.fileno())',
         tests=["tests/test_checkpoint.py::test_latest_is_written_after_the_checkpoint_is_in_place"]),
    dict(id="ckpt-no-fsync", file="train_fsdp.py", area="atomic publish",
         what="the renamed checkpoint's directory entry is not fsync'ed before `latest` names it",
         old="    os.replace(tmp, path)\n    fsync_path(root)\n",
         new="    os.replace(tmp, path)\n",
         tests=["tests/test_checkpoint.py::test_latest_is_written_after_the_checkpoint_is_in_place"]),
    dict(id="ckpt-resave-deletes-first", file="train_fsdp.py", area="atomic publish",
         what="a step saved again deletes the old copy before the rename: a kill in between loses that step",
         old='        os.replace(path, path + ".old")',
         new="        shutil.rmtree(path)",
         tests=["tests/test_checkpoint.py::test_latest_is_written_after_the_checkpoint_is_in_place"]),
    dict(id="ckpt-truncation-unchecked", file="train_fsdp.py", area="fallback",
         what="the size check only sees files that grew: a truncated shard passes and is loaded",
         old="            if actual != size:",
         new="            if actual > size:",
         tests=["tests/test_hostile.py::test_a_run_whose_checkpoints_are_all_damaged_is_refused_not_trained_over"]),
    dict(id="ckpt-explicit-resume-falls-back", file="train_fsdp.py", area="fallback",
         what="a corrupted checkpoint given by --resume PATH falls back to other ones instead of stopping",
         old='            if cfg.checkpoint.resume != "auto":\n                raise\n',
         new="",
         tests=["tests/test_checkpoint.py::test_resume_from_a_corrupted_explicit_path_is_bad_input"]),
    dict(id="ckpt-lock-shared", file="train_fsdp.py", area="lock",
         what="the run directory's flock is taken shared: a second launch into it is not refused",
         old="fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)",
         new="fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)",
         tests=["tests/test_hostile.py::test_a_second_launch_into_a_run_directory_in_use_is_refused"]),
    dict(id="ckpt-weights-only-off", file="train_fsdp.py", area="unsafe pickles",
         what="checkpoint files loaded with weights_only=False: a planted pickle runs its code",
         old='return torch.load(path, map_location="cpu", weights_only=True, **kwargs)',
         new='return torch.load(path, map_location="cpu", weights_only=False, **kwargs)',
         tests=["tests/test_checkpoint.py::test_a_distcp_entry_that_would_run_code_is_refused",
                "tests/test_reliability_trainer.py::test_an_old_format_pickle_planted_as_the_latest_model_is_refused"]),
    dict(id="ckpt-unpickler-module-only", file="train_fsdp.py", area="unsafe pickles",
         what="the .metadata unpickler allow-lists modules, not (module, name): any torch.* global passes",
         old="if (module, name) not in self.allowed:",
         new="if module not in {m for m, _ in self.allowed}:",
         tests=["tests/test_checkpoint.py::test_metadata_reader_reads_every_strategys_checkpoints_and_refuses_callables"]),
    dict(id="ckpt-metadata-unchecked", file="train_fsdp.py", area="unsafe pickles",
         what="dcp_load hands DCP's .metadata (a plain pickle) to dcp.load without the restricted unpickler",
         old="    read_dcp_metadata(dcp_dir)\n    try:\n        dcp.load(",
         new="    try:\n        dcp.load(",
         tests=["tests/test_checkpoint.py::test_a_checkpoint_that_would_run_code_is_refused_and_nothing_runs"]),
    # ---------------------------------------------------------------------------------------------
    # model.py: the Free Transformer
    dict(id="model-kl-sign", file="model.py", area="Free Transformer",
         what="the KL to the uniform prior has its sign flipped (entropy - log 2)",
         old="return (math.log(2) - entropy).sum(-1)",
         new="return (entropy - math.log(2)).sum(-1)",
         tests=["tests/test_model.py::test_latent_kl_matches_brute_force",
                "tests/test_model.py::test_latent_kl_finite_for_extreme_logits"]),
    dict(id="model-free-bits-on-mean", file="model.py", area="Free Transformer",
         what="the free-bits hinge is applied to the mean KL, not per token",
         old="total = ce + torch.clamp(kl - kappa, min=0.0).mean()",
         new="total = ce + torch.clamp(kl.mean() - kappa, min=0.0)",
         tests=["tests/test_model.py::test_free_bits_hinge_is_per_token"]),
    dict(id="model-mapper-grad-sign", file="model.py", area="Free Transformer",
         what="the Binary Mapper's straight-through backward uses sigmoid(-l) for P(bit = 1)",
         old="            p = torch.sigmoid(lg)",
         new="            p = torch.sigmoid(-lg)",
         tests=["tests/test_model.py::test_binary_mapper_matches_dense_reference",
                "tests/test_model.py::test_training_gradient_reaches_encoder_through_mapper"]),
    dict(id="model-z-in-queries", file="model.py", area="Free Transformer",
         what="R reaches the queries (and through them the residual), not only keys and values",
         old="x = x + self.drop(self.attn(h, kv, cos, sin, mask, cache=cache))",
         new="x = x + self.drop(self.attn(kv, kv, cos, sin, mask, cache=cache))",
         tests=["tests/test_model.py::test_z_enters_only_kv_of_first_second_half_block_causally"]),
    dict(id="model-prior-ce-from-encoder", file="model.py", area="Free Transformer",
         what="the evaluation's prior_ce reads Z from the encoder (training mode), not from the prior",
         old='prior_logits, _ = model(x, mode="inference", positions=positions)',
         new="prior_logits, _ = model(x, positions=positions)",
         tests=["tests/test_free_eval.py::test_prior_ce_reads_z_from_the_prior_not_the_encoder",
                "tests/test_free_eval.py::test_posterior_ce_equals_prior_ce_when_the_encoder_is_uniform"]),
    # ---------------------------------------------------------------------------------------------
    # data.py
    dict(id="data-y-not-shifted", file="data.py", area="data",
         what="y is the window's first seq_len tokens (x itself), not x shifted by one",
         old="y = np.ascontiguousarray(block[:, 1:], dtype=np.int64)",
         new="y = np.ascontiguousarray(block[:, :-1], dtype=np.int64)",
         tests=["tests/test_data.py"]),
    dict(id="data-slice-start-ignored", file="data.py", area="data",
         what="a rank's slice of the global batch ignores its start: every rank reads the same rows",
         old="k = step * global_batch + start + np.arange(count, dtype=np.int64)",
         new="k = step * global_batch + np.arange(count, dtype=np.int64)",
         tests=["tests/test_data.py"]),
    dict(id="data-same-order-every-epoch", file="data.py", area="data",
         what="the permutation is seeded without the epoch: every epoch repeats the first one's order",
         old="perm = np.random.default_rng([self.seed, epoch]).permutation(n)",
         new="perm = np.random.default_rng(self.seed).permutation(n)",
         tests=["tests/test_data.py"]),
    dict(id="data-val-clip-off-by-one", file="data.py", area="data",
         what="validation rows clipped at n_val - 1: the last validation row is never evaluated",
         old="rows = np.arange(start, min(start + count, self.n_val), dtype=np.int64)",
         new="rows = np.arange(start, min(start + count, self.n_val - 1), dtype=np.int64)",
         tests=["tests/test_data.py"]),
    dict(id="data-epoch-shift-dropped", file="data.py", area="data",
         what="text windows of later epochs are not shifted: the same left contexts every epoch",
         old="offsets[hit] = rows * self.stride + self.epoch_shift(int(epoch))",
         new="offsets[hit] = rows * self.stride",
         tests=["tests/test_data.py"]),
    dict(id="data-val-depends-on-seed", file="data.py", area="data",
         what="the synthetic validation set is drawn from --seed: runs of other seeds validate on other rows",
         old="val = synthetic_rows(cfg.synthetic_val_samples, np.random.default_rng(SYNTH_VAL_SEED))",
         new="val = synthetic_rows(cfg.synthetic_val_samples, np.random.default_rng(seed))",
         tests=["tests/test_data.py"]),
]

FIELDS = ("id", "file", "area", "what", "old", "new", "tests")


def check_list(mutants):
    """Problems of the list itself: missing fields, duplicate ids."""
    problems, seen = [], set()
    for m in mutants:
        missing = [f for f in FIELDS if not m.get(f)]
        if missing and missing != ["new"]:  # an empty `new` deletes the snippet
            problems.append(f"{m.get('id', '?')}: missing {', '.join(missing)}")
        if m.get("id") in seen:
            problems.append(f"{m['id']}: duplicate id")
        seen.add(m.get("id"))
    return problems


def stale_reason(m, root):
    """None when `old` occurs exactly once in the file at `root`, else why the mutant is stale."""
    path = os.path.join(root, m["file"])
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        return f"{m['file']}: {e.strerror}"
    n = text.count(m["old"])
    if n != 1:
        return f"stale: its snippet occurs {n} times in {m['file']} (the source moved; update `old`)"
    return None


def working_tree_files(root):
    """The files of the working tree that git knows or would add: tracked and untracked-not-ignored."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return sorted({p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(root, p))})


def tree_state(root):
    """HEAD and the files that differ from it (the snapshot the mutants ran on)."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True).stdout
    return {"head": git("rev-parse", "HEAD").strip(), "changed": git("status", "--porcelain").splitlines()}


def scratch_copy(root, files, prefix):
    """A plain copy of `files` (the working tree's contents, uncommitted changes included) in /tmp."""
    dest = tempfile.mkdtemp(prefix=prefix)
    for rel in files:
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # deleted since git listed it
            shutil.copy2(os.path.join(root, rel), target)
    return dest


def apply_mutant(m, copy):
    """Plants the mutant in the copy; returns None, or why it could not (stale, or no longer Python)."""
    reason = stale_reason(m, copy)
    if reason:
        return reason
    path = os.path.join(copy, m["file"])
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    text = text.replace(m["old"], m["new"], 1)
    if path.endswith(".py"):
        try:
            compile(text, path, "exec")
        except SyntaxError as e:
            return f"the mutated {m['file']} does not compile: {e}"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return None


def session_pids(sid):
    """Processes of session `sid` (the one pytest was started in, and everything it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # fields after the command: state, ppid, pgrp, session
            pids.append(int(entry))
    return pids


def kill_session(sid):
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_pytest(copy, tests, args, extra=()):
    """pytest on `tests` in the copy, in a session of its own (all of which a timeout kills).
    Returns (exit code or None on timeout, seconds, output)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--basetemp", os.path.join(copy, ".pytest-tmp"), *extra, *tests]
    if args.cpu:
        cmd = ["taskset", "-c", args.cpu, *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        kill_session(proc.pid)  # on a timeout, and any straggler the tests left behind
        proc.wait()
        log.seek(0)
        output = log.read().decode(errors="replace")
    return code, time.monotonic() - t0, output


def failures(output):
    """Node ids pytest reported as FAILED or ERROR in its short summary."""
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)


def tests_of(m, args):
    return ["tests"] if args.tests == "all" else list(m["tests"])


def run_mutant(m, root, files, args, baseline_failed):
    result = {k: m[k] for k in ("id", "file", "area", "what", "tests")}
    tests = tests_of(m, args)
    broken = [f for f in baseline_failed if any(f == t or f.startswith((t + "::", t + "[")) for t in tests)]
    if broken:
        return {**result, "status": "baseline-fails", "seconds": 0.0, "detail": f"unmutated: {broken[0]} fails"}
    copy = scratch_copy(root, files, f"mutant-{m['id']}-")
    try:
        reason = apply_mutant(m, copy)
        if reason:
            return {**result, "status": "error", "seconds": 0.0, "detail": reason}
        code, seconds, output = run_pytest(copy, tests, args, extra=["-x"])
    finally:
        if args.keep:
            print(f"kept {copy}", file=sys.stderr)
        else:
            shutil.rmtree(copy, ignore_errors=True)
    found = failures(output)
    if code is None:
        status, detail = "timeout", f"no result within --timeout-s {args.timeout_s}"
    elif code == 0:
        status, detail = "missed", ""
    elif code in (1, 2) and (found or code == 2):
        status, detail = "caught", found[0] if found else "collection or import error"
    else:  # 3 internal error, 4 usage error, 5 no tests collected
        status, detail = "error", f"pytest exit {code}"
    tail = output.strip().splitlines()[-8:]
    return {**result, "status": status, "seconds": round(seconds, 1), "exit": code, "detail": detail, "tail": tail}


def run_baseline(root, files, mutants, args):
    """The selected mutants' tests on an unmutated copy, all of them (no -x). Returns the failures."""
    tests = sorted({t for m in mutants for t in tests_of(m, args)})
    copy = scratch_copy(root, files, "mutant-baseline-")
    try:
        code, seconds, output = run_pytest(copy, tests, args)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    found = failures(output) if code is not None else tests
    ok = code == 0
    print(f"baseline: {'pass' if ok else 'FAILS' if code is not None else 'TIMEOUT'} ({len(tests)} test ids, "
          f"{seconds:.0f} s)" + ("" if ok else ": " + ", ".join(found[:5])), flush=True)
    if code not in (0, 1, None):  # usage error or nothing collected: every mutant's result would be meaningless
        print(output[-3000:], file=sys.stderr)
    return {"status": "pass" if ok else "fails", "exit": code, "seconds": round(seconds, 1), "failed": found,
            "tests": tests}, found


def table(results):
    rows = [("id", "area", "status", "s", "caught by / detail")]
    for r in results:
        rows.append((r["id"], r["area"], r["status"], f"{r['seconds']:.0f}", str(r.get("detail", ""))[:90]))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--only", default="", help="comma-separated mutant ids (default: all)")
    p.add_argument("--tests", choices=["mapped", "all"], default="mapped",
                   help="each mutant's mapped tests (default) or the whole suite")
    p.add_argument("--baseline", action="store_true", help="first run the same tests on an unmutated copy")
    p.add_argument("--cpu", default="", help="taskset -c LIST for pytest and its processes, e.g. 1")
    p.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    p.add_argument("--timeout-s", type=float, default=1500, help="per mutant (default 1500)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "mutants.json"), help="JSON results file")
    p.add_argument("--keep", action="store_true", help="keep the scratch copies (their paths go to stderr)")
    p.add_argument("--list", action="store_true", help="print the mutants and exit")
    p.add_argument("--check", action="store_true", help="only check that every mutant applies (none stale)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    problems = check_list(MUTANTS)
    if problems:
        print("error: the mutant list: " + "; ".join(problems), file=sys.stderr)
        return 2
    by_id = {m["id"]: m for m in MUTANTS}
    wanted = [i for i in args.only.split(",") if i]
    unknown = [i for i in wanted if i not in by_id]
    if unknown:
        print(f"error: --only: no mutant {', '.join(unknown)}; --list shows them", file=sys.stderr)
        return 2
    mutants = [by_id[i] for i in wanted] if wanted else MUTANTS
    if args.list:
        for m in mutants:
            print(f"{m['id']:34} {m['file']:13} {m['area']:20} {m['what']}")
        return 0
    if args.check:
        stale = {m["id"]: r for m in mutants if (r := stale_reason(m, ROOT))}
        for i, reason in stale.items():
            print(f"{i}: {reason}", file=sys.stderr)
        print(f"{len(mutants) - len(stale)} of {len(mutants)} mutants apply")
        return 1 if stale else 0

    # One snapshot of the working tree (another hand may be editing it): the baseline and every mutant start
    # from the same files.
    files = working_tree_files(ROOT)
    tree, state = scratch_copy(ROOT, files, "mutants-tree-"), tree_state(ROOT)
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.monotonic()
    try:
        stale = {m["id"]: r for m in mutants if (r := stale_reason(m, tree))}
        for i, reason in stale.items():
            print(f"{i}: {reason}", file=sys.stderr)
        baseline, baseline_failed = None, []
        if args.baseline:
            baseline, baseline_failed = run_baseline(tree, files, [m for m in mutants if m["id"] not in stale], args)
        results = []
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_mutant, m, tree, files, args, baseline_failed) for m in mutants]
            for f in futures:
                r = f.result()
                results.append(r)
                print(f"{r['id']}: {r['status']} in {r['seconds']:.0f} s {r.get('detail', '')}", flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    counts = {s: sum(r["status"] == s for r in results) for s in
              ("caught", "missed", "timeout", "error", "baseline-fails")}
    report = {"started": started, "seconds": round(time.monotonic() - t0, 1), "tree": state,
              "tests": args.tests, "cpu": args.cpu or None, "python": sys.version.split()[0], "counts": counts,
              "baseline": baseline, "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
        fh.write("\n")
    print(table(results))
    print(" | ".join(f"{k} {v}" for k, v in counts.items()) + f" | {report['seconds'] / 60:.1f} min | {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
