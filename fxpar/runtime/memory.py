"""Measured activation memory: the bytes autograd holds for backward while a program runs.

:class:`SavedBytes` is a context manager that sees every tensor autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``) and every input a recomputed region keeps
(:func:`fxpar.runtime.recompute.observe`: checkpoint holds those outside the hooks), and
counts **unique storages** (a view saved twice, or a tensor saved by two ops, is one storage)
that are still held: a saved tensor is released when autograd frees the node that saved it
(after its backward), so :meth:`SavedBytes.sample` after each forward or pipeline action gives
the live set, and :attr:`SavedBytes.peak` its maximum. Storages of ``exclude`` (parameters:
model states, not activations) and empty tensors (tokens) are not counted. This is what
:func:`fxpar.cost.memory.activation_memory` and :func:`fxpar.cost.memory.stage_peak_memory`
predict (tests/test_memory_measured.py compares them).

Caveats: inside another ``saved_tensors_hooks`` context (the runners' ``Regather``, active
during forward unless ``regather=False``) the inner hooks win and nothing is seen; tensors an
autograd ``Function`` stores on ``ctx`` directly are invisible (fxpar's own ops keep only
shapes, :mod:`fxpar.runtime.library`).

>>> import torch
>>> w = torch.randn(8, 8, requires_grad=True)
>>> x = torch.randn(4, 8, requires_grad=True)
>>> with SavedBytes(exclude=[w]) as sb:
...     y = torch.tanh(x @ w)          # mm saves x (and w: excluded); tanh saves its output
...     during = sb.sample()
...     y.sum().backward()
>>> during == sb.peak == 2 * 4 * 8 * 4, sb.sample()
(True, 0)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

__all__ = ["SavedBytes"]


def _key(t: torch.Tensor):
    s = t.untyped_storage()
    return (s.data_ptr(), str(t.device)), s.nbytes()


class SavedBytes:
    """Live bytes saved for backward, unique storages (module docstring)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {_key(t)[0] for t in exclude if t.numel()}
        self._live: dict = {}          # storage key -> (nbytes, [weakrefs of holders])
        #: the largest :meth:`sample` so far
        self.peak = 0

    def _add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type == "meta":
            return
        key, nbytes = _key(t)
        if key in self._exclude:
            return
        entry = self._live.get(key)
        if entry is None or not any(r() is not None for r in entry[1]):
            entry = self._live[key] = (nbytes, [])
        entry[1].append(weakref.ref(t))

    def _pack(self, t: torch.Tensor):
        d = t.detach()  # the object autograd holds (no reference cycle through grad_fn)
        self._add(d)
        return d

    @staticmethod
    def _unpack(d):
        return d

    def _observe(self, inputs) -> None:
        for x in inputs:
            self._add(x)

    def sample(self) -> int:
        """Bytes of the storages still held now; updates :attr:`peak`."""
        for key in [k for k, (_, refs) in self._live.items() if not any(r() is not None for r in refs)]:
            del self._live[key]
        now = sum(n for n, _ in self._live.values())
        self.peak = max(self.peak, now)
        return now

    def __enter__(self):
        from fxpar.runtime.recompute import observe

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._obs = observe(self._observe)
        self._hooks.__enter__()
        self._obs.__enter__()
        return self

    def __exit__(self, *exc):
        self._obs.__exit__(*exc)
        return self._hooks.__exit__(*exc)
