"""Specs: printing, parsing, hashing, validation, and layout math against DTensor's own."""

import itertools
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from fxpar import Partial, Replicate, Shard, Spec, SpecError
from fxpar.spec import chunk_bounds


def test_short_strings_round_trip():
    cases = {"S(0)R": (Shard(0), Replicate()), "P(sum)S(1)": (Partial("sum"), Shard(1)),
             "RRR": (Replicate(),) * 3, "S(1)S(1)P(avg)": (Shard(1), Shard(1), Partial("avg"))}
    for text, placements in cases.items():
        spec = Spec.parse(text)
        assert spec.placements == placements
        assert str(spec) == text == repr(spec)
        assert Spec(placements) == spec and Spec.of(*placements) == spec


def test_frozen_and_hashable():
    a, b = Spec.parse("S(0)R"), Spec((Shard(0), Replicate()))
    assert hash(a) == hash(b) and len({a, b, Spec.parse("RS(0)")}) == 2
    with pytest.raises(Exception):
        a.placements = ()


@pytest.mark.parametrize("text", ["S(0", "Q", "S(x)", "P()"])
def test_parse_errors_name_the_text(text):
    with pytest.raises(SpecError, match=re.escape(repr(text))):
        Spec.parse(text)


def test_unknown_reduce_op_rejected():
    with pytest.raises(SpecError, match="prod"):
        Spec((Partial("prod"),))


def test_invalid_for_shape_names_spec_and_shape():
    with pytest.raises(SpecError, match=r"S\(2\)R.*\(4, 4\)"):
        Spec.parse("S(2)R").local_shape((4, 4), (2, 2), (0, 0))
    with pytest.raises(ValueError, match=r"S\(0\) has 1 placements.*2 axes.*\(4, 4\)"):
        Spec.parse("S(0)").local_shape((4, 4), (2, 2), (0, 0))


def test_chunk_bounds_matches_torch_chunk():
    for n, k in itertools.product(range(0, 12), range(1, 6)):
        pieces = torch.arange(n).chunk(k) if n else ()
        for i in range(k):
            a, b = chunk_bounds(n, k, i)
            expect = pieces[i].tolist() if i < len(pieces) else []
            assert list(range(a, b)) == expect, (n, k, i)


def test_uneven_and_nested_example():
    spec = Spec.parse("S(0)S(0)")  # dim 0 split over axis 0, then each half over axis 1
    got = [spec.global_slices((7,), (2, 2), c)[0] for c in itertools.product(range(2), range(2))]
    assert [(s.start, s.stop) for s in got] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert not spec.is_even((7,), (2, 2)) and spec.is_even((8,), (2, 2))
    assert spec.max_local_shape((7,), (2, 2)) == (2,) and spec.local_numel((7, 3), (2, 2)) == 6


placement = st.one_of(st.just(Replicate()), st.just(Partial("sum")),
                      st.integers(-2, 1).map(Shard))


@settings(max_examples=300, deadline=None)
@given(shape=st.tuples(st.integers(0, 9), st.integers(1, 7)),
       mesh_shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       data=st.data())
def test_layout_matches_dtensor_and_tiles_the_tensor(shape, mesh_shape, data):
    placements = tuple(data.draw(placement) for _ in mesh_shape)
    spec = Spec(placements)
    covered = torch.zeros(shape, dtype=torch.int64)
    for coord in itertools.product(*(range(s) for s in mesh_shape)):
        # DTensor normalizes negative dims when a DTensor is built; its helper expects that.
        norm = spec.normalized(len(shape)).placements
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), norm)
        sl = spec.global_slices(shape, mesh_shape, coord)
        assert spec.local_shape(shape, mesh_shape, coord) == tuple(local)
        # DTensor's offsets of an empty shard are arbitrary; compare where there is data.
        if math.prod(local):
            assert tuple(s.start for s in sl) == tuple(offset)
        # Devices that differ only on non-shard axes hold the same region: count each once.
        if all(c == 0 for c, p in zip(coord, placements) if not isinstance(p, Shard)):
            covered[sl] += 1
    assert bool((covered == 1).all()), f"{spec} on {mesh_shape} does not tile {shape}"


def test_strided_shard_layout_and_errors():
    """``S(d,f)`` (#31): parses and prints, holds chunk i of each of the f groups (a box per
    group), refuses to pose as one box, and refuses layouts it cannot be."""
    import torch

    from fxpar.errors import SpecError
    from fxpar.spec import Spec, Strided

    s = Spec.parse("RS(1,3)")
    assert str(s) == "RS(1,3)" and s.placements[1] == Strided(1, split_factor=3) and s.is_strided
    assert Spec.parse(str(s)) == s and hash(Spec.parse(str(s))) == hash(s)
    full = torch.arange(2 * 12).view(2, 12)
    for c in range(2):
        local = s.local_of(full, (2, 2), (0, c))
        want = torch.cat([full[:, g * 4 + 2 * c: g * 4 + 2 * c + 2] for g in range(3)], dim=1)
        assert torch.equal(local, want) and s.local_shape((2, 12), (2, 2), (0, c)) == (2, 6)
        d, boxes = s.boxes((2, 12), (2, 2), (0, c))
        assert d == 1 and torch.equal(torch.cat([full[b] for b in boxes], dim=1), want)
    with pytest.raises(SpecError, match="not one box"):
        s.global_slices((2, 12), (2, 2), (0, 0))
    with pytest.raises(SpecError, match="divides the dim"):
        Spec.parse("S(1,3)").check((2, 12), (8,))            # 12 is not 3 groups of 8 chunks
    with pytest.raises(SpecError, match="no other axis"):
        Spec.parse("S(1)S(1,3)").check((2, 12), (2, 2))
    with pytest.raises(SpecError, match="split factor < 2"):
        Spec.parse("S(1,1)")
