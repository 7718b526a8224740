"""AMSP's model-state sharding model (Chen et al., "AMSP: Reducing Communication Overhead of
ZeRO for Efficient LLM Training") as functions, and its planner solved exactly.

Parameters P, gradients G and optimizer states OS are sharded independently, each with a
factor ``s = s⁰ × s¹`` (``s⁰`` devices inside a node, ``s¹`` nodes) over the data-parallel
devices ``s_dp = s_dp⁰ × s_dp¹`` (AMSP §IV-B). Per training step with ``M`` microbatches,
``L`` layers of ``K`` modules of ``Φ_i`` parameters, fp16/bf16 (2 bytes) and bucket size
``U`` bytes (§IV-C):

* ``T_p   = M·L·Σ_i (2·t(AG, 2Φ_i, s_p) + t(RS, 2Φ_i, s_p))``         (eq. in §IV-C1)
* ``T_g   = (M−1)·(2Φ/(U·s_p))·t(AR, U, s_g/s_p)``                     (§IV-C3)
* ``T_os0 = (2Φ/(U·s_p))·t(AR, U, s_dp/s_p)``                          (§IV-C2)
* ``T_os1 = (s_os/s_p)·t(BC, 2Φ/s_os, s_os/s_p)``                      (§IV-C2)
* ``T_comm = T_p + T_g + T_os0 + T_os1``;
  ``D_modelstate = 2Φ/s_p + 2Φ/s_g + 12Φ/s_os`` (§IV-D; fp32: ``4, 4, 8``).

``t(o, v, p⁰×p¹)`` is the time of collective ``o`` on ``v`` bytes (the whole buffer: AG's
gathered output, RS/AR's input, BC's message) over ``p⁰`` devices in each of ``p¹`` nodes. AMSP
profiles it (§IV-A); here it is :func:`fxpar.cost.comm.collective_time` on explicit device
groups, all groups of a kind running at once (so a ring leaving a node shares the NICs with
the others), calibrated when the cluster carries a profile. Sharding groups take consecutive
local ranks and consecutive nodes (AMSP §V-D: under as few leaf switches as possible); the
groups of a ratio ``a/b`` (devices that share a P shard but own different G or OS shards) are
the members of one ``a``-group with the same offset modulo ``b``.

The planner (§V-B) minimizes ``T_comm`` subject to

* ``D_modelstate + D_activation + D_tmp ≤ device memory``           (eq. 2)
* ``1 ≤ s_p⁰ ≤ s_g⁰ ≤ s_os⁰ ≤ s_dp⁰ ≤ R``, ``1 ≤ s_p¹ ≤ s_g¹ ≤ s_os¹ ≤ s_dp¹ ≤ N``  (eq. 3, 4)
* every factor divides ``s_dp`` at its level                          (eq. 5, 6)
* ``s⁰ = s_dp⁰`` whenever ``s¹ > 1``                                   (eq. 7)
* ``s_g ∈ {s_p, s_os}`` (§IV-C3, optional), and ``s_p | s_g | s_os`` at each level (so the
  ratio groups exist).

The space is tiny (a few thousand points for 1024 GPUs), so :func:`plan` enumerates it and
is exact; no solver library is involved.

>>> from fxpar import Cluster
>>> from fxpar.cost.amsp import Sharding, model_state_memory
>>> round(model_state_memory(6.74e9, Sharding((1, 1), (1, 1), (8, 1))) / 2**30, 1)  # LLaMA-7B
34.5
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from fxpar.cost.comm import _link, ring_steps_and_factor

__all__ = [
    "Sharding",
    "AmspCost",
    "model_state_memory",
    "amsp_time",
    "sharding_groups",
    "t_p",
    "t_g",
    "t_os0",
    "t_os1",
    "evaluate",
    "feasible_shardings",
    "plan",
    "named_sharding",
]

_K = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True)
class Sharding:
    """Factors ``(intra, inter)`` for P, G and OS (AMSP's ``s⁰ × s¹``)."""

    p: tuple[int, int] = (1, 1)
    g: tuple[int, int] = (1, 1)
    os: tuple[int, int] = (1, 1)

    @property
    def s_p(self) -> int:
        return self.p[0] * self.p[1]

    @property
    def s_g(self) -> int:
        return self.g[0] * self.g[1]

    @property
    def s_os(self) -> int:
        return self.os[0] * self.os[1]

    def __str__(self) -> str:
        f = lambda s: f"{s[0]}x{s[1]}"  # noqa: E731
        return f"P {f(self.p)}, G {f(self.g)}, OS {f(self.os)}"


def named_sharding(name: str, R: int, N: int, *, group_nodes: int = 1) -> Sharding:
    """The baselines of AMSP Table IV on ``N`` nodes of ``R`` devices: ``"ddp"``, ``"zero1"``,
    ``"zero2"``, ``"zero3"`` (ZeRO++ shards like ZeRO-3), ``"mics"`` (everything sharded over
    ``R × group_nodes``).

    >>> named_sharding("zero1", 8, 4)
    Sharding(p=(1, 1), g=(1, 1), os=(8, 4))
    """
    full, one = (R, N), (1, 1)
    table = {"ddp": Sharding(one, one, one), "zero1": Sharding(one, one, full),
             "zero2": Sharding(one, full, full), "zero3": Sharding(full, full, full),
             "mics": Sharding((R, group_nodes), (R, group_nodes), (R, group_nodes))}
    if name not in table:
        raise ValueError(f"unknown sharding {name!r}; known: {sorted(table)}")
    return table[name]


def model_state_memory(phi: float, sh: Sharding, precision: str = "mixed") -> float:
    """AMSP §IV-D: ``2Φ/s_p + 2Φ/s_g + 12Φ/s_os`` bytes (mixed precision, Adam); ``fp32``
    gives ``4Φ/s_p + 4Φ/s_g + 8Φ/s_os``.

    >>> model_state_memory(1e9, Sharding()) / 1e9, model_state_memory(1e9, Sharding(), "fp32") / 1e9
    (16.0, 16.0)
    """
    kp, kg, kos = _K[precision]
    return kp * phi / sh.s_p + kg * phi / sh.s_g + kos * phi / sh.s_os


# --------------------------------------------------------------------------------------------
# device groups and t(o, v, p0 x p1)
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def sharding_groups(R: int, N: int, a: tuple[int, int], b: tuple[int, int] = (1, 1),
                    dp: tuple[int, int] | None = None) -> tuple[tuple[int, ...], ...]:
    """All device groups of the ratio ``a/b`` on ``N`` nodes of ``R`` devices (device
    ``node·R + local``): inside each block of ``a⁰`` consecutive local ranks and ``a¹``
    consecutive nodes, the members with the same offset modulo ``b``. ``b = (1, 1)`` gives the
    sharding groups themselves. The data-parallel grid ``dp = (s_dp⁰, s_dp¹)`` (default
    ``(R, N)``) is tiled over the cluster.

    >>> sharding_groups(4, 2, (4, 1))                 # P sharded over each node
    ((0, 1, 2, 3), (4, 5, 6, 7))
    >>> sharding_groups(4, 2, (4, 2), (2, 1))         # share a P shard of 2, own OS of 8
    ((0, 2, 4, 6), (1, 3, 5, 7))
    """
    dp0, dp1 = dp or (R, N)
    a0, a1 = a
    b0, b1 = b
    for x, y in ((a0, b0), (a1, b1)):
        if x % y:
            raise ValueError(f"ratio group {a}/{b} is not integral")
    groups = []
    for t0 in range(0, R, dp0):           # tiles of the data-parallel grid inside a node
        for t1 in range(0, N, dp1):       # tiles across nodes
            for blk1 in range(0, dp1, a1):
                for blk0 in range(0, dp0, a0):
                    for o1 in range(b1):
                        for o0 in range(b0):
                            g = tuple((t1 + blk1 + o1 + j * b1) * R + t0 + blk0 + o0 + i * b0
                                      for j in range(a1 // b1) for i in range(a0 // b0))
                            groups.append(g)
    return tuple(groups)


def amsp_time(op: str, v: float, a: tuple[int, int], cluster, *, b: tuple[int, int] = (1, 1),
              dp: tuple[int, int] | None = None, placement_aware: bool = True) -> float:
    """AMSP's ``t(o, v, (a⁰/b⁰) × (a¹/b¹))``: collective ``op`` (``"AG"``, ``"RS"``, ``"AR"``,
    ``"BC"``) on ``v`` bytes over the ratio groups of :func:`sharding_groups`, all running
    concurrently; the slowest group sets the time.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("a800", physics=None, nodes=2)         # 8 GPUs/node, 200 GB/s NVLink
    >>> round(amsp_time("AG", 8e9, (8, 1), c) * 1e3, 1)   # 7/8 · 8 GB / 200 GB/s + 7·3 µs
    35.0
    """
    coll = {"AG": "all_gather", "RS": "reduce_scatter", "AR": "all_reduce", "BC": "broadcast"}[op]
    size, links = _ratio_links(coll, tuple(a), tuple(b), dp, cluster, placement_aware)
    steps, factor = ring_steps_and_factor(coll, size)
    if steps == 0:
        return 0.0
    m = v / size if coll == "all_gather" else v  # collective_time's AG convention: input shard
    return max(latency + factor * m / beta for latency, beta in links)


@functools.lru_cache(maxsize=4096)
def _ratio_links(coll: str, a, b, dp, cluster, placement_aware: bool):
    """Group size and the distinct ``(latency seconds, β)`` of the concurrent ratio groups
    (:func:`fxpar.cost.comm.latency_time`; cached: the planner prices the same groups for many
    shardings)."""
    groups = sharding_groups(cluster.devices_per_node, cluster.nodes, a, b, dp)
    links = {_link(coll, g, cluster, groups, placement_aware) for g in _representatives(groups, cluster)}
    return len(groups[0]), tuple(sorted(links))


def _representatives(groups, cluster):
    """One group per distinct (nodes touched) pattern is enough: groups on the same number of
    nodes with the same per-node count see the same loads on a homogeneous cluster."""
    seen = {}
    for g in groups:
        key = tuple(sorted(Counter(cluster.node_of(d) for d in g).values()))
        key = (key, len({cluster.switch_of(d) for d in g}))
        seen.setdefault(key, g)
    return seen.values()


# --------------------------------------------------------------------------------------------
# the four terms
# --------------------------------------------------------------------------------------------
def t_p(sh: Sharding, module_params: Sequence[float], L: int, M: int, cluster, *,
        dp: tuple[int, int] | None = None, placement_aware: bool = True) -> float:
    """``T_p = M·L·Σ_i (2·t(AG, 2Φ_i, s_p) + t(RS, 2Φ_i, s_p))`` (AMSP §IV-C1)."""
    if sh.s_p == 1:
        return 0.0
    per = sum(2 * amsp_time("AG", 2 * phi_i, sh.p, cluster, dp=dp, placement_aware=placement_aware)
              + amsp_time("RS", 2 * phi_i, sh.p, cluster, dp=dp, placement_aware=placement_aware)
              for phi_i in module_params)
    return M * L * per


def t_g(sh: Sharding, phi: float, M: int, U: float, cluster, *, dp: tuple[int, int] | None = None,
        placement_aware: bool = True) -> float:
    """``T_g = (M−1)·(2Φ/(U·s_p))·t(AR, U, s_g/s_p)`` (AMSP §IV-C3): all-reduce of gradient
    buckets among the devices sharing a P shard, every microbatch but the last."""
    if sh.s_g == sh.s_p or M <= 1:
        return 0.0
    return (M - 1) * (2 * phi / (U * sh.s_p)) * amsp_time("AR", U, sh.g, cluster, b=sh.p, dp=dp,
                                                           placement_aware=placement_aware)


def t_os0(sh: Sharding, phi: float, U: float, cluster, *, dp: tuple[int, int] | None = None,
          placement_aware: bool = True) -> float:
    """``T_os0 = (2Φ/(U·s_p))·t(AR, U, s_dp/s_p)`` (AMSP §IV-C2): the data-parallel gradient
    all-reduce among the replicas of each P shard, once per step."""
    R, N = cluster.devices_per_node, cluster.nodes
    full = dp or (R, N)
    if full[0] * full[1] == sh.s_p:
        return 0.0
    return (2 * phi / (U * sh.s_p)) * amsp_time("AR", U, full, cluster, b=sh.p, dp=dp,
                                                placement_aware=placement_aware)


def t_os1(sh: Sharding, phi: float, cluster, *, dp: tuple[int, int] | None = None,
          placement_aware: bool = True) -> float:
    """``T_os1 = (s_os/s_p)·t(BC, 2Φ/s_os, s_os/s_p)`` (AMSP §IV-C2): broadcast of the updated
    parameters from each OS shard owner to the devices sharing its P shard."""
    if sh.s_os == sh.s_p:
        return 0.0
    return (sh.s_os / sh.s_p) * amsp_time("BC", 2 * phi / sh.s_os, sh.os, cluster, b=sh.p, dp=dp,
                                          placement_aware=placement_aware)


@dataclass(frozen=True)
class AmspCost:
    """One sharding with its four communication terms (s) and model-state memory (bytes)."""

    sharding: Sharding
    t_p: float
    t_g: float
    t_os0: float
    t_os1: float
    memory: float

    @property
    def time(self) -> float:
        return self.t_p + self.t_g + self.t_os0 + self.t_os1


def evaluate(sh: Sharding, *, phi: float, module_params: Sequence[float], L: int, M: int, U: float,
             cluster, precision: str = "mixed", dp: tuple[int, int] | None = None,
             placement_aware: bool = True) -> AmspCost:
    """All four terms and the memory of one sharding.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("a800", physics=None, nodes=2)
    >>> r = evaluate(Sharding(), phi=1e9, module_params=[1e9 / 32] * 1, L=32, M=4, U=5e8, cluster=c)
    >>> r.t_p, r.t_g, r.t_os1, r.t_os0 > 0          # plain data parallelism: one all-reduce
    (0.0, 0.0, 0.0, True)
    """
    kw = dict(dp=dp, placement_aware=placement_aware)
    return AmspCost(sh, t_p(sh, module_params, L, M, cluster, **kw), t_g(sh, phi, M, U, cluster, **kw),
                    t_os0(sh, phi, U, cluster, **kw), t_os1(sh, phi, cluster, **kw),
                    model_state_memory(phi, sh, precision))


def _chains(limit: int) -> list[tuple[int, int, int]]:
    """``(p, g, os)`` with ``p | g | os | limit``."""
    divs = [d for d in range(1, limit + 1) if limit % d == 0]
    return [(p, g, o) for p in divs for g in divs for o in divs if g % p == 0 and o % g == 0]


def feasible_shardings(R: int, N: int, *, dp: tuple[int, int] | None = None,
                       grad_rule: bool = True) -> list[Sharding]:
    """Every sharding allowed by AMSP eq. 3–7 (and ``s_g ∈ {s_p, s_os}`` with ``grad_rule``).

    >>> len(feasible_shardings(8, 1)), len(feasible_shardings(8, 1, grad_rule=False))
    (16, 20)
    """
    dp0, dp1 = dp or (R, N)
    if R % dp0 or N % dp1:
        raise ValueError(f"data-parallel grid {dp0}x{dp1} does not tile {R} devices x {N} nodes")
    out = []
    for (p0, g0, o0), (p1, g1, o1) in itertools.product(_chains(dp0), _chains(dp1)):
        sh = Sharding((p0, p1), (g0, g1), (o0, o1))
        if any(s[1] > 1 and s[0] != dp0 for s in (sh.p, sh.g, sh.os)):  # eq. 7
            continue
        if grad_rule and sh.g not in (sh.p, sh.os):
            continue
        out.append(sh)
    return out


def plan(*, phi: float, module_params: Sequence[float], L: int, M: int, U: float, cluster,
         memory_limit: float | None = None, activation_bytes: float = 0.0, tmp_bytes: float = 0.0,
         precision: str = "mixed", dp: tuple[int, int] | None = None, grad_rule: bool = True,
         placement_aware: bool = True) -> list[AmspCost]:
    """AMSP's integer program (§V-B), solved exactly by enumerating every feasible sharding:
    the shardings whose ``D_modelstate + activation_bytes + tmp_bytes`` fits
    ``memory_limit`` (default: ``cluster.device_memory``), sorted by ``T_comm`` (ties: less
    memory first). Empty if nothing fits.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("a800", physics=None, nodes=4)
    >>> best = plan(phi=1e9, module_params=[1e9 / 32], L=32, M=4, U=5e8, cluster=c)[0]
    >>> str(best.sharding)                 # 16 GB of states fit in 80 GB: no sharding at all
    'P 1x1, G 1x1, OS 1x1'
    """
    limit = cluster.device_memory if memory_limit is None else memory_limit
    out = []
    for sh in feasible_shardings(cluster.devices_per_node, cluster.nodes, dp=dp, grad_rule=grad_rule):
        mem = model_state_memory(phi, sh, precision)
        if mem + activation_bytes + tmp_bytes > limit:
            continue
        out.append(evaluate(sh, phi=phi, module_params=module_params, L=L, M=M, U=U, cluster=cluster,
                            precision=precision, dp=dp, placement_aware=placement_aware))
    return sorted(out, key=lambda r: (r.time, r.memory))
