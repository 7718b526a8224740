"""AxoNN's 4D communication model (Singh et al., "A 4D Hybrid Algorithm to Scale Parallel
Training to Thousands of GPUs") as functions, and its configuration ranking.

A fully connected layer ``O = I·W`` with ``I ∈ R^{m×k}``, ``W ∈ R^{k×n}`` runs on a
``Gx × Gy × Gz`` tensor-parallel grid, replicated ``Gdata`` times (Algorithm 1). Per layer and
iteration (§V-A, eq. 4–9; sizes in elements, times ``bytes_per_elem`` bytes):

* ``t_AG,z = (Gz−1)/β_z · kn/(GxGyGz)``          (all-gather of the z-sharded weight, line 2)
* ``t_RS,z = ((Gz−1)/Gz)/β_z · kn/(GxGy)``        (reduce-scatter of the weight gradient, line 12)
* ``t_AR,y = 2((Gy−1)/Gy)/β_y · mn/(GzGx)``      (all-reduce of the output, line 4)
* ``t_AR,x = 2((Gx−1)/Gx)/β_x · mk/(GzGy)``      (all-reduce of the input gradient, line 11)
* ``t_AR,data = 2((Gdata−1)/Gdata)/β_data · kn/(GxGyGz)``  (data-parallel gradient all-reduce)
* ``t_comm = t_AG,z + t_RS,z + t_AR,y + t_AR,x + t_AR,data``  (eq. 9)

"Transposed" layers (every other layer, §III-B) swap ``Gx ↔ Gy`` and ``β_x ↔ β_y``.

Bandwidths (§V-B, eq. 10), groups nested x (innermost), y, z, data with ``G_node`` devices per
node: ``β_i = β_intra`` if ``Π_{j≤i} G_j ≤ G_node``, else ``β_inter / min(G_node, Π_{j<i} G_j)``.
The placement-agnostic model (§V-C) uses one bandwidth for all four. :func:`mesh_bandwidths`
gets the same numbers from the general model of :mod:`fxpar.cost.comm` on a
``Mesh(data, z, y, x)``, which also covers axis sizes that do not divide the node.

Deviation: the paper's example of eq. 10 says "eight GPUs" for ``Gx=Gy=Gz=Gdata=2``, which
needs 16; the tests use 16 devices.

>>> from fxpar import Cluster
>>> from fxpar.cost.axonn import axonn_bandwidths
>>> c = Cluster.preset("perlmutter", physics=None, nodes=4)           # 4 GPUs per node
>>> [b / 1e9 for b in axonn_bandwidths((2, 2, 2, 2), c)]  # x, y intra; z, data β_inter/4
[300.0, 300.0, 25.0, 25.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "axonn_bandwidths",
    "mesh_bandwidths",
    "layer_comm_times",
    "transformer_fc_layers",
    "model_comm_time",
    "AxonnConfig",
    "enumerate_configs",
    "rank_configs",
]


def axonn_bandwidths(G: Sequence[int], cluster, *, placement_aware: bool = True) -> tuple[float, ...]:
    """``(β_x, β_y, β_z, β_data)`` from AxoNN eq. 10 (placement-aware) or one constant
    (placement-agnostic: the cluster's inter-node bandwidth when it has several nodes).

    ``β_intra``/``β_inter`` are ``cluster.intra_node_bandwidth``/``inter_node_bandwidth``.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("perlmutter", physics=None, nodes=8)
    >>> [b / 1e9 for b in axonn_bandwidths((1, 1, 8, 4), c)]   # z alone crosses: full β_inter
    [300.0, 300.0, 100.0, 25.0]
    """
    from fxpar.cost.comm import _agnostic_link, link_bandwidth

    if not placement_aware:
        return (_agnostic_link(cluster)[1],) * len(G)
    g_node = cluster.devices_per_node
    out = []
    before = 1
    for gi in G:
        if before * gi <= g_node:
            out.append(link_bandwidth(cluster, "intra"))
        else:
            out.append(link_bandwidth(cluster, "inter") / min(g_node, before))
        before *= gi
    return tuple(out)


def mesh_bandwidths(G: Sequence[int], cluster, *, placement_aware: bool = True,
                    offset: int = 0) -> tuple[float, ...]:
    """``(β_x, β_y, β_z, β_data)`` from the general ring-sharing model
    (:func:`fxpar.cost.comm.axis_bandwidth`) on ``Mesh(data, z, y, x)`` (x innermost). Agrees
    with :func:`axonn_bandwidths` when every product of inner sizes divides or is a multiple of
    the node size; size-1 axes get ``inf`` (they never communicate).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("perlmutter", physics=None, nodes=4)
    >>> [b / 1e9 for b in mesh_bandwidths((2, 2, 2, 2), c)]
    [300.0, 300.0, 25.0, 25.0]
    """
    from fxpar.cost.comm import axis_bandwidth
    from fxpar.mesh import Mesh

    gx, gy, gz, gd = G
    mesh = Mesh(cluster, {"data": gd, "z": gz, "y": gy, "x": gx}, offset=offset)
    return tuple(axis_bandwidth(mesh, a, placement_aware=placement_aware) for a in ("x", "y", "z", "data"))


def layer_comm_times(m: float, k: float, n: float, G: Sequence[int], betas: Sequence[float], *,
                     bytes_per_elem: float = 2, transposed: bool = False) -> dict[str, float]:
    """AxoNN eq. 4–9 for one ``m×k · k×n`` layer: the five terms and their sum ``"total"``.

    >>> t = layer_comm_times(4096, 1024, 1024, (2, 2, 2, 1), (1e9,) * 4, bytes_per_elem=1)
    >>> t["ag_z"] == 1 * 1024 * 1024 / 8 / 1e9, t["ar_data"]
    (True, 0.0)
    """
    gx, gy, gz, gd = G
    bx, by, bz, bd = betas
    if transposed:
        gx, gy, bx, by = gy, gx, by, bx
    e = bytes_per_elem

    def term(coef: float, size: float, beta: float) -> float:
        return 0.0 if coef == 0 else coef * size * e / beta

    ag_z = term(gz - 1, k * n / (gx * gy * gz), bz)
    rs_z = term((gz - 1) / gz, k * n / (gx * gy), bz)
    ar_y = term(2 * (gy - 1) / gy, m * n / (gz * gx), by)
    ar_x = term(2 * (gx - 1) / gx, m * k / (gz * gy), bx)
    ar_d = term(2 * (gd - 1) / gd, k * n / (gx * gy * gz), bd)
    return {"ag_z": ag_z, "rs_z": rs_z, "ar_y": ar_y, "ar_x": ar_x, "ar_data": ar_d,
            "total": ag_z + rs_z + ar_y + ar_x + ar_d}


def transformer_fc_layers(n_layers: int, h: int, ffn: int | None = None) -> list[tuple[int, int, bool]]:
    """``(k, n, transposed)`` of the FC layers of a GPT, in order: per block QKV ``h→3h``,
    projection ``h→h``, MLP ``h→ffn`` and ``ffn→h`` (``ffn = 4h``), every other one transposed
    (AxoNN §III-B "Parallelizing an entire network").

    >>> transformer_fc_layers(1, 8)
    [(8, 24, False), (8, 8, True), (8, 32, False), (32, 8, True)]
    """
    ffn = 4 * h if ffn is None else ffn
    out = []
    for _ in range(n_layers):
        for k, n in ((h, 3 * h), (h, h), (h, ffn), (ffn, h)):
            out.append((k, n, len(out) % 2 == 1))
    return out


def model_comm_time(G: Sequence[int], cluster, *, n_layers: int, h: int, tokens: int,
                    ffn: int | None = None, bytes_per_elem: float = 2, placement_aware: bool = True,
                    bandwidths: Callable | None = None) -> float:
    """Eq. 9 summed over every FC layer of a GPT (§V-A, last paragraph), with ``m`` the tokens
    of one data-parallel replica (``tokens / Gdata``) and β from eq. 10 (or ``bandwidths``,
    e.g. :func:`mesh_bandwidths`).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("perlmutter", physics=None, nodes=4)
    >>> for G in [(4, 1, 1, 4), (1, 1, 4, 4)]:     # the same 4-way split inside vs across nodes
    ...     print(G, round(model_comm_time(G, c, n_layers=1, h=1024, tokens=8192) * 1e6), "us")
    (4, 1, 1, 4) 461 us
    (1, 1, 4, 4) 503 us
    """
    fn = bandwidths or axonn_bandwidths
    betas = fn(G, cluster, placement_aware=placement_aware)
    m = tokens / G[3]
    return sum(layer_comm_times(m, k, n, G, betas, bytes_per_elem=bytes_per_elem, transposed=t)["total"]
               for k, n, t in transformer_fc_layers(n_layers, h, ffn))


@dataclass(frozen=True)
class AxonnConfig:
    """One ``(Gx, Gy, Gz, Gdata)`` with its predicted communication time per iteration."""

    Gx: int
    Gy: int
    Gz: int
    Gdata: int
    time: float

    @property
    def G(self) -> tuple[int, int, int, int]:
        return (self.Gx, self.Gy, self.Gz, self.Gdata)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_configs(num_gpus: int) -> list[tuple[int, int, int, int]]:
    """Every ``(Gx, Gy, Gz, Gdata)`` of positive ints with product ``num_gpus``.

    >>> len(enumerate_configs(16))      # C(4+3, 3) for 2^4
    35
    """
    out = []
    for gx in _divisors(num_gpus):
        for gy in _divisors(num_gpus // gx):
            for gz in _divisors(num_gpus // (gx * gy)):
                out.append((gx, gy, gz, num_gpus // (gx * gy * gz)))
    return out


def rank_configs(num_gpus: int, cluster, *, n_layers: int, h: int, tokens: int, batch: int | None = None,
                 ffn: int | None = None, bytes_per_elem: float = 2, placement_aware: bool = True,
                 bandwidths: Callable | None = None,
                 feasible: Callable[[tuple[int, int, int, int]], bool] | None = None) -> list[AxonnConfig]:
    """AxoNN §V: enumerate ``Gx·Gy·Gz·Gdata = num_gpus`` and rank by predicted communication
    time (eq. 9 over all layers), fastest first. ``batch`` (sequences) drops configs whose
    ``Gdata`` does not divide it; ``feasible`` drops others (e.g. by memory); ties keep
    enumeration order.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("perlmutter", physics=None, nodes=8)
    >>> best = rank_configs(32, c, n_layers=32, h=7168, tokens=32 * 2048, batch=32)[0]
    >>> best.Gx * best.Gy <= c.devices_per_node
    True
    """
    out = []
    for G in enumerate_configs(num_gpus):
        if batch is not None and batch % G[3]:
            continue
        if feasible is not None and not feasible(G):
            continue
        t = model_comm_time(G, cluster, n_layers=n_layers, h=h, tokens=tokens, ffn=ffn,
                            bytes_per_elem=bytes_per_elem, placement_aware=placement_aware,
                            bandwidths=bandwidths)
        out.append(AxonnConfig(*G, time=t))
    return sorted(out, key=lambda c: c.time)
