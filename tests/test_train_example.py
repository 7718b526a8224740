"""examples/train.py under torchrun on 2 gloo ranks: crashed after step 4 (checkpoint at step 3),
restarted, it resumes from step 3 and its losses continue exactly as an uninterrupted run's;
the same run as a 2-stage pipeline gives the same losses."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--steps", "6", "--ckpt-every", "3", "--mesh", "dp=2"]


def _run(cwd: Path, *extra: str, args=ARGS) -> subprocess.CompletedProcess:
    # planned for Cluster.local (the default, calibrating, may plan differently run to run)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "train.py"), *args, "--cluster", "local", "--loss-log", "log.jsonl", *extra]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240)


def _log(cwd: Path) -> list[tuple[int, float]]:
    return [(d["step"], d["loss"]) for d in map(json.loads, (cwd / "log.jsonl").read_text().splitlines())]


@pytest.mark.timeout(600)
def test_kill_and_resume(tmp_path):
    run, ref = tmp_path / "run", tmp_path / "ref"
    run.mkdir()
    ref.mkdir()
    crashed = _run(run, "--crash-after", "4")
    assert crashed.returncode != 0 and (run / "ckpt" / "step3" / ".metadata").exists(), crashed.stderr[-2000:]
    assert [s for s, _ in _log(run)] == [1, 2, 3, 4]
    resumed = _run(run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from ckpt/step3 (step 3)" in resumed.stdout
    whole = _run(ref)
    assert whole.returncode == 0, whole.stderr[-3000:]
    want = dict(_log(ref))
    after = _log(run)[4:]  # the restarted run: steps 4, 5, 6 again from the step-3 checkpoint
    assert [s for s, _ in after] == [4, 5, 6]
    assert all(loss == want[s] for s, loss in after), (after, want)
    assert want[6] != want[1]  # it trained

    # the same training as a 2-stage pipeline (4 microbatches): the same losses
    pp = tmp_path / "pp"
    pp.mkdir()
    piped = _run(pp, "--mesh", "pp=2", "--microbatches", "4", "--schedule", "1f1b",
                 args=ARGS[:4])
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert [s for s, _ in _log(pp)] == [1, 2, 3, 4, 5, 6]
    assert all(loss == pytest.approx(want[s], rel=1e-4) for s, loss in _log(pp)), (_log(pp), want)


@pytest.mark.timeout(600)
def test_export_hf_then_init_from(tmp_path):
    """``--export-hf`` writes a directory ``from_pretrained`` loads; ``--init-from`` starts a
    run from it (built on meta, each rank reading its shards): its first loss is the loaded
    HF model's on the same batch, in one process."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "examples"))
    import train

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    out = tmp_path / "hf"
    first = _run(a, "--export-hf", str(out), args=["--steps", "3", "--ckpt-every", "100", "--mesh", "dp=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    second = _run(b, "--init-from", str(out), args=["--steps", "1", "--ckpt-every", "100", "--mesh", "tp=2",
                                                    "--plan", "megatron"])
    assert second.returncode == 0, second.stderr[-3000:]
    ids = train.batch(argparse.Namespace(seed=0, vocab=256, batch=8, seq=32), 0)
    with torch.no_grad():
        want = model(ids, labels=ids).loss.item()
    assert _log(b)[0][1] == pytest.approx(want, rel=1e-5), (_log(b), want)
    assert _log(a)[0][1] != pytest.approx(want, rel=1e-3)   # it is the trained model, not the start
