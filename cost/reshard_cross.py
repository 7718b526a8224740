"""Cost of cross-mesh resharding (the cross-mesh paper, §3): pure functions of bytes, device ids
and a :class:`fxpar.Cluster` (no process groups, no planner).

A **unit task** moves one slice of ``n`` bytes from a sender device ``s`` to receiver devices
``R`` (grouped by host = cluster node). Links are placement-aware: a hop inside one node runs at
``(α_intra, β_intra)``, a hop between nodes at ``(α_inter, min(β_intra, β_inter))`` where
``β_inter`` is the node's whole NIC (:class:`fxpar.Cluster` convention); a calibrated cluster's
measured ``send_recv`` fits replace the nominal figures (:func:`hop_link`). Let
``t(a, b) = α(a, b) + n/β(a, b)`` be one copy over one hop. The strategies (paper §3.1):

=============  ====================================================  =========================
strategy       what happens                                          time
=============  ====================================================  =========================
``send_recv``  ``s`` sends the whole slice to every receiver          ``Σ_r t(s, r)``  (≈ r·T)
``allgather``  per receiving host ``H`` (``k_H`` receivers): ``s``   ``max_i (Σ_{j≤i} send_j
               sends piece ``i`` of ``⌈n/k_H⌉`` bytes to receiver     + ag_i)``  (≈ hosts·T)
               ``i``, then ``H`` all-gathers locally (Alpa's)
``broadcast``  a chain ``s → receivers`` (the sender's host first,   ``(Σα − α_m + M)
               then host by host) pipelined in ``k`` chunks          + (B − M)/k + k·α_m``
=============  ====================================================  =========================

where for the all-gather ``send_H = Σ_{r∈H} (α(s, r) + ⌈n/k_H⌉/β(s, r))`` and ``ag_H`` the ring
all-gather of ``⌈n/k_H⌉`` over ``H``'s receivers (:func:`fxpar.cost.comm.collective_time`),
hosts taken the sender's first, then ascending; and for the broadcast ``B = Σ_hops n/β``,
``M = max_hops n/β`` (``α_m`` that hop's latency): the pipeline fills in ``B/k`` and streams
the remaining ``k − 1`` chunks at the bottleneck hop. ``k`` minimizes it: ``k* = √((B−M)/α_m)``,
at least 1, at most ``n / min_chunk_bytes``. With α → 0 and ``h`` inter-node hops of ``T``
each this is the paper's ``T·(1 + (h−1)/k) → T``: one copy across a host boundary, however
many hosts receive.

**Lower bound** (:func:`lower_bound`) of moving a set of pieces, each ``(n, holders,
receivers)``; a transfer occupies the NIC of every host it touches (the paper's host-level
model, Eq. 3: tasks sharing a host do not overlap), so the completion time is at least

* per receiving host ``H``: ``Σ (α_inter + n/β_inter)`` over pieces needed on ``H`` that no
  device of ``H`` holds (each must come in through ``H``'s NIC once, in one message at least);
* per receiving device: ``Σ (min α + n/max β)`` over the pieces it needs and lacks;
* per set ``S`` of holder hosts (each piece's holder-host set, and all of them):
  ``Σ (α_inter + n/β_inter) / |S|`` over pieces held only inside ``S`` and needed on a host that
  holds none (they leave ``S`` through its NICs, which share the work at best evenly).

Every strategy's time for a task crossing into ``H`` is at least ``α_inter + n/β_inter``
(a broadcast: ``Σα + M`` with ``k ≥ 1``), so a schedule in which tasks sharing a NIC or a
device do not overlap never beats this bound.

>>> from fxpar import Cluster
>>> c = Cluster.preset("aws-p3.8xlarge", physics=None, nodes=2)        # 4 GPUs per node, 10 Gb/s between
>>> n = 2**30                                              # 1 GiB from device 0 to node 1
>>> T = n / c.inter_node_bandwidth
>>> [round(task_time(s, n, 0, (4, 5, 6, 7), c) / T, 2) for s in STRATEGIES]
[4.0, 1.01, 1.0]
>>> round(lower_bound([(n, (0,), (4, 5, 6, 7))], c) / T, 2)
1.0
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from fxpar.cost.comm import collective_time, group_bandwidth, group_latency, link_bandwidth
from fxpar.kinds import StrKind

__all__ = ["Strategy", "STRATEGIES", "hop_link", "level_link", "send_recv_time", "allgather_time", "broadcast_time",
           "broadcast_chunks", "task_time", "chain", "lower_bound", "local_copy_time"]

#: Per-task strategies, in the order the planner reports them.
class Strategy(StrKind):
    """How one unit task moves its slice (the table in the module docstring)."""

    SEND_RECV = "send_recv"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"


STRATEGIES = tuple(Strategy)

#: Smallest chunk a pipelined broadcast cuts a slice into (bounds ``k``).
MIN_CHUNK_BYTES = 1 << 16


def level_link(level: str, cluster) -> tuple[float, float]:
    """``(α, β)`` of one point-to-point hop at ``level`` (``"intra"`` or ``"inter"``): nominal
    (``group_latency``/``group_bandwidth`` of a pair) or the cluster's calibrated
    ``send_recv`` fit for that level.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("aws-p3.8xlarge", physics=None, nodes=2)
    >>> level_link("inter", c) == (c.inter_node_latency, c.inter_node_bandwidth)
    True
    """
    if level not in ("intra", "inter"):
        raise ValueError(f"level must be 'intra' or 'inter', got {level!r}")
    if level == "inter" and cluster.nodes > 1:
        pair = (0, cluster.devices_per_node)
    elif cluster.devices_per_node > 1 or cluster.nodes == 1:
        pair = (0, min(1, cluster.num_devices - 1))
        level = "intra"
    else:  # one device per node: an intra-node hop never happens; price it as inter
        pair = (0, 1)
    alpha = group_latency(pair, cluster)
    beta = group_bandwidth(pair, cluster, collective="send_recv") if pair[0] != pair[1] \
        else link_bandwidth(cluster, "intra")
    if cluster.profile.entries:
        e = cluster.profile.lookup("send_recv", level, 2)
        if e is not None:
            alpha, beta = e.latency, e.bandwidth
    return alpha, beta


def hop_link(a: int, b: int, cluster) -> tuple[float, float]:
    """``(α, β)`` of one copy from device ``a`` to device ``b``: intra- or inter-node level.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("aws-p3.8xlarge", physics=None, nodes=2)
    >>> hop_link(0, 3, c)[1] == c.intra_node_bandwidth, hop_link(0, 4, c)[1] == c.inter_node_bandwidth
    (True, True)
    """
    same = cluster.node_of(a) == cluster.node_of(b)
    return level_link("intra" if same else "inter", cluster)


def _hop(nbytes: float, a: int, b: int, cluster) -> float:
    alpha, beta = hop_link(a, b, cluster)
    return alpha + nbytes / beta


def _by_host(sender: int, receivers: Sequence[int], cluster) -> list[tuple[int, tuple[int, ...]]]:
    """Receivers grouped by node: the sender's node first, then ascending; devices ascending."""
    hosts: dict[int, list[int]] = {}
    for r in sorted(set(receivers)):
        hosts.setdefault(cluster.node_of(r), []).append(r)
    me = cluster.node_of(sender)
    order = sorted(hosts, key=lambda h: (h != me, h))
    return [(h, tuple(hosts[h])) for h in order]


