"""Communication cost: ring collectives with placement-aware bandwidth (pure functions).

Ring algorithms (AxoNN eq. 1–3) plus a latency α per step, for a group of ``G`` devices:

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

Placement-aware β (AxoNN eq. 10, generalized): a group inside one node gets the intra-node
bandwidth. A group spanning nodes runs a ring that enters and leaves each of its nodes once;
every ring of the concurrent groups (all groups of one mesh axis run at once) that crosses a
node's boundary shares that node's NICs, so
``β = min(β_intra, β_inter / rings crossing the busiest node)``; with leaf switches a third
level divides the switch's uplink among the rings leaving it. For AxoNN's nested groups this is
exactly ``β_inter / min(G_node, Π_{j<i} G_j)``.

>>> from fxpar import Cluster
>>> from fxpar.cost.comm import group_bandwidth
>>> c = Cluster.preset("perlmutter", nodes=2)            # 4 devices per node
>>> group_bandwidth((0, 1), c) == c.intra_node_bandwidth
True
>>> groups = [(i, i + 4) for i in range(4)]               # 4 rings cross each node at once
>>> group_bandwidth((0, 4), c, concurrent=groups) == c.inter_node_bandwidth / 4
True
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

__all__ = [
    "ring_steps_and_factor",
    "group_level",
    "group_bandwidth",
    "group_latency",
    "collective_time",
    "axis_collective_time",
]


def ring_steps_and_factor(collective: str, group_size: int) -> tuple[int, float]:
    """``(steps, factor)`` with ``t = steps·α + factor·m/β`` for the ring algorithm.

    >>> ring_steps_and_factor("all_reduce", 4)
    (6, 1.5)
    """
    g = group_size
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
    if collective == "send_recv":
        return 1, 1.0
    raise ValueError(f"unknown collective {collective!r}")


def group_level(group: Sequence[int], cluster) -> str:
    """``"intra"`` if every device of the group is on one node, else ``"inter"``."""
    return "intra" if len({cluster.node_of(d) for d in group}) <= 1 else "inter"


def _crossing_load(concurrent: Sequence[Sequence[int]], key) -> int:
    """Most rings crossing one boundary: for each domain (node or switch) count the groups that
    have a member inside it and span more than one domain."""
    load: Counter = Counter()
    for g in concurrent:
        domains = {key(d) for d in g}
        if len(domains) > 1:
            load.update(domains)
    return max(load.values(), default=1)


def group_bandwidth(group: Sequence[int], cluster, *, concurrent: Sequence[Sequence[int]] | None = None,
                    placement_aware: bool = True) -> float:
    """Effective per-link bandwidth β (bytes/s) of a ring over ``group``.

    ``concurrent`` lists every group running the same collective at the same moment (include
    ``group`` itself; default: only ``group``). ``placement_aware=False`` gives the
    placement-agnostic model: the inter-node bandwidth for every group that leaves a node,
    unshared.
    """
    if group_level(group, cluster) == "intra":
        return cluster.intra_node_bandwidth
    if not placement_aware:
        return min(cluster.intra_node_bandwidth, cluster.inter_node_bandwidth)
    conc = list(concurrent) if concurrent is not None else [tuple(group)]
    beta = min(cluster.intra_node_bandwidth,
               cluster.inter_node_bandwidth / _crossing_load(conc, cluster.node_of))
    if cluster.nodes_per_switch is not None and cluster.inter_switch_bandwidth is not None:
        if len({cluster.switch_of(d) for d in group}) > 1:
            beta = min(beta, cluster.inter_switch_bandwidth / _crossing_load(conc, cluster.switch_of))
    return beta


def group_latency(group: Sequence[int], cluster) -> float:
    """Per-step latency α: the slower link the ring uses."""
    return cluster.intra_node_latency if group_level(group, cluster) == "intra" else cluster.inter_node_latency


def collective_time(collective: str, nbytes: float, group: Sequence[int], cluster, *,
                    concurrent: Sequence[Sequence[int]] | None = None,
                    placement_aware: bool = True) -> float:
    """Seconds for one ring ``collective`` of ``nbytes`` (see the table above for what ``m``
    is) over ``group``. A calibrated cluster's measured α/β for this collective, level and
    group size replace the nominal link figures; the placement-aware sharing of inter-node
    links among concurrent rings still applies on top (as a ratio to one unshared ring).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100")
    >>> t = collective_time("all_reduce", 1e9, range(8), c)
    >>> round(t, 4)   # 2·7/8 · 1 GB / 300 GB/s + 14 · 3 µs
    0.0059
    """
    group = tuple(group)
    g = len(group)
    steps, factor = ring_steps_and_factor(collective, g)
    if steps == 0:
        return 0.0
    level = group_level(group, cluster)
    alpha = group_latency(group, cluster)
    beta = group_bandwidth(group, cluster, concurrent=concurrent, placement_aware=placement_aware)
    entry = cluster.profile.lookup(collective, level, g) if cluster.profile.entries else None
    if entry is not None:
        alone = group_bandwidth(group, cluster, placement_aware=placement_aware)
        alpha, beta = entry.latency, entry.bandwidth * (beta / alone)
    return steps * alpha + factor * nbytes / beta


def axis_collective_time(collective: str, nbytes: float, mesh, axis: int | str, *,
                         placement_aware: bool = True) -> float:
    """Time of ``collective`` along one mesh axis: every group of the axis runs at once, and
    the slowest group sets the time."""
    groups = mesh.groups(axis)
    return max(collective_time(collective, nbytes, g, mesh.cluster, concurrent=groups,
                               placement_aware=placement_aware) for g in groups)
