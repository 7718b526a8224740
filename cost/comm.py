"""Communication cost: ring collectives with placement-aware bandwidth (pure functions).

Every collective is priced ``t = latency + factor·m/β``. The **bandwidth term** is the ring's
(AxoNN §V-A eq. 1–3, which drop latency), for a group of ``G`` devices:

====================  ====================  ==========================
collective            ``factor·m/β``        ``m`` is
====================  ====================  ==========================
all_gather            ``(G−1)·m/β``         the per-device input shard
reduce_scatter        ``(G−1)/G·m/β``       the full per-device buffer
all_reduce            ``2(G−1)/G·m/β``      the full per-device buffer
all_to_all            ``(G−1)/G·m/β``       the full per-device buffer
broadcast             ``m/β`` (pipelined)   the buffer
send_recv             ``m/β``               the buffer
====================  ====================  ==========================

The ring is bandwidth-optimal, and it stays the bandwidth term whichever algorithm runs:
NCCL's model gives its tree all-reduce an algorithm bandwidth of half the bus bandwidth,
``2·m/busBw``, against the ring's ``2(G−1)/G·m/busBw`` (equal for large ``G``).

The **latency term** is a number of steps at the intra-node latency ``α_i`` plus a number at
the inter-node latency ``α_e`` (:func:`latency_steps`), for a group spanning ``N`` nodes with
at most ``k`` members on one node (``G = N·k`` when even):

====================  ======================================  =========================================
collective            ``N = 1`` (one node: the ring)          ``N > 1`` (hierarchical)
====================  ======================================  =========================================
all_gather            ``(G−1)·α_i``                           ``(G−N)·α_n + (N−1)·α_e``
reduce_scatter        ``(G−1)·α_i``                           ``(G−N)·α_n + (N−1)·α_e``
all_reduce            ``2(G−1)·α_i``                          ``2(k−1)·α_i + 2⌈log2 N⌉·α_e``
broadcast             ``(G−1)·α_i``                           ``(k−1)·α_i + ⌈log2 N⌉·α_e``
all_to_all            ``(G−1)·α_i``                           ``(G−1)·α_e`` (unchanged: flat)
send_recv             ``α_i``                                 ``α_e``
====================  ======================================  =========================================

Why these (NCCL's own cost model, ``ncclTopoTuneModel`` in ``src/graph/tuning.cc``):

* **all-reduce across nodes runs NCCL's tree** (double binary tree between nodes, a chain
  inside each node; chosen for multi-node all-reduce since NCCL 2.4 where latency matters;
  CollNet/SHARP, where the switches reduce, has fewer inter-node hops still). NCCL prices it
  ``2·((nRanks/nNodes − 1)·intraLat + log2(nNodes)·interLat)``: reduce up the intra-node chain
  and the tree, broadcast back down. Here ``⌈log2 N⌉`` (NCCL truncates, ``log2i``; equal for
  a power-of-two node count, one inter-node hop more otherwise: a tree that reaches ``N``
  leaves). Even NCCL's ring all-reduce is priced ``2(G−N)·α_i + 2(N−1)·α_e`` there, never
  ``2(G−1)·α_e``; the tree is the smaller at scale.
* **all-gather and reduce-scatter run NCCL's ring**, whose steps are pipelined, not
  bulk-synchronous: a chunk travels ``G−1`` hops and only the hops that cross a node boundary
  pay ``α_e``. NCCL prices it ``(nsteps − nInterSteps)·intraLat + nInterSteps·interLat`` with
  ``nInterSteps = nNodes − 1`` (the hierarchical intra-then-inter view, ``(k−1)`` and ``(N−1)``
  stages, gives fewer intra steps; the ring's count is the one NCCL runs and prices). Once the
  ring leaves a node, NCCL floors ``intraLat`` at its network post overhead ("inter-node
  rings still have to launch nsteps * net overhead"): ``α_n = max(α_i,
  Physics.net_overhead)``, 6 µs on the A100 presets' AMD hosts against NVLink's 3 µs, which
  doubles the latency of a ZeRO-3 gather over hundreds of GPUs.
* **broadcast** as a pipelined tree: a chain inside the node, a binary tree across nodes.
* **all-to-all** is not a ring and not a tree (every pair exchanges); it keeps ``G−1`` steps
  at the slowest link. **send_recv** is one hop.

The flat ring this replaces priced every one of the ``2(G−1)`` all-reduce steps at ``α_e`` once
the group left a node: for data parallelism over 1024 GPUs (128 nodes × 8) that is
``2·1023·8 µs ≈ 16 ms`` per gradient bucket, where the tree pays
``2·7·3 µs + 2·7·8 µs = 154 µs`` (a800 figures).

With α = 0 the times are exactly AxoNN eq. 1 (AG), eq. 2 (RS) and eq. 3 (AR), and on one node
(``N = 1``) they are the ring's ``steps·α_i + factor·m/β`` exactly as before.

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
group, whatever its placement (the inter-node figures on a multi-node cluster), and the flat
ring's step count ``steps·α`` (:func:`ring_steps_and_factor`): a deliberately naive model that
knows nothing of nodes, so it knows no hierarchy either.

**Calibration**: a cluster from :meth:`fxpar.Cluster.calibrate` carries fitted α/β per
collective, level and group size; those replace the nominal link figures, and the sharing of
inter-node links among concurrent rings still applies on top as a ratio. A fitted α is the
latency *per step* of the step count the fit divided by (:func:`fxpar.cost.calibration.fit_alpha_beta`):
an ``"intra"`` entry is priced ``steps·α`` with the ring's steps (as the nominal model); an
``"inter"`` entry measured one latency for a whole multi-node collective, which the fit spreads
over the same total ``intra + inter`` steps of :func:`latency_steps` that pricing multiplies it
by, so a measured group is reproduced exactly and other group sizes scale with the
hierarchical step count, not the flat ring's. The placement-agnostic model multiplies the
entry's α by the flat ring's steps (it has no hierarchy).

>>> from fxpar import Cluster
>>> from fxpar.cost.comm import group_bandwidth
>>> c = Cluster.preset("perlmutter", physics=None, nodes=2)            # 4 devices per node
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

from fxpar.kinds import Collective

__all__ = ["pairs_time", 
    "COLLECTIVES",
    "ring_steps_and_factor",
    "latency_steps",
    "group_level",
    "group_bandwidth",
    "link_bandwidth",
    "group_latency",
    "latency_time",
    "collective_time",
    "axis_collective_time",
    "axis_bandwidth",
]

#: Collectives this module prices, by name (:class:`fxpar.kinds.Collective`; the same as
#: :data:`fxpar.cluster.COLLECTIVES`).
COLLECTIVES = tuple(c.value for c in Collective)
C = Collective
#: ``(steps, factor)`` of the flat ring over ``g > 1`` devices (:func:`ring_steps_and_factor`)
_RING = {
    C.ALL_GATHER: lambda g: (g - 1, float(g - 1)),
    C.REDUCE_SCATTER: lambda g: (g - 1, (g - 1) / g),
    C.ALL_TO_ALL: lambda g: (g - 1, (g - 1) / g),
    C.ALL_REDUCE: lambda g: (2 * (g - 1), 2 * (g - 1) / g),
    C.BROADCAST: lambda g: (g - 1, 1.0),
    C.SEND_RECV: lambda g: (1, 1.0),
}
#: ``(intra_steps, inter_steps)`` of a group spanning ``n > 1`` nodes, at most ``k`` devices on
#: one, ``depth = ⌈log2 n⌉``, ``steps`` the flat ring's (:func:`latency_steps`)
_ACROSS_NODES = {
    C.ALL_REDUCE: lambda g, n, k, depth, steps: (2 * (k - 1), 2 * depth),
    C.ALL_GATHER: lambda g, n, k, depth, steps: (g - n, n - 1),
    C.REDUCE_SCATTER: lambda g, n, k, depth, steps: (g - n, n - 1),
    C.BROADCAST: lambda g, n, k, depth, steps: (k - 1, depth),
    C.ALL_TO_ALL: lambda g, n, k, depth, steps: (0, steps),  # G−1 at the slowest link
    C.SEND_RECV: lambda g, n, k, depth, steps: (0, steps),   # one hop
}


#: rings whose intra-node steps NCCL floors at the network post overhead once the ring spans
#: nodes (all-reduce across nodes is priced as NCCL's tree, module docstring)
_NET_FLOORED = (C.ALL_GATHER, C.REDUCE_SCATTER)


def ring_steps_and_factor(collective: str, group_size: int) -> tuple[int, float]:
    """``(steps, factor)`` with ``t = steps·α + factor·m/β`` for the flat ring algorithm.

    AxoNN eq. 1–3: all-gather ``factor = G−1``, reduce-scatter ``(G−1)/G``, all-reduce
    ``2(G−1)/G``; a group of one device costs nothing. ``factor`` is the bandwidth term of
    every group; ``steps`` is the latency of a group inside one node and of the
    placement-agnostic model (a group spanning nodes: :func:`latency_steps`).

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
    return _RING[collective](g)


