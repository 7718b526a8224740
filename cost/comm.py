"""Communication cost: ring collectives with placement-aware bandwidth (pure functions).

Ring algorithms (AxoNN §V-A eq. 1–3, which drop latency) plus a latency α per ring step (the
α–β model of AMSP §IV-A), for a group of ``G`` devices:

====================  =====================================  ==========================
collective            time                                   ``m`` is
====================  =====================================  ==========================
all_gather            ``(G−1)·(α + m/β)``                    the per-device input shard
reduce_scatter        ``(G−1)·(α + m/(G·β))``                the full per-device buffer
all_reduce            ``2(G−1)·(α + m/(G·β))``               the full per-device buffer
all_to_all            ``(G−1)·(α + m/(G·β))``                the full per-device buffer
broadcast             ``(G−1)·α + m/β`` (pipelined ring)     the buffer
send_recv             ``α + m/β``                            the buffer
====================  =====================================  ==========================

With α = 0 these are exactly AxoNN eq. 1 (AG), eq. 2 (RS) and eq. 3 (AR).

**Placement-aware β** (AxoNN §V-B eq. 10, generalized). A group inside one node gets the
intra-node bandwidth. A group spanning nodes runs a ring that enters and leaves each of its
nodes once (AxoNN assumption 2); every ring of the groups that run at the same moment (all
groups of one mesh axis do) and cross a node's boundary shares that node's NICs, so a ring gets
``β = min(β_intra, β_inter / rings crossing the busiest node it passes through)``. With leaf
switches (``Cluster.nodes_per_switch``, AMSP §V-D) a third level divides the leaf's uplink
``inter_switch_bandwidth`` among the rings that leave it. For AxoNN's nested groups (x
innermost, then y, z, data) this is exactly eq. 10, ``β_i = β_inter / min(G_node, Π_{j<i} G_j)``,
and it also covers any axis order and meshes whose inner axes do not divide the node.

All-to-all is not a ring on the wire: every member sends ``m/G`` to every other member, so on
a node boundary the traffic of all members of all concurrent groups adds up; its effective β
is set by the busiest node's egress (see :func:`group_bandwidth`).

**Placement-agnostic** (AxoNN §V-C, for comparison): one bandwidth and one latency for every
group, whatever its placement (the inter-node figures on a multi-node cluster).

**Calibration**: a cluster from :meth:`fxpar.Cluster.calibrate` carries fitted α/β per
collective, level and group size; those replace the nominal link figures, and the sharing of
inter-node links among concurrent rings still applies on top as a ratio.

>>> from fxpar import Cluster
>>> from fxpar.cost.comm import group_bandwidth
>>> c = Cluster.preset("perlmutter", nodes=2)            # 4 devices per node
>>> group_bandwidth((0, 1), c) == c.intra_node_bandwidth
True
>>> groups = [(i, i + 4) for i in range(4)]               # 4 rings cross each node at once
>>> group_bandwidth((0, 4), c, concurrent=groups) == c.inter_node_bandwidth / 4
True
>>> group_bandwidth((0, 4), c, concurrent=groups, placement_aware=False) == c.inter_node_bandwidth
True
"""

from __future__ import annotations

import math

import functools
from collections import Counter
from collections.abc import Sequence

__all__ = [
    "COLLECTIVES",
    "ring_steps_and_factor",
    "group_level",
    "group_bandwidth",
    "group_latency",
    "collective_time",
    "axis_collective_time",
    "axis_bandwidth",
]

#: Collectives this module prices (same names as :data:`fxpar.cluster.COLLECTIVES`).
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send_recv")


def ring_steps_and_factor(collective: str, group_size: int) -> tuple[int, float]:
    """``(steps, factor)`` with ``t = steps·α + factor·m/β`` for the ring algorithm.

    AxoNN eq. 1–3: all-gather ``factor = G−1``, reduce-scatter ``(G−1)/G``, all-reduce
    ``2(G−1)/G``; a group of one device costs nothing.

    >>> ring_steps_and_factor("all_reduce", 4)
    (6, 1.5)
    >>> ring_steps_and_factor("all_gather", 1)
    (0, 0.0)
    """
    g = group_size
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; known: {COLLECTIVES}")
    if g <= 1:
        return 0, 0.0
    if collective == "all_gather":
        return g - 1, float(g - 1)
    if collective in ("reduce_scatter", "all_to_all"):
        return g - 1, (g - 1) / g
    if collective == "all_reduce":
        return 2 * (g - 1), 2 * (g - 1) / g
    if collective == "broadcast":
        return g - 1, 1.0
    return 1, 1.0  # send_recv


def group_level(group: Sequence[int], cluster) -> str:
    """``"intra"`` if every device of the group is on one node, else ``"inter"``.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("perlmutter", nodes=2)
    >>> group_level((0, 3), c), group_level((3, 4), c)
    ('intra', 'inter')
    """
    return "intra" if len({cluster.node_of(d) for d in group}) <= 1 else "inter"


