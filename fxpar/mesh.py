"""Logical device meshes over a cluster.

A :class:`Mesh` is an N-d grid of cluster device ids with named axes. Device ids are laid out
row-major, so the **innermost (last) axis has consecutive ids**: on ``Mesh(c, dp=2, tp=4)`` the
``tp`` groups are ``(0,1,2,3)`` and ``(4,5,6,7)`` and the ``dp`` groups ``(0,4)``, ``(1,5)``, ...
That order decides placement (AxoNN §V-B): put the axis that talks most innermost so its
groups stay inside a node.

>>> from fxpar import Cluster, Mesh
>>> m = Mesh(Cluster.preset("perlmutter", nodes=2), dp=2, tp=4)
>>> m
Mesh(dp=2, tp=4 on devices 0..7)
>>> m.groups("dp")
((0, 4), (1, 5), (2, 6), (3, 7))
>>> m.coord(6), m.nodes_of_axis("tp"), m.nodes_of_axis("dp")
((1, 2), 1, 2)
>>> m.slice(dp=1)
Mesh(tp=4 on devices 4..7)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fxpar.cluster import Cluster
from fxpar.errors import MeshError

__all__ = ["Mesh"]


@dataclass(frozen=True, init=False)
class Mesh:
    """A named grid of device ids of ``cluster``; frozen and hashable.

    ``Mesh(cluster, dp=2, tp=4)`` or ``Mesh(cluster, {"dp": 2, "tp": 4})`` covers devices
    ``offset .. offset + size - 1``; ``Mesh.from_devices`` takes any nested list of ids.
    """

    cluster: Cluster
    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    devices: tuple[int, ...]  # flat, row-major (last axis innermost)

    def __init__(self, cluster: Cluster, axes: Mapping[str, int] | Sequence[tuple[str, int]] | None = None,
                 *, offset: int = 0, **kw_axes: int) -> None:
        items = list(dict(axes).items()) if axes is not None else []
        items += list(kw_axes.items())
        if not items:
            raise MeshError("a mesh needs at least one axis, e.g. Mesh(cluster, dp=2)")
        names = tuple(n for n, _ in items)
        shape = tuple(int(s) for _, s in items)
        size = int(np.prod(shape))
        self._init(cluster, names, shape, tuple(range(offset, offset + size)))

    def _init(self, cluster, names, shape, devices) -> None:
        if len(set(names)) != len(names):
            raise MeshError(f"duplicate mesh axis names {names}")
        if any(s < 1 for s in shape):
            raise MeshError(f"mesh axis sizes must be >= 1, got {dict(zip(names, shape))}")
        if int(np.prod(shape)) != len(devices):
            raise MeshError(f"mesh shape {shape} needs {int(np.prod(shape))} devices, got {len(devices)}")
        if len(set(devices)) != len(devices):
            raise MeshError(f"mesh devices repeat: {devices}")
        bad = [d for d in devices if not 0 <= d < cluster.num_devices]
        if bad:
            raise MeshError(f"devices {bad} are not in cluster {cluster.name} "
                            f"({cluster.num_devices} devices)")
        object.__setattr__(self, "cluster", cluster)
        object.__setattr__(self, "axis_names", tuple(names))
        object.__setattr__(self, "shape", tuple(shape))
        object.__setattr__(self, "devices", tuple(int(d) for d in devices))

    @classmethod
    def from_devices(cls, cluster: Cluster, axis_names: Sequence[str], devices) -> Mesh:
        """A mesh over an explicit (nested) array of device ids, e.g. ``[[0, 2], [1, 3]]``;
        leading size-1 dimensions beyond the axis names are dropped (``["tp"]`` over
        ``[[4, 5, 6, 7]]`` is a 1-d mesh of 4)."""
        arr = np.asarray(devices, dtype=np.int64)
        k = arr.ndim - len(axis_names)
        if k > 0 and all(s == 1 for s in arr.shape[:k]):
            arr = arr.reshape(arr.shape[k:])
        if arr.ndim != len(axis_names):
            raise MeshError(f"{len(axis_names)} axis names {tuple(axis_names)} for a {arr.ndim}-d device array")
        m = object.__new__(cls)
        m._init(cluster, tuple(axis_names), arr.shape, tuple(arr.reshape(-1).tolist()))
        return m

    @classmethod
    def all(cls, cluster: Cluster, name: str = "dp") -> Mesh:
        """A 1-d mesh over every device of the cluster."""
        return cls(cluster, {name: cluster.num_devices})

    # -- basic queries ------------------------------------------------------------------
    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        lo, hi = min(self.devices), max(self.devices)
        if list(self.devices) == list(range(lo, hi + 1)):
            where = f"devices {lo}..{hi}"
        else:
            where = f"devices {list(self.devices)}"
        return f"Mesh({axes} on {where})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def array(self) -> np.ndarray:
        """Device ids as an ``ndim``-d numpy array (a fresh copy)."""
        return np.asarray(self.devices, dtype=np.int64).reshape(self.shape)

    def axis_index(self, axis: int | str) -> int:
        """Index of a mesh axis given by name or index."""
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise MeshError(f"mesh {self!r} has no axis {axis!r} (axes: {self.axis_names})")
            return self.axis_names.index(axis)
        if not -self.ndim <= axis < self.ndim:
            raise MeshError(f"mesh {self!r} has no axis {axis}")
        return axis % self.ndim

    def axis_size(self, axis: int | str) -> int:
        return self.shape[self.axis_index(axis)]

    def coord(self, device: int) -> tuple[int, ...]:
        """Mesh coordinate of a device id."""
        try:
            flat = self.devices.index(device)
        except ValueError:
            raise MeshError(f"device {device} is not in {self!r}") from None
        return tuple(int(i) for i in np.unravel_index(flat, self.shape))

    def device_at(self, coord: Sequence[int]) -> int:
        return self.devices[int(np.ravel_multi_index(tuple(coord), self.shape))]

    def coords(self):
        """All mesh coordinates in device order."""
        return itertools.product(*(range(s) for s in self.shape))

    # -- groups along axes --------------------------------------------------------------
    def groups(self, axis: int | str) -> tuple[tuple[int, ...], ...]:
        """All device groups along one axis (the groups a collective on that axis uses), in
        the order of the remaining coordinates."""
        a = self.axis_index(axis)
        arr = np.moveaxis(self.array, a, -1).reshape(-1, self.shape[a])
        return tuple(tuple(int(d) for d in row) for row in arr)

    def group_of(self, device: int, axis: int | str) -> tuple[int, ...]:
        """The group along ``axis`` that contains ``device``."""
        a = self.axis_index(axis)
        c = list(self.coord(device))
        out = []
        for i in range(self.shape[a]):
            c[a] = i
            out.append(self.device_at(c))
        return tuple(out)

    # -- cluster mapping ----------------------------------------------------------------
    def node_of(self, device: int) -> int:
        return self.cluster.node_of(device)

    def nodes(self) -> tuple[int, ...]:
        """Nodes this mesh touches, ascending."""
        return tuple(sorted({self.cluster.node_of(d) for d in self.devices}))

    def nodes_of_axis(self, axis: int | str) -> int:
        """How many nodes one group of ``axis`` spans (the most over all its groups)."""
        return max(len({self.cluster.node_of(d) for d in g}) for g in self.groups(axis))

    # -- submeshes ----------------------------------------------------------------------
    def slice(self, **index: int | slice) -> Mesh:
        """Submesh: an int drops the axis, a slice keeps it. ``mesh.slice(dp=0)``,
        ``mesh.slice(tp=slice(0, 2))``."""
        arr = self.array
        names = list(self.axis_names)
        sel: list = [slice(None)] * self.ndim
        for name, idx in index.items():
            a = self.axis_index(name)
            if isinstance(idx, int) and not -self.shape[a] <= idx < self.shape[a]:
                raise MeshError(f"index {idx} out of range for axis {name!r} of size {self.shape[a]}")
            sel[a] = idx
        sub = arr[tuple(sel)]
        keep = [n for n, s in zip(names, sel) if not isinstance(s, int)]
        if not keep:
            keep, sub = ["_"], sub.reshape(1)
        if sub.size == 0:
            raise MeshError(f"empty submesh for {index}")
        return Mesh.from_devices(self.cluster, keep, sub)

    def split(self, axis: int | str, parts: int) -> tuple[Mesh, ...]:
        """Cut one axis into ``parts`` equal contiguous submeshes (e.g. pipeline stages)."""
        a = self.axis_index(axis)
        n = self.shape[a]
        if n % parts:
            raise MeshError(f"axis {self.axis_names[a]!r} of size {n} does not split into {parts} parts")
        step = n // parts
        name = self.axis_names[a]
        return tuple(self.slice(**{name: slice(i * step, (i + 1) * step)}) for i in range(parts))

    def reshape(self, axes: Mapping[str, int] | None = None, **kw_axes: int) -> Mesh:
        """The same devices (same order) under a new axis layout."""
        items = {**(dict(axes) if axes else {}), **kw_axes}
        if int(np.prod(list(items.values()))) != self.size:
            raise MeshError(f"cannot reshape {self!r} to {items}")
        return Mesh.from_devices(self.cluster, tuple(items), self.array.reshape(tuple(items.values())))

    # -- run time -----------------------------------------------------------------------
    def to_device_mesh(self, device_type: str | None = None):
        """The ``torch.distributed.DeviceMesh`` of this mesh (device id = global rank).

        Collective: every rank of the default group must call it (sub-groups are created).
        """
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return DeviceMesh(device_type, torch.tensor(self.array), mesh_dim_names=self.axis_names)