def chain(sender: int, receivers: Sequence[int], cluster) -> tuple[int, ...]:
    """The broadcast chain: the sender, its own node's receivers, then node by node, so the
    chain crosses each node boundary once.

    >>> from fxpar import Cluster
    >>> chain(5, (0, 4, 1, 6), Cluster.preset("aws-p3.8xlarge", physics=None, nodes=2))
    (5, 4, 6, 0, 1)
    """
    return (sender,) + tuple(r for _, rs in _by_host(sender, receivers, cluster) for r in rs)


def send_recv_time(nbytes: float, sender: int, receivers: Sequence[int], cluster) -> float:
    """``Σ_r (α + n/β)(s, r)``: the sender copies the slice to each receiver in turn.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("aws-p3.8xlarge", physics=None, nodes=2)
    >>> send_recv_time(1e6, 0, (4, 5), c) == 2 * (c.inter_node_latency + 1e6 / c.inter_node_bandwidth)
    True
    """
    return sum(_hop(nbytes, sender, r, cluster) for r in set(receivers))


def allgather_time(nbytes: float, sender: int, receivers: Sequence[int], cluster) -> float:
    """Send ``⌈n/k_H⌉`` to each of the ``k_H`` receivers of every host, then all-gather per
    host; a host's all-gather overlaps the sends to the next hosts:
    ``max_i (Σ_{j≤i} send_j + ag_i)`` (module docstring).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("aws-p3.8xlarge", physics=None, nodes=3)
    >>> T = 1e9 / c.inter_node_bandwidth
    >>> round(allgather_time(1e9, 0, (4, 5, 8, 9), c) / T, 3)       # one copy per host
    2.004
    """
    done, total = 0.0, 0.0
    for _, rs in _by_host(sender, receivers, cluster):
        k = len(rs)
        piece = math.ceil(nbytes / k)
        done += sum(_hop(piece, sender, r, cluster) for r in rs)
        ag = collective_time("all_gather", piece, rs, cluster) if k > 1 else 0.0
        total = max(total, done + ag)
    return total


