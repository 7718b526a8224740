"""The ``fxpar`` command on a small model: plan, explain, compare, dump (single process)."""

from __future__ import annotations

import textwrap

import pytest

from fxpar.cli import main
from fxpar.plan_data import Plan

MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)), (torch.randn(8, 16),)
""")
COMMON = ["--cluster", "local", "--nodes", "4", "--mesh", "dp=2,tp=2"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "m.py").write_text(MODEL)
    return d, f"{d / 'm.py'}:build"


@pytest.fixture(scope="module")
def plans(target):
    d, t = target
    for kind in ("dp", "megatron"):
        main(["plan", t, *COMMON, "--plan", kind, "--json", str(d / f"{kind}.json")])
    return d


def test_plan_prints_phases_and_explain(target, capsys):
    d, t = target
    main(["plan", t, *COMMON, "--plan", "megatron"])
    out, err = capsys.readouterr()
    assert out.startswith("plan megatron on Mesh(dp=2, tp=2)") and "unsharded ops" in out
    for phase in ("[fxpar] build model (your code) ...", "[fxpar] capture ...", "[fxpar] plan megatron ...",
                  "[fxpar]   Mesh(dp=2, tp=2 on devices 0..3): build ", "[fxpar] plan megatron: "):
        assert phase in err, err
    assert "predicted step" in err and "solve" in err


def test_plan_json_loads_and_explains_the_same(plans, capsys):
    p = Plan.from_json((plans / "megatron.json").read_text())
    assert p.kind == "megatron" and p.mesh["shape"] == (2, 2)
    main(["explain", str(plans / "megatron.json")])
    assert capsys.readouterr().out.strip() == p.explain()


def test_compare_shows_the_known_difference(plans, capsys):
    """dp replicates fc1's weight, megatron splits it by rows (column-parallel) over tp."""
    main(["compare", str(plans / "dp.json"), str(plans / "megatron.json")])
    out = capsys.readouterr().out
    dp = Plan.from_json((plans / "dp.json").read_text())
    meg = Plan.from_json((plans / "megatron.json").read_text())
    assert f"{dp.time * 1e3:.4g}" in out and f"{meg.time * 1e3:.4g}" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("p_0_weight"))
    assert line.rstrip().endswith("-> RS(0)") and "-> RR" in line
    n = sum(a.strategy != b.strategy for a, b in zip(dp.nodes, meg.nodes))
    assert f"nodes whose strategy differs: {n} of {len(dp.nodes)}" in out


def test_dump_writes_one_program_per_rank(target, tmp_path, capsys):
    _, t = target
    main(["dump", t, *COMMON, "--plan", "megatron", "--out", str(tmp_path / "ranks")])
    files = sorted(p.name for p in (tmp_path / "ranks").iterdir())
    assert files == ["rank0.py", "rank1.py", "rank2.py", "rank3.py"]
    text = (tmp_path / "ranks" / "rank3.py").read_text()
    assert "class Rank1_1" in text and "torch.ops.fxpar.start.default" in text  # row all-reduce


def test_bad_target_is_a_clear_exit(tmp_path):
    with pytest.raises(SystemExit, match="FILE.py:FUNC"):
        main(["plan", "nocolon", *COMMON])
    (tmp_path / "x.py").write_text("def build():\n    return 1\n")
    with pytest.raises(SystemExit, match="must return"):
        main(["plan", f"{tmp_path / 'x.py'}:build", *COMMON])


def test_bad_input_is_one_line_not_a_traceback(target):
    """An fxpar error (here an unknown schedule) exits with its type and message."""
    _, t = target
    with pytest.raises(SystemExit, match="fxpar plan: ScheduleError: .*unknown schedule 'bogus'"):
        main(["plan", t, "--cluster", "local", "--nodes", "2", "--mesh", "pp=2",
              "--schedule", "bogus"])


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    d = tmp_path_factory.mktemp("deep")
    (d / "deep.py").write_text(MODEL.replace(
        "nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)",
        "*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4))"))
    return d, f"{d / 'deep.py'}:build"


