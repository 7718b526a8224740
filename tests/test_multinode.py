"""Multi-node launches plan for the nodes they run on (issue #29): two torchrun launchers on
localhost, 2 "nodes" x 2 processes; planning-only checks with a preset's slower inter-node link."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxpar

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_of_two_on_localhost(tmp_path):
    """``Cluster.from_env(calibrate=True)`` under ``torchrun --nnodes 2``: 2 nodes of 2, both
    levels measured apart (inter-node on one rank per node), training equal to one process."""
    out = tmp_path / "out.json"
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(ROOT / "tests" / "data" / "multinode_worker.py"), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = [p.communicate(timeout=540)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    got = json.loads(out.read_text())
    assert (got["nodes"], got["per_node"]) == (2, 2)
    assert ["inter", 2] in got["levels"] and ["intra", 2] in got["levels"], got["levels"]
    assert all(v > 0 for v in got["intra"] + got["inter"])
    assert got["tp_group"] == [0, 1] and got["dp_group"] == [0, 2]   # tp inside a node
    # one process, the same model, batch and optimizer
    from examples.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    want = []
    for _ in range(2):
        loss = model(x, x.roll(1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), rtol=1e-4, atol=1e-5)


def test_from_env_keeps_tensor_parallel_inside_a_node(monkeypatch):
    """Planning only: 2 nodes of 4 with a slow network between them (a preset's inter-node
    link, 100x slower): the search keeps every tensor-parallel group inside one node."""
    for k, v in dict(WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", GROUP_WORLD_SIZE="2", RANK="0",
                     LOCAL_RANK="0", GROUP_RANK="0").items():
        monkeypatch.setenv(k, v)
    slow = fxpar.Cluster.preset("perlmutter").inter_node_bandwidth / 100
    cluster = fxpar.Cluster.from_env("perlmutter", inter_node_bandwidth=slow)
    assert (cluster.nodes, cluster.devices_per_node) == (2, 4)
    from examples.models import GPT

    with torch.device("meta"):
        model = GPT(vocab=512, d_model=256, n_heads=8, n_layers=2, seq_len=64)
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    # no pipeline, a batch of 2 (dp <= 2): tp 4 inside each node, or tp 8 across both
    plan = fxpar.plan(model, cluster, (ids, ids), plan=dict(pp=1)).plan
    names, shape = plan.mesh["axis_names"], plan.mesh["shape"]
    mesh = fxpar.Mesh(cluster, dict(zip(names, shape)))
    for axis in (a for a, n in zip(names, shape) if a in ("tp", "x", "y") and n > 1):
        for d in range(cluster.num_devices):
            assert len({cluster.node_of(r) for r in mesh.group_of(d, axis)}) == 1, (axis, plan.mesh)
    assert dict(zip(names, shape)).get("tp") == 4, plan.mesh   # not 8, across the nodes


def test_from_env_refuses_an_inconsistent_launch(monkeypatch):
    for k, v in dict(WORLD_SIZE="6", LOCAL_WORLD_SIZE="4").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(fxpar.ClusterError, match="ranks per node differ"):
        fxpar.Cluster.from_env()
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(fxpar.ClusterError, match="preset 'dgx-a100' has 8 devices per node but the launch runs 4"):
        fxpar.Cluster.from_env("dgx-a100")
    c = fxpar.Cluster.from_env()
    assert (c.nodes, c.devices_per_node, c.num_devices) == (2, 4, 8)
