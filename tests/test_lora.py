"""LoRA (--lora-rank): adapters beside frozen weights that come from --init-from. The first step is the
base model's; fsdp2 and ddp on 2 processes, accumulation and one process give the same losses (fp32,
1e-5), Muon too; the frozen weights are stored in param_dtype (bf16) beside fp32 adapters, and only the
adapters' gradients are reduced; checkpoints hold the adapters and the digest of the base, resume on
another world size, and are refused when the base changed; --export and convert_to_hf.py write the
merged model, whose logits are the adapted model's; what LoRA cannot run with is one error line.
"""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import script_runner  # noqa: E402

import ckpt_export  # noqa: E402
import model as model_lib  # noqa: E402
import train_fsdp  # noqa: E402
from test_config import error_line  # noqa: E402
from test_distributed import TINY, assert_same, assert_same_run, clean_env, comms, launch, wrap_info  # noqa: E402

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "wq,wv,wo,w2", "--lr", "1e-2"]


def cfg_of(**kw):
    return model_lib.resolve_model_config(model_lib.ModelConfig(arch="baseline", n_layer=2, d_model=32, n_head=2,
                                                                vocab_size=40, **kw))


def test_adapters_start_at_the_base_model_and_merge_into_it():
    torch.manual_seed(0)
    base, lora = model_lib.build_model(cfg_of()), model_lib.build_model(cfg_of(lora_rank=4, lora_targets="wq,w1"))
    lora.load_state_dict(base.state_dict(), strict=False)
    x = torch.randint(0, 40, (2, 12))
    assert torch.equal(lora(x)[0], base(x)[0])  # B = 0: the update is exactly zero
    trains = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trains == {f"blocks.{i}.{m}.lora_{s}" for i in range(2) for m in ("attn.wq", "mlp.w1") for s in "ab"}
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if n.endswith("lora_b"):
                p.normal_()
    assert not torch.allclose(lora(x)[0], base(x)[0], rtol=1e-3, atol=1e-3)  # the update is not zero now
    merged = model_lib.merge_lora(lora.state_dict(), lora.cfg)
    assert not any("lora" in n for n in merged)
    base.load_state_dict(merged)
    torch.testing.assert_close(base(x)[0], lora(x)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="--lora-targets 'wq,gate': 'gate' is not a projection"):
        cfg_of(lora_rank=4, lora_targets="wq,gate")
    with pytest.raises(ValueError, match="--lora-targets '': '' is not a projection"):
        cfg_of(lora_rank=4, lora_targets="")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A base model (5 steps), then from it: LoRA on 1 and 2 processes, every strategy that takes it; a full
    fine-tune; and a resume on 2 processes of the 1-process run's step 3."""
    tmp = tmp_path_factory.mktemp("lora")
    base = launch(tmp, 1, {"base": ["--strategy", "none"]}, "base")["base"][2]
    lora = ["--init-from", base] + LORA
    one = launch(tmp, 1, {"none": ["--strategy", "none", "--save-every", "3"] + lora,
                          "accum": ["--strategy", "none", "--micro-batch", "2"] + lora,
                          "muon": ["--strategy", "none", "--optimizer", "muon"] + lora,
                          "full": ["--strategy", "none", "--init-from", base, "--lr", "1e-2"]}, "one")
    resume = ["--resume", os.path.join(one["none"][2], "checkpoints", "step_0000003")]
    two = launch(tmp, 2, {"fsdp2": ["--strategy", "fsdp2"] + lora, "ddp": ["--strategy", "ddp"] + lora,
                          "bf16": ["--strategy", "fsdp2", "--param-dtype", "bf16"] + lora,
                          "fsdp2_muon": ["--strategy", "fsdp2", "--optimizer", "muon"] + lora,
                          "resumed": ["--strategy", "fsdp2", "--save-every", "3"] + lora + resume}, "two", record=True)
    return {**one, **two, "base": base, "tmp": tmp}


@pytest.mark.parametrize("name", ["fsdp2", "ddp", "accum"])
def test_every_strategy_gives_the_losses_of_one_process(runs, name):
    assert_same_run(runs[name], runs["none"])
    assert runs[name][1]["val_loss"] == pytest.approx(runs["none"][1]["val_loss"], rel=1e-5)


def test_muon_orthogonalises_the_adapters_alike_on_two_processes(runs):
    assert_same_run(runs["fsdp2_muon"], runs["muon"])
    assert runs["muon"][0][1:] != pytest.approx(runs["none"][0][1:], rel=1e-4)  # not AdamW's steps


def test_the_first_step_is_the_base_models_and_training_moves_away(runs):
    assert runs["none"][0][0] == pytest.approx(runs["full"][0][0], rel=1e-6)
    assert runs["none"][0][-1] != pytest.approx(runs["full"][0][-1], rel=1e-3)


def test_frozen_weights_are_stored_in_param_dtype_and_only_adapters_reduce(runs):
    dtypes = wrap_info(runs["bf16"])["dtypes"]
    assert {d for n, d in dtypes.items() if "lora_" in n} == {"torch.float32"}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {"torch.bfloat16"}
    log = Path(runs["fsdp2"][2], "training_log.txt").read_text()
    trainable = sum(p.numel() for n, p in model_lib.build_model(cfg_of(lora_rank=4, lora_targets="wq,wv,wo,w2"))
                    .named_parameters() if p.requires_grad)
    assert f"trainable {trainable:,} |" in log
    # fsdp2 reduce-scatters each unit's gradients: a unit with none (the root: embedding, norm, head) none
    assert all(step.get("reduce_scatter_single") == 2 for step in comms(runs["fsdp2"])), comms(runs["fsdp2"])