def test_v_schedule_needs_no_chunks_flag(deep, capsys):
    """``--schedule zbv`` without ``--chunks`` plans two chunks per rank in a V."""
    d, t = deep
    pp = ["--cluster", "local", "--nodes", "2", "--mesh", "pp=2", "--microbatches", "2"]
    main(["plan", t, *pp, "--schedule", "zbv", "--json", str(d / "zbv.json")])
    out = capsys.readouterr().out
    assert "pipeline of 4 stage chunks, schedule zbv (chunks 2)" in out
    # the V: chunk k's section names its rank; one configuration, the pipeline's (not each
    # chunk's own pp=1 m=1)
    assert [x for x in out.splitlines() if x.startswith("-- stage ")] == \
        [f"-- stage {k} (pipeline rank {r}) --" for k, r in enumerate((0, 1, 1, 0))]
    assert [x for x in out.splitlines() if x.startswith("configuration: ")] == \
        ["configuration: pp=2 dp=1 tp=1 m=2 zbv v=2 zero(g=1,os=1)"]


def test_compare_pipelines_by_schedule_and_chunk(deep, capsys):
    """Two pipelines of one model: their schedules, bubbles and stage chunks side by side, and
    each node once (a boundary value as its producer), as many as a plan without stages has."""
    d, t = deep
    pp = ["--cluster", "local", "--nodes", "2", "--microbatches", "2"]
    main(["plan", t, *pp, "--mesh", "pp=2", "--schedule", "zbv", "--json", str(d / "zbv.json")])
    main(["plan", t, *pp, "--mesh", "pp=2", "--schedule", "1f1b", "--json", str(d / "1f1b.json")])
    main(["plan", t, *pp, "--mesh", "dp=2", "--plan", "dp", "--json", str(d / "dp.json")])
    capsys.readouterr()
    main(["compare", str(d / "zbv.json"), str(d / "1f1b.json")])
    out = capsys.readouterr().out
    zbv, one = (Plan.from_json((d / f"{s}.json").read_text()) for s in ("zbv", "1f1b"))
    dp = Plan.from_json((d / "dp.json").read_text())
    row = next(x for x in out.splitlines() if x.strip().startswith("schedule"))
    assert row.split()[1:] == ["zbv", "v=2", "(v)", "m=2", "1f1b", "m=2"]
    bub = next(x for x in out.splitlines() if x.strip().startswith("bubble")).split()
    assert bub[1:] == [f"{100 * p.schedule['bubble']:.1f}%" for p in (zbv, one)]
    chunks = [x.split() for x in out.splitlines() if x.startswith("  ") and " A r" in x]
    # the V: chunks 0..3 on ranks 0, 1, 1, 0; 1F1B has two chunks, then "-"
    assert [c[2] for c in chunks] == ["r0", "r1", "r1", "r0"]
    assert [c[c.index("B") + 1] for c in chunks] == ["r0", "r1", "-", "-"]
    assert f"nodes whose strategy differs: 0 of {len(dp.nodes)}" in out


@pytest.mark.slow
def test_pipeline_plan_and_dump(target, tmp_path, capsys):
    """A pp axis in --mesh plans a pipeline (explain says so) and dumps one program per stage
    chunk on each of its ranks."""
    _, t = target
    pp = ["--cluster", "local", "--nodes", "4", "--mesh", "pp=2,tp=2", "--microbatches", "2"]
    main(["plan", t, *pp])
    out = capsys.readouterr().out
    assert out.startswith("plan auto on Mesh(pp=2, tp=2)") and "2 microbatches" in out
    main(["dump", t, *pp, "--out", str(tmp_path / "ranks")])
    files = sorted(p.name for p in (tmp_path / "ranks").iterdir())
    assert files == ["rank0_chunk0.py", "rank1_chunk0.py", "rank2_chunk1.py", "rank3_chunk1.py"]


LOSS_MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))).pow(2).mean()

    def build():
        torch.manual_seed(0)
        return Net(), (torch.randn(8, 8),)
""")


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_verify_command(tmp_path, capsys):
    """``fxpar verify`` spawns the mesh's local ranks and prints the report (a divergence's
    report: tests/test_verify.py)."""
    (tmp_path / "m.py").write_text(LOSS_MODEL)
    main(["verify", f"{tmp_path / 'm.py'}:build", "--mesh", "tp=2", "--plan", "megatron"])
    out = capsys.readouterr().out
    assert out.startswith("OK verify:") and "all equal" in out
