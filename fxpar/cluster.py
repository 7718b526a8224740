"""The physical cluster model: nodes, devices, links, memory and compute.

Units are SI throughout: bytes, seconds, bytes/s, FLOP/s. Bandwidths are **unidirectional**:

* ``intra_node_bandwidth``: what one device can push to its peers inside a node (NVLink /
  NVSwitch / Infinity Fabric), per device;
* ``inter_node_bandwidth``: what one node can push off-node through all its NICs together
  (AxoNN's β_inter: the node's links, shared by every ring that crosses the node boundary);
* ``inter_switch_bandwidth``: what one leaf switch can push to the spine (AMSP §V-D), shared by
  the rings that leave the leaf; ``None`` means a non-blocking fabric.

Device ``d`` lives on node ``d // devices_per_node``; node ``n`` under leaf switch
``n // nodes_per_switch``.

A cluster may carry a measured communication :class:`Profile` (from :meth:`Cluster.calibrate`):
latency α and bandwidth β fitted per collective, per level (``intra`` / ``inter``) and per
group size. The cost functions in :mod:`fxpar.cost.comm` prefer those numbers over the
nominal link figures.

>>> from fxpar.cluster import Cluster
>>> c = Cluster.preset("dgx-a100", nodes=2)
>>> c.num_devices, c.node_of(9), c.device_memory // 2**30
(16, 1, 80)
>>> Cluster.from_json(c.to_json()) == c
True
"""

from __future__ import annotations

import dataclasses
import json
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from fxpar.errors import ClusterError

__all__ = ["Cluster", "Profile", "ProfileEntry", "COLLECTIVES"]

GB = 1e9
GiB = 2**30

#: Collectives the cost model and the profiler know, by the names used everywhere in fxpar.
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send_recv")


@dataclass(frozen=True)
class ProfileEntry:
    """Fitted ``t(m) = α·steps(G) + factor(G)·m / β`` for one collective, level and group size.

    ``level`` is ``"intra"`` (group inside one node) or ``"inter"`` (group spanning nodes);
    ``bandwidth`` is the bus bandwidth β in bytes/s, ``latency`` the per-step α in seconds.
    ``rel_error`` is the median relative error of the fit over the measured sizes.
    """

    collective: str
    level: str
    group_size: int
    latency: float
    bandwidth: float
    rel_error: float = 0.0


@dataclass(frozen=True)
class Profile:
    """Measured α/β table of a cluster (AMSP's communication profiler, §V-C)."""

    entries: tuple[ProfileEntry, ...] = ()

    def lookup(self, collective: str, level: str, group_size: int) -> ProfileEntry | None:
        """The entry for this collective and level whose group size is nearest (log scale)."""
        import math

        cands = [e for e in self.entries if e.collective == collective and e.level == level]
        if not cands:
            return None
        return min(cands, key=lambda e: (abs(math.log2(e.group_size) - math.log2(max(group_size, 1))),
                                         -e.group_size))