def test_checkpoints_hold_the_adapters_and_the_digest_of_the_base(runs):
    step = Path(runs["none"][2], "checkpoints", "step_0000005")
    metadata = train_fsdp.read_dcp_metadata(str(step / "dcp")).state_dict_metadata
    saved = {k.removeprefix("model.") for k in metadata if k.startswith("model.")}
    assert saved and all(".lora_" in k for k in saved)
    assert not (step / "model.pt").exists()  # the whole model is --export's, merged
    meta = json.loads((step / "meta.json").read_text())
    assert meta["data"][ckpt_export.FROZEN] == ckpt_export.weights_digest(runs["base"], train_fsdp)


def test_a_resume_on_another_world_size_continues_the_run(runs):
    """Step 3 of the one-process run, resumed by fsdp2 on 2 processes: the adapters reshard, the base comes
    from --init-from again, and steps 4 and 5 are the one-process run's."""
    assert_same(runs["resumed"][0] + runs["none"][0][:3], runs["none"][0][3:] + runs["none"][0][:3])
    log = Path(runs["resumed"][2], "training_log.txt").read_text()
    assert "(the frozen ones)" in log and "resumed from" in log


def adapted(step_dir):
    """The model the run trained, base and adapters unmerged, from the base and the checkpoint's adapters."""
    meta = json.loads(Path(step_dir, "meta.json").read_text())
    model = model_lib.build_model(model_lib.ModelConfig(**meta["config"]["model"]))
    train_fsdp.init_weights_from(meta["config"]["checkpoint"]["init_from"], model)
    adapters = ckpt_export.saved_model(str(step_dir), train_fsdp)
    assert sorted(model.load_state_dict(adapters, strict=False).unexpected_keys) == []
    return model.eval()


def test_export_and_convert_to_hf_write_the_merged_model(runs):
    transformers = pytest.importorskip("transformers")
    step = Path(runs["ddp"][2], "checkpoints", "step_0000005")
    res = script_runner.run("train_fsdp.py", ["--export", step], ROOT, clean_env())
    assert res.returncode == 0, res.stderr[-3000:]
    saved = torch.load(step / "model.pt", weights_only=True)
    assert saved["config"]["model"]["lora_rank"] == 0 and not any("lora" in k for k in saved["model"])
    assert json.loads((step / "meta.json").read_text())["config"]["model"]["lora_rank"] == 4  # the run's, kept
    merged = model_lib.build_model(model_lib.ModelConfig(**saved["config"]["model"]))
    merged.load_state_dict(saved["model"])
    out = runs["tmp"] / "hf"
    res = script_runner.run("convert_to_hf.py", [step, out], ROOT, clean_env())
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, merged.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        ours = adapted(step)(x)[0]
        torch.testing.assert_close(merged.eval()(x)[0], ours, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs(x).logits, ours, rtol=1e-4, atol=1e-4)


def run_cli(args):
    return script_runner.run("train_fsdp.py", TINY + ["--cache-dir", "cache"] + args, ROOT, clean_env())


def test_a_changed_base_is_refused_on_resume_and_export(runs, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(runs["base"], base)
    args = ["--strategy", "none", "--init-from", str(base), "--out-dir", str(tmp_path / "run"), "--max-steps", "2",
            *LORA]
    res = run_cli(args)
    assert res.returncode == 0, res.stderr[-3000:]
    model_pt = next(base.glob("checkpoints/step_*/model.pt"))
    state = torch.load(model_pt, weights_only=True)
    state["model"]["norm.weight"] += 1
    torch.save(state, model_pt)
    line = error_line(run_cli(args + ["--max-steps", "3"]))
    assert "holds a run with other data (data: frozen weights (--init-from) changed)" in line
    res = script_runner.run("train_fsdp.py", ["--export", tmp_path / "run" / "checkpoints" / "latest"], ROOT,
                            clean_env())
    assert "whose files have changed since the run" in error_line(res)


@pytest.mark.parametrize("args, says", [
    (["--strategy", "fsdp"], "frozen weights from --init-from (LoRA's base) need --strategy fsdp2, ddp or none: "
                             "FSDP1 flattens"),
    (["--checkpoint-type", "full"], "frozen weights from --init-from (LoRA's base) need --checkpoint-type sharded"),
    ([], "--lora-rank needs --init-from: the weights its adapters adapt"),
])
def test_what_lora_cannot_run_with_is_one_line(runs, tmp_path, args, says):
    init = [] if not args else ["--init-from", runs["base"]]
    res = run_cli(["--strategy", "none", "--out-dir", str(tmp_path / "run"), *LORA, *init, *args])
    assert says in error_line(res)
    assert not (tmp_path / "run").exists()


def test_a_relative_base_is_found_from_another_directory(runs, tmp_path):
    """The run records --init-from's absolute path: --export from elsewhere finds the base."""
    shutil.copytree(runs["base"], tmp_path / "base")
    res = script_runner.run(os.path.join(ROOT, "train_fsdp.py"), TINY + [
        "--cache-dir", "cache", "--strategy", "none", "--out-dir", "run", "--max-steps", "2", "--init-from", "base",
        *LORA], tmp_path, clean_env())
    assert res.returncode == 0, res.stderr[-3000:]
    res = script_runner.run("train_fsdp.py", ["--export", tmp_path / "run" / "checkpoints" / "latest"], ROOT,
                            clean_env())
    assert res.returncode == 0 and "wrote" in res.stdout, res.stderr[-3000:]