def latency_steps(collective: str, group_size: int, nodes: int = 1,
                  per_node: int | None = None) -> tuple[int, int]:
    """``(intra_steps, inter_steps)``: the latency is ``intra_steps·α_i + inter_steps·α_e`` for
    ``collective`` over ``group_size`` devices on ``nodes`` nodes, at most ``per_node`` of them
    on one node (default ``⌈group_size/nodes⌉``); the table and sources in the module docstring.

    One node is the ring, every step intra-node (``ring_steps_and_factor``'s steps):

    >>> latency_steps("all_reduce", 8)
    (14, 0)

    Data parallelism over 128 nodes × 8: a chain inside the node, a tree across nodes, both
    ways (``2·7`` and ``2·⌈log2 128⌉``) instead of 2046 flat ring steps:

    >>> latency_steps("all_reduce", 1024, 128)
    (14, 14)

    One device per node (strided groups): the tree alone.

    >>> latency_steps("all_reduce", 128, 128)
    (0, 14)

    Ring all-gather over 2 nodes × 8: 15 hops, one of them crosses the node boundary:

    >>> latency_steps("all_gather", 16, 2), latency_steps("reduce_scatter", 16, 2)
    ((14, 1), (14, 1))
    >>> latency_steps("broadcast", 24, 3)                  # chain of 8, then ⌈log2 3⌉ = 2
    (7, 2)
    >>> latency_steps("all_to_all", 16, 2), latency_steps("send_recv", 2, 2)
    ((0, 15), (0, 1))
    >>> latency_steps("all_gather", 1, 1)
    (0, 0)
    """
    g = group_size
    steps, _ = ring_steps_and_factor(collective, g)
    if steps == 0:
        return 0, 0
    if not 1 <= nodes <= g:
        raise ValueError(f"latency_steps: {g} devices cannot span {nodes} nodes")
    if nodes == 1:
        return steps, 0
    n = nodes
    k = per_node if per_node is not None else -(-g // n)
    if not -(-g // n) <= k <= g - n + 1:
        raise ValueError(f"latency_steps: {g} devices on {n} nodes cannot put at most {k} on one")
    depth = (n - 1).bit_length()  # ⌈log2 n⌉: depth of a binary tree over n nodes
    return _ACROSS_NODES[collective](g, n, k, depth, steps)


def _span(group: Sequence[int], cluster) -> tuple[int, int]:
    """``(nodes, most members on one node)`` of a group."""
    per = Counter(cluster.node_of(d) for d in group)
    return len(per), max(per.values())


def group_level(group: Sequence[int], cluster) -> str:
    """``"intra"`` if every device of the group is on one node, else ``"inter"``.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("perlmutter", physics=None, nodes=2)
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


def link_bandwidth(cluster, level: str) -> float:
    """The bus bandwidth one device reaches on a link of ``level`` (``"intra"``: its
    ``intra_node_bandwidth``; ``"inter"``: the node's ``inter_node_bandwidth``; ``"switch"``:
    a leaf's uplink): the nominal figure times the cluster's :class:`~fxpar.cluster.Physics`
    efficiency of that network level (``intra_comm_efficiency``, else ``inter_comm_efficiency``).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100")
    >>> round(link_bandwidth(c, "intra") / 1e9, 1), round(link_bandwidth(c, "inter") / 1e9, 1)
    (231.0, 184.0)
    """
    bw = {"intra": cluster.intra_node_bandwidth, "inter": cluster.inter_node_bandwidth,
          "switch": cluster.inter_switch_bandwidth}[level]
    ph = getattr(cluster, "physics", None)
    if ph is None:
        return bw
    return bw * (ph.intra_comm_efficiency if level == "intra" else ph.inter_comm_efficiency)


def _agnostic_link(cluster) -> tuple[float, float]:
    """The one (α, β) of the placement-agnostic model: inter-node figures on a multi-node
    cluster (AxoNN §V-C sets every bandwidth to one constant), intra-node on one node."""
    if cluster.nodes > 1:
        return cluster.inter_node_latency, min(link_bandwidth(cluster, "intra"),
                                               link_bandwidth(cluster, "inter"))
    return cluster.intra_node_latency, link_bandwidth(cluster, "intra")


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

    Every link at its bus bandwidth (:func:`link_bandwidth`: nominal times the level's
    efficiency).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100", nodes=2, physics=None)   # 8 per node, 200 GB/s off-node
    >>> group_bandwidth(range(16), c) / 1e9                 # one ring over both nodes
    200.0
    >>> [group_bandwidth((i, i + 8), c, concurrent=[(j, j + 8) for j in range(8)]) / 1e9 for i in (0,)]
    [25.0]
    """
    group = tuple(group)
    if not placement_aware:
        return _agnostic_link(cluster)[1]
    if group_level(group, cluster) == "intra":
        return link_bandwidth(cluster, "intra")
    conc = [tuple(g) for g in concurrent] if concurrent is not None else [group]
    return _shared_beta(group, cluster, _level_loads(conc, cluster, collective), collective)


def _level_loads(concurrent: Sequence[tuple[int, ...]], cluster, collective: str | None):
    """``[(domain key, link bandwidth, load per domain)]`` for the node level and, with leaf
    switches, the switch level: ring crossings, or all-to-all egress in units of ``m``."""
    levels = [(cluster.node_of, link_bandwidth(cluster, "inter"))]
    if cluster.nodes_per_switch is not None and cluster.inter_switch_bandwidth is not None:
        levels.append((cluster.switch_of, link_bandwidth(cluster, "switch")))
    count = _a2a_egress if collective == "all_to_all" else _ring_loads
    return [(key, bw, count(concurrent, key)) for key, bw in levels]


def _shared_beta(group: tuple[int, ...], cluster, loads, collective: str | None) -> float:
    """β of one multi-node group given the loads of every level (see :func:`group_bandwidth`)."""
    beta = link_bandwidth(cluster, "intra")
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
    """Per-hop latency α: the slower link the group uses (inter-node if it leaves a node). The
    latency of a whole collective is :func:`latency_time`.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100", physics=None, nodes=2)
    >>> group_latency((0, 1), c), group_latency((0, 8), c)
    (3e-06, 8e-06)
    """
    if not placement_aware:
        return _agnostic_link(cluster)[0]
    return cluster.intra_node_latency if group_level(group, cluster) == "intra" else cluster.inter_node_latency


def latency_time(collective: str, group: Sequence[int], cluster, *, placement_aware: bool = True) -> float:
    """Seconds of latency of one ``collective`` over ``group``: ``intra·α_i + inter·α_e`` with
    the steps of :func:`latency_steps` (placement-agnostic: the flat ring's ``steps·α``), or the
    cluster's calibrated α where it has one (module docstring).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("a800", physics=None, nodes=128)               # α_i 3 µs, α_e 8 µs
    >>> round(latency_time("all_reduce", range(1024), c) * 1e6, 3)   # 14·3 + 14·8 µs
    154.0
    >>> round(latency_time("all_reduce", range(1024), c, placement_aware=False) * 1e3, 3)  # 2046·8 µs
    16.368

    A ring all-gather over the same 1024 devices posts every step to the network:
    ``(1024 − 128)·max(α_i, net_overhead) + 127·α_e`` (``dgx-a100``: 6 µs, AMD hosts).

    >>> d = Cluster.preset("dgx-a100", nodes=128)
    >>> round(latency_time("all_gather", range(1024), d) * 1e6, 3)   # 896·6 + 127·8 µs
    6392.0
    >>> round(latency_time("all_gather", range(8), d) * 1e6, 3)      # one node: 7·3 µs
    21.0
    """
    group = tuple(group)
    return _latency(collective, group, cluster, placement_aware, *_span(group, cluster))


def _latency(collective: str, group: tuple[int, ...], cluster, placement_aware: bool,
             nodes: int, per_node: int) -> float:
    """:func:`latency_time` given the group's span (nodes, most members on one node)."""
    g = len(group)
    if not placement_aware:
        steps, _ = ring_steps_and_factor(collective, g)
        entry = _entry(collective, g, cluster, "inter" if cluster.nodes > 1 else "intra")
        return steps * (entry.latency if entry is not None else _agnostic_link(cluster)[0])
    intra, inter = latency_steps(collective, g, nodes, per_node)
    entry = _entry(collective, g, cluster, "intra" if nodes == 1 else "inter")
    if entry is not None:
        return (intra + inter) * entry.latency
    alpha = cluster.intra_node_latency
    if nodes > 1 and collective in _NET_FLOORED and cluster.physics is not None:
        alpha = max(alpha, cluster.physics.net_overhead)   # NCCL's ring: every step posts
    return intra * alpha + inter * cluster.inter_node_latency


def _entry(collective: str, group_size: int, cluster, level: str):
    """The cluster's calibrated profile entry for this collective, level and size, if any."""
    if not cluster.profile.entries:
        return None
    return cluster.profile.lookup(collective, level, group_size)


def _link(collective: str, group: tuple[int, ...], cluster, concurrent, placement_aware: bool):
    """``(latency seconds, β)`` for this collective on ``group``, calibrated where the cluster
    has a profile."""
    nodes, per_node = _span(group, cluster)
    beta = group_bandwidth(group, cluster, concurrent=concurrent, placement_aware=placement_aware,
                           collective=collective)
    return (_latency(collective, group, cluster, placement_aware, nodes, per_node),
            _calibrated_beta(collective, group, cluster, beta, placement_aware))


def _calibrated_beta(collective: str, group: tuple[int, ...], cluster, beta: float,
                     placement_aware: bool) -> float:
    """Replace the nominal β by the cluster's measured profile where it has one."""
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
            beta = entry.bandwidth * share
    return beta


def pairs_time(nbytes: float, pairs: Sequence[tuple[int, int]], cluster) -> float:
    """Seconds of index-aligned point-to-point copies run at once (a stage boundary: device
    ``src[i]`` sends its ``nbytes`` shard to ``dst[i]``): the slowest pair's ``send_recv``,
    the pairs that cross nodes sharing their links. The one price of a pipeline transfer
    (planned boundaries, the joint search, Megatron's formulas).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100", physics=None, nodes=2)
    >>> t = pairs_time(1e6, [(i, 8 + i) for i in range(8)], c)   # 8 pairs share the 200 GB/s NIC
    >>> round(t * 1e6, 3)                                         # 8 µs + 8·1 MB / 200 GB/s
    48.0
    """
    if not nbytes or not pairs:
        return 0.0
    links = _pairs_links(tuple(tuple(int(x) for x in pr) for pr in pairs), cluster)
    return max((latency + factor * nbytes / beta for latency, beta, factor in links), default=0.0)


@functools.lru_cache(maxsize=4096)
def _pairs_links(pairs: tuple[tuple[int, ...], ...], cluster) -> tuple[tuple[float, float, float], ...]:
    """The distinct ``(latency, β, factor)`` of :func:`pairs_time`'s pairs (all at once),
    independent of the bytes: cached, as the joint search prices one boundary at many sizes
    (sharing the links among the pairs is what costs)."""
    out = set()
    for pr in pairs:
        steps, factor = ring_steps_and_factor("send_recv", len(pr))
        if steps:   # a one-device "pair" moves nothing
            out.add((*_link("send_recv", pr, cluster, pairs, True), factor))
    return tuple(sorted(out))


def collective_time(collective: str, nbytes: float, group: Sequence[int], cluster, *,
                    concurrent: Sequence[Sequence[int]] | None = None,
                    placement_aware: bool = True) -> float:
    """Seconds for one ``collective`` of ``nbytes`` over ``group``:
    ``latency + factor·nbytes/β`` (tables above for what ``nbytes`` is; β from
    :func:`group_bandwidth`, the latency from :func:`latency_time`).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100", physics=None)
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
    latency, beta = _link(collective, group, cluster, concurrent, placement_aware)
    return latency + factor * nbytes / beta


@functools.lru_cache(maxsize=4096)
def _axis_links(collective: str, mesh, axis: int, placement_aware: bool):
    """Distinct ``(latency seconds, β)`` over the groups of one mesh axis (all run concurrently)."""
    groups = mesh.groups(axis)
    cluster = mesh.cluster
    if not placement_aware or all(group_level(g, cluster) == "intra" for g in groups):
        links = {_link(collective, g, cluster, groups, placement_aware) for g in groups}
    else:
        # Loads are counted once for the whole axis, not once per group (linear, not quadratic).
        loads = _level_loads(groups, cluster, collective)
        links = set()
        for g in groups:
            nodes, per_node = _span(g, cluster)
            beta = (link_bandwidth(cluster, "intra") if nodes == 1
                    else _shared_beta(g, cluster, loads, collective))
            links.add((_latency(collective, g, cluster, True, nodes, per_node),
                       _calibrated_beta(collective, g, cluster, beta, True)))
    return tuple(sorted(links))


def axis_collective_time(collective: str, nbytes: float, mesh, axis: int | str, *,
                         placement_aware: bool = True) -> float:
    """Time of ``collective`` along one mesh axis: every group of the axis runs at once, and
    the slowest group sets the time (the groups are each other's ``concurrent`` rings).

    >>> from fxpar import Cluster, Mesh
    >>> m = Mesh(Cluster.preset("perlmutter", physics=None, nodes=2), dp=2, tp=4)
    >>> t_dp = axis_collective_time("all_reduce", 1e8, m, "dp")   # 4 rings share 100 GB/s
    >>> round(t_dp * 1e3, 3)   # 2·1/2 · 1e8 / 25e9 + 2·⌈log2 2⌉ · 8 µs
    4.016
    """
    a = mesh.axis_index(axis)
    steps, factor = ring_steps_and_factor(collective, mesh.shape[a])
    if steps == 0:
        return 0.0
    return max(latency + factor * nbytes / beta
               for latency, beta in _axis_links(collective, mesh, a, placement_aware))


def axis_bandwidth(mesh, axis: int | str, *, collective: str = "all_reduce",
                   placement_aware: bool = True) -> float:
    """The slowest effective β over the groups of one mesh axis (AxoNN's ``β_i``).

    >>> from fxpar import Cluster, Mesh
    >>> m = Mesh(Cluster.preset("perlmutter", physics=None, nodes=4), data=2, z=2, y=2, x=2)
    >>> [axis_bandwidth(m, a) / 1e9 for a in ("x", "y", "z", "data")]
    [300.0, 300.0, 25.0, 25.0]
    """
    a = mesh.axis_index(axis)
    if mesh.shape[a] <= 1:
        return float("inf")
    return min(beta for _, beta in _axis_links(collective, mesh, a, placement_aware))