# Nominal figures for the presets of DESIGN §4 (unidirectional; see module docstring).
# Latencies are typical small-message figures: ~3 µs per NVLink step, ~8 µs per network step.
_PRESETS: dict[str, dict] = {
    "perlmutter": dict(
        devices_per_node=4, device_type="A100-40GB", device_memory=40 * GiB,
        peak_flops=312e12, memory_bandwidth=1555 * GB,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=4 * 25 * GB,
        intra_node_latency=3e-6, inter_node_latency=8e-6),
    "frontier": dict(
        devices_per_node=8, device_type="MI250X-GCD", device_memory=64 * GiB,
        peak_flops=192e12, memory_bandwidth=1600 * GB,
        intra_node_bandwidth=100 * GB, inter_node_bandwidth=4 * 25 * GB,
        intra_node_latency=4e-6, inter_node_latency=8e-6),
    "dgx-a100": dict(
        devices_per_node=8, device_type="A100-80GB", device_memory=80 * GiB,
        peak_flops=312e12, memory_bandwidth=2039 * GB,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=8 * 25 * GB,
        intra_node_latency=3e-6, inter_node_latency=8e-6),
    "a800": dict(
        devices_per_node=8, device_type="A800-80GB", device_memory=80 * GiB,
        peak_flops=312e12, memory_bandwidth=2039 * GB,
        intra_node_bandwidth=200 * GB, inter_node_bandwidth=4 * 25 * GB,
        intra_node_latency=3e-6, inter_node_latency=8e-6),
    "aws-p3.8xlarge": dict(
        devices_per_node=4, device_type="V100-16GB", device_memory=16 * GiB,
        peak_flops=125e12, memory_bandwidth=900 * GB,
        intra_node_bandwidth=150 * GB, inter_node_bandwidth=10e9 / 8,
        intra_node_latency=5e-6, inter_node_latency=30e-6),
    "dgx-h100": dict(
        devices_per_node=8, device_type="H100-80GB", device_memory=80 * GiB,
        peak_flops=989e12, memory_bandwidth=3350 * GB,
        intra_node_bandwidth=450 * GB, inter_node_bandwidth=8 * 50 * GB,
        intra_node_latency=2.5e-6, inter_node_latency=6e-6),
}


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster: ``nodes`` × ``devices_per_node`` identical devices."""

    nodes: int
    devices_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float
    inter_node_latency: float
    device_memory: int
    peak_flops: float
    memory_bandwidth: float
    nodes_per_switch: int | None = None
    inter_switch_bandwidth: float | None = None
    device_type: str = "generic"
    name: str = "custom"
    profile: Profile = field(default_factory=Profile)

    def __post_init__(self) -> None:
        for f in ("nodes", "devices_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ClusterError(f"Cluster.{f} must be a positive int, got {v!r}")
        for f in ("intra_node_bandwidth", "inter_node_bandwidth", "peak_flops",
                  "memory_bandwidth", "device_memory"):
            if not getattr(self, f) > 0:
                raise ClusterError(f"Cluster.{f} must be positive, got {getattr(self, f)!r}")
        for f in ("intra_node_latency", "inter_node_latency"):
            if getattr(self, f) < 0:
                raise ClusterError(f"Cluster.{f} must be >= 0, got {getattr(self, f)!r}")
        if self.nodes_per_switch is not None and self.nodes_per_switch < 1:
            raise ClusterError(f"Cluster.nodes_per_switch must be >= 1, got {self.nodes_per_switch}")

    # -- construction -------------------------------------------------------------------
    @classmethod
    def preset_names(cls) -> tuple[str, ...]:
        return tuple(_PRESETS)

    @classmethod
    def preset(cls, name: str, nodes: int = 1, **overrides) -> Cluster:
        """A cluster of ``nodes`` nodes of a known machine (DESIGN §4); fields can be overridden.

        >>> Cluster.preset("perlmutter", nodes=2).num_devices
        8
        """
        if name not in _PRESETS:
            raise ClusterError(f"unknown cluster preset {name!r}; known: {', '.join(_PRESETS)}")
        return cls(nodes=nodes, name=name, **{**_PRESETS[name], **overrides})

    @classmethod
    def local(cls, world_size: int, **overrides) -> Cluster:
        """This machine's ``world_size`` CPU processes as one node (gloo over shared memory).

        The link and compute figures are conservative guesses for a CPU process; run
        :meth:`calibrate` on a live group for measured ones.
        """
        import os

        fields = dict(
            nodes=1, devices_per_node=world_size, device_type="cpu-process", name="local",
            intra_node_bandwidth=2 * GB, inter_node_bandwidth=2 * GB,
            intra_node_latency=50e-6, inter_node_latency=50e-6,
            device_memory=max(1, _total_memory() // max(world_size, 1)),
            peak_flops=20e9 * max(1, (os.cpu_count() or 1) // max(world_size, 1)),
            memory_bandwidth=10 * GB)
        fields.update(overrides)
        return cls(**fields)

    # -- topology -----------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        self._check_device(device)
        return device // self.devices_per_node

    def switch_of(self, device: int) -> int:
        """Leaf switch of a device's node (0 for every device when there are no leaf switches)."""
        if self.nodes_per_switch is None:
            return 0
        return self.node_of(device) // self.nodes_per_switch

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self.num_devices:
            raise ClusterError(f"device {device} not in cluster {self.name} "
                               f"(devices 0..{self.num_devices - 1})")

    def describe(self) -> str:
        sw = f", {self.nodes_per_switch} nodes/leaf switch" if self.nodes_per_switch else ""
        return (f"{self.name}: {self.nodes} node(s) × {self.devices_per_node} {self.device_type}"
                f" ({self.device_memory / GiB:.0f} GiB, {self.peak_flops / 1e12:.0f} TFLOP/s each); "
                f"intra {self.intra_node_bandwidth / GB:.0f} GB/s, "
                f"inter {self.inter_node_bandwidth / GB:.1f} GB/s per node{sw}"
                + (f"; calibrated ({len(self.profile.entries)} fits)" if self.profile.entries else ""))

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["profile"] = [dataclasses.asdict(e) for e in self.profile.entries]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Cluster:
        d = dict(d)
        d["profile"] = Profile(tuple(ProfileEntry(**e) for e in d.get("profile", ())))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ClusterError(f"unknown Cluster fields in JSON: {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Cluster:
        return cls.from_dict(json.loads(text))

    # -- calibration --------------------------------------------------------------------
    @classmethod
    def calibrate(cls, group=None, *, sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**22),
                  collectives: Sequence[str] = COLLECTIVES, iters: int = 5,
                  group_sizes: Sequence[int] | None = None, base: Cluster | None = None) -> Cluster:
        """Measure collectives on a live process group and return a cluster built from them.

        Collective over all ranks of ``group`` (default: the world). Every rank must call it.
        For each collective, group size (powers of two up to the world, groups of consecutive
        ranks, as :func:`torch.distributed.new_subgroups` makes them) and message size it
        times ``iters`` runs after a warm-up, takes the slowest rank per run and the median
        over runs, and fits α and β with :func:`fxpar.cost.calibration.fit_alpha_beta`.
        Ranks are grouped into nodes by host name. The returned cluster carries the fits in
        ``profile`` and its nominal intra/inter-node latency and bandwidth are the all-reduce
        fits of the largest group at that level.

        Sizes are bytes of the per-device buffer in the convention of
        :func:`fxpar.cost.comm.collective_time` (for all-gather: the input shard).
        """
        import torch.distributed as dist

        from fxpar.cost.calibration import fit_alpha_beta

        if not dist.is_initialized():
            raise ClusterError("Cluster.calibrate needs an initialized torch.distributed process group")
        group = group or dist.group.WORLD
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        device = _group_device(group)

        hosts: list[str | None] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        node_names = list(dict.fromkeys(hosts))
        per_node = [hosts.count(h) for h in node_names]
        if len(set(per_node)) != 1:
            raise ClusterError(f"Cluster.calibrate: uneven ranks per host {dict(zip(node_names, per_node))}")
        dpn = per_node[0]

        if group_sizes is None:
            group_sizes = [g for g in (2**i for i in range(1, 16)) if g <= world]
            if world not in group_sizes and world > 1:
                group_sizes.append(world)
        measured: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
        global_ranks = dist.get_process_group_ranks(group)
        for gsize in group_sizes:
            if world % gsize:
                continue
            # Every rank creates every subgroup (new_group is collective), then uses its own.
            subgroups = [dist.new_group(global_ranks[i:i + gsize]) for i in range(0, world, gsize)]
            sub = subgroups[rank // gsize]
            level = "intra" if len({hosts[i] for i in range(rank // gsize * gsize,
                                                             rank // gsize * gsize + gsize)}) == 1 else "inter"
            for coll in collectives:
                for nbytes in sizes:
                    t = _time_collective(coll, nbytes, sub, gsize, device, iters, group)
                    if t is not None:
                        measured.setdefault((coll, level, gsize), []).append((nbytes, t))
            for sg in subgroups:
                dist.destroy_process_group(sg)

        entries = []
        for (coll, level, gsize), pts in sorted(measured.items()):
            alpha, beta, err = fit_alpha_beta(coll, gsize, [p[0] for p in pts], [p[1] for p in pts])
            entries.append(ProfileEntry(coll, level, gsize, alpha, beta, err))
        profile = Profile(tuple(entries))

        def best(level: str) -> ProfileEntry | None:
            es = [e for e in entries if e.collective == "all_reduce" and e.level == level]
            return max(es, key=lambda e: e.group_size) if es else None

        base = base or cls.local(world)
        intra, inter = best("intra"), best("inter")
        updates: dict = dict(nodes=len(node_names), devices_per_node=dpn, profile=profile,
                             name=f"calibrated-{base.name}")
        if intra:
            updates.update(intra_node_bandwidth=intra.bandwidth, intra_node_latency=intra.latency)
        if inter:
            updates.update(inter_node_bandwidth=inter.bandwidth, inter_node_latency=inter.latency)
        elif intra:  # a single node: nothing crosses nodes, keep inter equal to intra
            updates.update(inter_node_bandwidth=intra.bandwidth, inter_node_latency=intra.latency)
        return dataclasses.replace(base, **updates)


def _total_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GiB


def _group_device(group):
    import torch
    import torch.distributed as dist

    backend = dist.get_backend(group)
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _time_collective(coll: str, nbytes: int, sub, gsize: int, device, iters: int, world_group):
    """Median over runs of the slowest rank's time for one collective, or None if unsupported."""
    import torch
    import torch.distributed as dist

    n = max(gsize, nbytes // 4 // gsize * gsize)  # float32 elements, divisible by the group
    x = torch.ones(n, dtype=torch.float32, device=device)
    me = dist.get_rank(sub)
    if coll == "all_gather":
        out = torch.empty(n * gsize, dtype=x.dtype, device=device)
        fn = lambda: dist.all_gather_into_tensor(out, x, group=sub)  # noqa: E731
    elif coll == "reduce_scatter":
        out = torch.empty(n // gsize, dtype=x.dtype, device=device)
        fn = lambda: dist.reduce_scatter_tensor(out, x, group=sub)  # noqa: E731
    elif coll == "all_reduce":
        fn = lambda: dist.all_reduce(x, group=sub)  # noqa: E731
    elif coll == "broadcast":
        src = dist.get_global_rank(sub, 0)
        fn = lambda: dist.broadcast(x, src=src, group=sub)  # noqa: E731
    elif coll == "all_to_all":
        out = torch.empty_like(x)
        fn = lambda: dist.all_to_all_single(out, x, group=sub)  # noqa: E731
    elif coll == "send_recv":
        # Pairs (0,1), (2,3), ... exchange one buffer; time of one one-way transfer.
        peer = dist.get_global_rank(sub, me ^ 1) if me ^ 1 < gsize else None

        def fn():
            if peer is None:
                return
            if me % 2 == 0:
                dist.send(x, peer, group=sub)
            else:
                dist.recv(x, peer, group=sub)
    else:
        raise ClusterError(f"unknown collective {coll!r}; known: {COLLECTIVES}")

    try:
        fn()  # warm-up (also detects an unsupported collective on this backend)
    except (RuntimeError, NotImplementedError):
        ok = torch.zeros(1)
    else:
        ok = torch.ones(1)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=world_group)
    if ok.item() == 0:
        return None
    times = []
    for _ in range(iters):
        dist.barrier(group=world_group)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=world_group)
        times.append(dt.item())
    return statistics.median(times)
