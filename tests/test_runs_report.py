"""runs_report.py: runs' metrics.jsonl in one figure of a fixed size, the sweep's Markdown table,
and bad input as one `error:` line with exit code 2 and nothing written."""
import json
import math
import os
import struct
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import runs_report  # noqa: E402
from test_distributed import clean_env  # noqa: E402


def png_size(path):
    with open(path, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def write_run(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def baseline_rows(steps=6):
    """Records as the trainer writes them: one a step, validation every 2 steps."""
    rows = []
    for s in range(1, steps + 1):
        rows.append({"step": s, "loss": 4 / s, "ce": 4 / s, "lr": 1e-3 * min(1, s / 2), "grad_norm": 2 / s,
                     "tokens_per_s": 1e4 + s, "step_time_s": 0.05, "tokens_seen": 528 * s})
        if s % 2 == 0:
            rows.append({"step": s, "val_loss": 4.2 / s, "val_ce": 4.2 / s, "tokens_seen": 528 * s})
    return rows


def test_draws_two_runs_into_one_png(tmp_path):
    """A baseline run and a Free Transformer run (KL, r_rms_ratio; validation without
    tokens_seen, as written before it existed) overlaid in one PNG of the fixed size."""
    pytest.importorskip("matplotlib", reason="pip install matplotlib (.ci/run does)")
    baseline = write_run(tmp_path / "baseline", baseline_rows())
    rows = [{"step": s, "loss": 3 - s / 10, "ce": 3 - s / 10, "kl": 0.1 * s, "r_rms_ratio": 1.0, "lr": 1e-3,
             "grad_norm": 1.0, "tokens_per_s": 1e4, "tokens_seen": 528 * s} for s in (1, 2, 3)]
    rows.append({"step": 3, "val_loss": 2.8, "val_ce": 2.7, "val_kl": 0.3, "val_r_rms_ratio": 1.0})
    free = write_run(tmp_path / "free", rows)
    out = tmp_path / "plot.png"
    runs_report.main([str(baseline), str(free), "-o", str(out)])
    assert png_size(out) == (runs_report.WIDTH * runs_report.DPI, runs_report.HEIGHT * runs_report.DPI)
    assert out.stat().st_size > 20_000  # eight panels of lines, not an empty canvas


def test_table_of_runs_with_and_without_the_noise_share(tmp_path):
    """The kappa-sweep table: one row per run; a demo.json written before same_noise_share
    existed gets a dash in those columns."""
    for name, noise in (("new", {"same_noise_share": 0.5}), ("old", {})):
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"model": {"kappa": math.log(2) / 2}}))
        (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "val_ce": 0.3, "val_kl": 0.34}) + "\n")
        (run / "demo.json").write_text(json.dumps({k: {"same_start_share": 0.25, **noise}
                                                   for k in ("fixed_z", "fresh_z")}))
    rows = runs_report.summarize([str(tmp_path / "new"), str(tmp_path / "old")]).splitlines()
    assert rows[2] == "| new | 0.5 | 0.3000 | 0.3400 | 25.0 % | 25.0 % | 50.0 % | 50.0 % |"
    assert rows[3] == "| old | 0.5 | 0.3000 | 0.3400 | 25.0 % | 25.0 % | – | – |"


def test_missing_matplotlib_is_one_line(tmp_path):
    """matplotlib shadowed by a package that fails to import: one `error:` line naming what to
    install, exit code 2, nothing written."""
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = clean_env()
    env["PYTHONPATH"] = str(tmp_path / "shadow")
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "runs_report.py", str(tmp_path), "-o", str(out / "p.png")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith("error: runs_report.py needs the matplotlib package")
    assert len(res.stderr.splitlines()) == 1 and res.stderr.rstrip().endswith("pip install matplotlib")
    assert not out.exists()


def refused(capsys, argv, *expected, code=2):
    """runs_report.main(argv) exits with `code` after one `error:` line holding each of `expected`."""
    with pytest.raises(SystemExit) as e:
        runs_report.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code and err.startswith("error: ") and err.count("\n") == 1, err
    assert all(x in err for x in expected), err


def test_a_last_record_cut_mid_write_is_skipped_and_said(tmp_path, capsys):
    """A killed run leaves its last line half-written: the figure is drawn from the others."""
    pytest.importorskip("matplotlib", reason="pip install matplotlib (.ci/run does)")
    run = write_run(tmp_path / "killed", baseline_rows())
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 7, "loss": 0.57, "lr": 0.0')
    out = tmp_path / "plot.png"
    runs_report.main([str(run), "-o", str(out)])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "skipped line 10, cut mid-write" in err[0], err
    assert png_size(out) == (runs_report.WIDTH * runs_report.DPI, runs_report.HEIGHT * runs_report.DPI)


def test_garbage_is_one_error_line_and_nothing_written(tmp_path, capsys):
    """Binary bytes, a line that is not JSON before the last, a JSON value that is not a record,
    an extension matplotlib does not write: one `error:` line, exit 2, no figure."""
    pytest.importorskip("matplotlib", reason="pip install matplotlib (.ci/run does)")
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "metrics.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x80")
    nul = tmp_path / "nul"
    nul.mkdir()
    (nul / "metrics.jsonl").write_bytes(b"\x00" * 64)
    middle = write_run(tmp_path / "middle", baseline_rows())
    (middle / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n{"step": 2, "loss": 1.0}\n')
    values = write_run(tmp_path / "values", baseline_rows())
    (values / "metrics.jsonl").write_text("[1, 2]\n3\n")
    good = write_run(tmp_path / "good", baseline_rows())
    out = tmp_path / "out" / "plot.png"
    refused(capsys, [str(binary), "-o", str(out)], "metrics.jsonl", "not UTF-8 text")
    refused(capsys, [str(nul), "-o", str(out)], "metrics.jsonl", "binary data")
    refused(capsys, [str(middle), "-o", str(out)], "line 2 is not JSON")
    refused(capsys, [str(values), "-o", str(out)], "line 1 is not a metrics record")
    refused(capsys, [str(good), "-o", str(tmp_path / "out" / "plot.txt")], "no .txt", ".pdf")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("ext, head", [("png", b"\x89PNG"), ("pdf", b"%PDF"), ("svg", b"<?xml")])
def test_writes_png_pdf_and_svg_into_a_directory_it_creates(tmp_path, ext, head):
    """The output's extension picks the format; its directory is made (make plot's default,
    runs/plot.png, before any run made runs/)."""
    pytest.importorskip("matplotlib", reason="pip install matplotlib (.ci/run does)")
    run = write_run(tmp_path / "run", baseline_rows())
    out = tmp_path / "runs" / "sub" / f"plot.{ext}"
    runs_report.main([str(run), "-o", str(out)])
    assert out.read_bytes().startswith(head) and out.stat().st_size > 5_000