def _ring_loads(concurrent: Sequence[Sequence[int]], key) -> Counter:
    """Rings crossing each domain's boundary: for every domain (node or leaf switch), the
    number of concurrent groups that have a member in it and span more than one domain."""
    load: Counter = Counter()
    for g in concurrent:
        domains = {key(d) for d in g}
        if len(domains) > 1:
            load.update(domains)
    return load


def _a2a_egress(concurrent: Sequence[Sequence[int]], key) -> Counter:
    """All-to-all bytes (in units of ``m``) leaving each domain: a member sends ``m/G`` to
    every other member, so a domain holding ``k`` of ``G`` members sends ``k·(G−k)/G·m``."""
    out: Counter = Counter()
    for g in concurrent:
        per = Counter(key(d) for d in g)
        if len(per) > 1:
            for dom, k in per.items():
                out[dom] += k * (len(g) - k) / len(g)
    return out


def _agnostic_link(cluster) -> tuple[float, float]:
    """The one (α, β) of the placement-agnostic model: inter-node figures on a multi-node
    cluster (AxoNN §V-C sets every bandwidth to one constant), intra-node on one node."""
    if cluster.nodes > 1:
        return cluster.inter_node_latency, min(cluster.intra_node_bandwidth, cluster.inter_node_bandwidth)
    return cluster.intra_node_latency, cluster.intra_node_bandwidth


def group_bandwidth(group: Sequence[int], cluster, *, concurrent: Sequence[Sequence[int]] | None = None,
                    placement_aware: bool = True, collective: str | None = None) -> float:
    """Effective per-link bandwidth β (bytes/s) of a ring over ``group`` (AxoNN eq. 10, generalized).

    * inside one node: ``β_intra``;
    * spanning nodes: ``min(β_intra, β_inter / L)`` with ``L`` the most concurrent rings that
      cross the boundary of one node the group touches (AxoNN §V-B2, Figure 6);
    * spanning leaf switches: also at most ``β_switch / L_switch`` (AMSP §V-D);
    * ``collective="all_to_all"`` on a multi-node group: the busiest node's egress
      ``Σ_groups k(G−k)/G · m`` over ``β_inter``, expressed as the β that makes
      ``(G−1)/G · m / β`` equal to it.

    ``concurrent`` lists every group running the same collective at the same moment (include
    ``group`` itself; default: only ``group``). ``placement_aware=False`` gives the
    placement-agnostic model: one bandwidth for every group.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100", nodes=2)           # 8 per node, 200 GB/s off-node
    >>> group_bandwidth(range(16), c) / 1e9                 # one ring over both nodes
    200.0
    >>> [group_bandwidth((i, i + 8), c, concurrent=[(j, j + 8) for j in range(8)]) / 1e9 for i in (0,)]
    [25.0]
    """
    group = tuple(group)
    if not placement_aware:
        return _agnostic_link(cluster)[1]
    if group_level(group, cluster) == "intra":
        return cluster.intra_node_bandwidth
    conc = [tuple(g) for g in concurrent] if concurrent is not None else [group]
    return _shared_beta(group, cluster, _level_loads(conc, cluster, collective), collective)


def _level_loads(concurrent: Sequence[tuple[int, ...]], cluster, collective: str | None):
    """``[(domain key, link bandwidth, load per domain)]`` for the node level and, with leaf
    switches, the switch level: ring crossings, or all-to-all egress in units of ``m``."""
    levels = [(cluster.node_of, cluster.inter_node_bandwidth)]
    if cluster.nodes_per_switch is not None and cluster.inter_switch_bandwidth is not None:
        levels.append((cluster.switch_of, cluster.inter_switch_bandwidth))
    count = _a2a_egress if collective == "all_to_all" else _ring_loads
    return [(key, bw, count(concurrent, key)) for key, bw in levels]


def _shared_beta(group: tuple[int, ...], cluster, loads, collective: str | None) -> float:
    """β of one multi-node group given the loads of every level (see :func:`group_bandwidth`)."""
    beta = cluster.intra_node_bandwidth
    g = len(group)
    for key, bw, load in loads:
        doms = {key(d) for d in group}
        if len(doms) <= 1:
            continue
        worst = max(load[d] for d in doms)
        if collective == "all_to_all":
            beta = min(beta, bw * ((g - 1) / g) / worst)
        else:
            beta = min(beta, bw / max(1, worst))
    return beta


def group_latency(group: Sequence[int], cluster, *, placement_aware: bool = True) -> float:
    """Per-step latency α: the slower link the ring uses (inter-node if it leaves a node).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100", nodes=2)
    >>> group_latency((0, 1), c), group_latency((0, 8), c)
    (3e-06, 8e-06)
    """
    if not placement_aware:
        return _agnostic_link(cluster)[0]
    return cluster.intra_node_latency if group_level(group, cluster) == "intra" else cluster.inter_node_latency