def _chain_terms(nbytes: float, sender: int, receivers: Sequence[int], cluster):
    ch = chain(sender, receivers, cluster)
    hops = [hop_link(a, b, cluster) for a, b in zip(ch, ch[1:])]
    if not hops:
        return None
    alphas = [a for a, _ in hops]
    times = [nbytes / b for _, b in hops]
    m = max(range(len(hops)), key=lambda i: (times[i] + alphas[i], i))
    return sum(alphas), sum(times), times[m], alphas[m]


def broadcast_chunks(nbytes: float, sender: int, receivers: Sequence[int], cluster, *,
                     min_chunk_bytes: int = MIN_CHUNK_BYTES) -> int:
    """The chunk count ``k`` of the pipelined broadcast: ``√((B − M)/α_m)`` rounded to the
    better neighbour, in ``[1, max(1, n // min_chunk_bytes)]`` (module docstring).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("aws-p3.8xlarge", physics=None, nodes=2)
    >>> broadcast_chunks(1e3, 0, (4,), c), broadcast_chunks(2**30, 0, (1, 2, 3, 4, 5, 6, 7), c) > 10
    (1, True)
    """
    terms = _chain_terms(nbytes, sender, receivers, cluster)
    if terms is None:
        return 1
    _, b, m, am = terms
    kmax = max(1, int(nbytes // max(1, min_chunk_bytes)))
    if b - m <= 0:
        return 1
    if am <= 0:
        return kmax
    k = math.sqrt((b - m) / am)
    cands = {max(1, min(kmax, math.floor(k))), max(1, min(kmax, math.ceil(k)))}
    return min(cands, key=lambda c: (_pipe(terms, c), c))


def _pipe(terms, k: int) -> float:
    sa, b, m, am = terms
    return (sa - am + m) + (b - m) / k + k * am


def broadcast_time(nbytes: float, sender: int, receivers: Sequence[int], cluster, *,
                   chunks: int | None = None, min_chunk_bytes: int = MIN_CHUNK_BYTES) -> float:
    """Chunked pipelined broadcast along :func:`chain`:
    ``(Σα − α_m + M) + (B − M)/k + k·α_m`` with ``k`` from :func:`broadcast_chunks` unless
    given (module docstring). Zero receivers cost nothing.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("aws-p3.8xlarge", physics=None, nodes=5, inter_node_latency=0.0)
    >>> T = 1e9 / c.inter_node_bandwidth           # h = 4 receiving hosts, one device each
    >>> round(broadcast_time(1e9, 0, (4, 8, 12, 16), c, chunks=8) / T, 4)   # T·(1 + 3/8)
    1.375
    """
    terms = _chain_terms(nbytes, sender, receivers, cluster)
    if terms is None:
        return 0.0
    k = chunks if chunks is not None else broadcast_chunks(nbytes, sender, receivers, cluster,
                                                           min_chunk_bytes=min_chunk_bytes)
    if k < 1:
        raise ValueError(f"broadcast chunks must be >= 1, got {k}")
    return _pipe(terms, k)


def task_time(strategy: str, nbytes: float, sender: int, receivers: Sequence[int], cluster) -> float:
    """Seconds of one unit task under ``strategy`` (one of :data:`STRATEGIES`); 0 without
    receivers.

    >>> from fxpar import Cluster
    >>> task_time("send_recv", 1e6, 0, (), Cluster.preset("aws-p3.8xlarge", physics=None))
    0.0
    """
    receivers = tuple(r for r in set(receivers) if r != sender)
    if not receivers:
        return 0.0
    time = _TASK_TIME.get(strategy)
    if time is None:
        raise ValueError(f"unknown cross-mesh strategy {strategy!r}; known: {STRATEGIES}")
    return time(nbytes, sender, receivers, cluster)


_TASK_TIME = {Strategy.SEND_RECV: send_recv_time, Strategy.ALLGATHER: allgather_time,
              Strategy.BROADCAST: broadcast_time}


def local_copy_time(nbytes: float, cluster) -> float:
    """A device copying a slice it already holds into its new shard: read + write at the
    memory bandwidth, ``2·n / B_mem``.

    >>> from fxpar import Cluster
    >>> local_copy_time(9e8, Cluster.preset("aws-p3.8xlarge", physics=None)) == 2 * 9e8 / (900 * 1e9)
    True
    """
    return 2.0 * nbytes / cluster.memory_bandwidth


def lower_bound(pieces: Iterable[tuple[float, Sequence[int], Sequence[int]]], cluster) -> float:
    """Seconds below which no schedule can move ``pieces`` (each ``(nbytes, holder devices,
    receiver devices)``; receivers that hold the piece themselves are ignored): the largest
    of the per-receiving-host, per-receiving-device and per-sending-host-set bounds of the
    module docstring.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("aws-p3.8xlarge", physics=None, nodes=4)     # hosts 0,1 hold halves, 2,3 need both
    >>> T = 1e9 / c.inter_node_bandwidth
    >>> pieces = [(1e9, (0,), (8, 12)), (1e9, (4,), (8, 12))]
    >>> round(lower_bound(pieces, c) / T, 3)              # each receiving host takes in 2 GB
    2.0
    """
    a_inter, b_inter = level_link("inter", cluster)
    a_intra, b_intra = level_link("intra", cluster)
    b_dev, a_dev = max(b_inter, b_intra), min(a_inter, a_intra)
    host_in: dict[int, float] = {}
    dev_in: dict[int, float] = {}
    by_set: dict[frozenset, float] = {}
    all_hosts: set[int] = set()
    for n, holders, receivers in pieces:
        hs = frozenset(cluster.node_of(d) for d in holders)
        rs = [r for r in set(receivers) if r not in set(holders)]
        if not rs or n <= 0:
            continue
        for r in rs:
            dev_in[r] = dev_in.get(r, 0.0) + a_dev + n / b_dev
        rh = {cluster.node_of(r) for r in rs} - hs
        for h in rh:
            host_in[h] = host_in.get(h, 0.0) + a_inter + n / b_inter
        if rh:
            by_set[hs] = by_set.get(hs, 0.0) + a_inter + n / b_inter
            all_hosts |= hs
    bounds = [0.0, *host_in.values(), *dev_in.values()]
    sets = set(by_set) | ({frozenset(all_hosts)} if all_hosts else set())
    for s in sets:
        tot = sum(v for k, v in by_set.items() if k <= s)
        bounds.append(tot / len(s))
    return max(bounds)
