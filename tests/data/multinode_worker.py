"""One rank of a 2-"node" launch on localhost (tests/test_multinode.py): the cluster from the
launch environment, calibrated, and 2 training steps planned on it."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fxpar  # noqa: E402
from examples.models import GPT  # noqa: E402

dist.init_process_group("gloo")
cluster = fxpar.Cluster.from_env(calibrate=True)
torch.manual_seed(0)
model = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
prog = fxpar.compile(model, cluster, (x, x.roll(1, 1)), plan="auto", mesh={"dp": 2, "tp": 2},
                     optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), time_limit=20)
runner = prog.runner()
losses = [runner.step(x, x.roll(1, 1)).item() for _ in range(2)]
mesh = fxpar.Mesh(cluster, dp=2, tp=2)
if dist.get_rank() == 0:
    Path(sys.argv[1]).write_text(json.dumps(dict(
        nodes=cluster.nodes, per_node=cluster.devices_per_node, losses=losses,
        levels=sorted({(e.level, e.group_size) for e in cluster.profile.entries if e.collective == "all_reduce"}),
        intra=[cluster.intra_node_bandwidth, cluster.intra_node_latency],
        inter=[cluster.inter_node_bandwidth, cluster.inter_node_latency],
        tp_group=list(mesh.group_of(0, "tp")), dp_group=list(mesh.group_of(0, "dp")))))
dist.barrier()
dist.destroy_process_group()