def _link(collective: str, group: tuple[int, ...], cluster, concurrent, placement_aware: bool):
    """``(α, β)`` for this collective on ``group``, calibrated where the cluster has a profile."""
    alpha = group_latency(group, cluster, placement_aware=placement_aware)
    beta = group_bandwidth(group, cluster, concurrent=concurrent, placement_aware=placement_aware,
                           collective=collective)
    return _calibrated(collective, group, cluster, alpha, beta, placement_aware)


def _calibrated(collective: str, group: tuple[int, ...], cluster, alpha: float, beta: float,
                placement_aware: bool) -> tuple[float, float]:
    """Replace the nominal ``(α, β)`` by the cluster's measured profile where it has one."""
    if cluster.profile.entries:
        if placement_aware:
            level = group_level(group, cluster)
        else:
            level = "inter" if cluster.nodes > 1 else "intra"
        entry = cluster.profile.lookup(collective, level, len(group))
        if entry is not None:
            # The profile measured one group alone; keep the modelled slowdown from sharing.
            alone = group_bandwidth(group, cluster, placement_aware=placement_aware, collective=collective)
            # (a flat calibration fit gives β = inf: no measurable bandwidth term, no sharing)
            share = beta / alone if math.isfinite(alone) and alone > 0 else 1.0
            alpha, beta = entry.latency, entry.bandwidth * share
    return alpha, beta


def collective_time(collective: str, nbytes: float, group: Sequence[int], cluster, *,
                    concurrent: Sequence[Sequence[int]] | None = None,
                    placement_aware: bool = True) -> float:
    """Seconds for one ring ``collective`` of ``nbytes`` over ``group``:
    ``steps·α + factor·nbytes/β`` (table above for what ``nbytes`` is; β from
    :func:`group_bandwidth`, α from :func:`group_latency` or the calibrated profile).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100")
    >>> t = collective_time("all_reduce", 1e9, range(8), c)
    >>> round(t, 4)   # 2·7/8 · 1 GB / 300 GB/s + 14 · 3 µs
    0.0059
    >>> collective_time("all_gather", 1e6, (5,), c)
    0.0
    """
    group = tuple(group)
    steps, factor = ring_steps_and_factor(collective, len(group))
    if steps == 0:
        return 0.0
    alpha, beta = _link(collective, group, cluster, concurrent, placement_aware)
    return steps * alpha + factor * nbytes / beta


@functools.lru_cache(maxsize=4096)
def _axis_links(collective: str, mesh, axis: int, placement_aware: bool):
    """Distinct ``(α, β)`` over the groups of one mesh axis (all run concurrently)."""
    groups = mesh.groups(axis)
    cluster = mesh.cluster
    if not placement_aware or all(group_level(g, cluster) == "intra" for g in groups):
        links = {_link(collective, g, cluster, groups, placement_aware) for g in groups}
    else:
        # Loads are counted once for the whole axis, not once per group (linear, not quadratic).
        loads = _level_loads(groups, cluster, collective)
        links = set()
        for g in groups:
            beta = (cluster.intra_node_bandwidth if group_level(g, cluster) == "intra"
                    else _shared_beta(g, cluster, loads, collective))
            links.add(_calibrated(collective, g, cluster, group_latency(g, cluster), beta, True))
    return tuple(sorted(links))


def axis_collective_time(collective: str, nbytes: float, mesh, axis: int | str, *,
                         placement_aware: bool = True) -> float:
    """Time of ``collective`` along one mesh axis: every group of the axis runs at once, and
    the slowest group sets the time (the groups are each other's ``concurrent`` rings).

    >>> from fxpar import Cluster, Mesh
    >>> m = Mesh(Cluster.preset("perlmutter", nodes=2), dp=2, tp=4)
    >>> t_dp = axis_collective_time("all_reduce", 1e8, m, "dp")   # 4 rings share 100 GB/s
    >>> round(t_dp * 1e3, 3)   # 2·1/2 · 1e8 / 25e9 + 2 · 8 µs
    4.016
    """
    a = mesh.axis_index(axis)
    steps, factor = ring_steps_and_factor(collective, mesh.shape[a])
    if steps == 0:
        return 0.0
    return max(steps * alpha + factor * nbytes / beta
               for alpha, beta in _axis_links(collective, mesh, a, placement_aware))


def axis_bandwidth(mesh, axis: int | str, *, collective: str = "all_reduce",
                   placement_aware: bool = True) -> float:
    """The slowest effective β over the groups of one mesh axis (AxoNN's ``β_i``).

    >>> from fxpar import Cluster, Mesh
    >>> m = Mesh(Cluster.preset("perlmutter", nodes=4), data=2, z=2, y=2, x=2)
    >>> [axis_bandwidth(m, a) / 1e9 for a in ("x", "y", "z", "data")]
    [300.0, 300.0, 25.0, 25.0]
    """
    a = mesh.axis_index(axis)
    if mesh.shape[a] <= 1:
        return float("inf")
    return min(beta for _, beta in _axis_links(collective, mesh, a, placement_aware))
