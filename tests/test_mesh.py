"""Meshes: device layout (innermost axis consecutive), groups, submeshes, node mapping."""

import pytest
import torch.distributed as dist

from fxpar import Cluster, Mesh, MeshError


@pytest.fixture
def c16():
    return Cluster.preset("dgx-a100", nodes=2)  # 8 devices per node


def test_innermost_axis_is_consecutive(c16):
    m = Mesh(c16, dp=2, z=2, y=2, x=2)
    assert m.groups("x")[:2] == ((0, 1), (2, 3))
    assert m.groups("y")[:2] == ((0, 2), (1, 3))
    assert m.groups("dp")[0] == (0, 8)
    # Every axis partitions the mesh's devices into groups of the axis size.
    for ax in m.axis_names:
        flat = sorted(d for g in m.groups(ax) for d in g)
        assert flat == list(range(16)) and all(len(g) == m.axis_size(ax) for g in m.groups(ax))


def test_coords_round_trip(c16):
    m = Mesh(c16, {"a": 4, "b": 4}, offset=0)
    for d in m.devices:
        assert m.device_at(m.coord(d)) == d
        assert d in m.group_of(d, "a") and d in m.group_of(d, "b")
    assert m.coord(6) == (1, 2)


def test_node_mapping(c16):
    m = Mesh(c16, dp=2, tp=8)
    assert m.nodes() == (0, 1)
    assert m.nodes_of_axis("tp") == 1 and m.nodes_of_axis("dp") == 2
    assert m.node_of(9) == 1


def test_submeshes(c16):
    m = Mesh(c16, pp=2, tp=8)
    s0, s1 = m.split("pp", 2)
    assert s1.devices == tuple(range(8, 16)) and s1.axis_names == ("pp", "tp")
    row = m.slice(pp=1)
    assert row.axis_names == ("tp",) and row.devices == tuple(range(8, 16))
    col = m.slice(tp=slice(0, 2))
    assert col.shape == (2, 2) and col.devices == (0, 1, 8, 9)
    assert m.reshape(a=4, b=4).groups("b")[1] == (4, 5, 6, 7)


def test_from_devices_and_hash(c16):
    m = Mesh.from_devices(c16, ("a", "b"), [[0, 2], [1, 3]])
    assert m.groups("b") == ((0, 2), (1, 3)) and hash(m) == hash(Mesh.from_devices(c16, ("a", "b"), [[0, 2], [1, 3]]))
    assert m != Mesh(c16, a=2, b=2)


@pytest.mark.parametrize("make, msg", [
    (lambda c: Mesh(c, dp=4, tp=8), "not in cluster"),
    (lambda c: Mesh(c, dp=2, dp2=0), ">= 1"),
    (lambda c: Mesh.from_devices(c, ("a",), [0, 0]), "repeat"),
    (lambda c: Mesh(c, a=2).axis_index("z"), "no axis 'z'"),
    (lambda c: Mesh(c, a=2, b=3).split("b", 2), "does not split"),
])
def test_errors(c16, make, msg):
    with pytest.raises(MeshError, match=msg):
        make(c16)


def _device_mesh_groups():
    from fxpar import Cluster, Mesh

    m = Mesh(Cluster.local(4), dp=2, tp=2)
    dm = m.to_device_mesh("cpu")
    return {ax: dist.get_process_group_ranks(dm.get_group(ax)) for ax in m.axis_names}


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_to_device_mesh_matches_groups(pools):
    m = Mesh(Cluster.local(4), dp=2, tp=2)
    for rank, groups in enumerate(pools(4).run(_device_mesh_groups)):
        for ax in m.axis_names:
            assert tuple(groups[ax]) == m.group_of(rank, ax)


def test_from_devices_drops_leading_unit_dims():
    """The cross-mesh issue's own spelling: one axis name over ``[[4, 5, 6, 7]]``."""
    import fxpar

    c = fxpar.Cluster.local(8)
    m = fxpar.Mesh.from_devices(c, ["tp"], [[4, 5, 6, 7]])
    assert m.shape == (4,) and m.devices == (4, 5, 6, 7)
    with pytest.raises(fxpar.MeshError):
        fxpar.Mesh.from_devices(c, ["tp"], [[0, 1], [2, 3]])
