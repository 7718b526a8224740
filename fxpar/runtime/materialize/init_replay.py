"""The init replay: this rank's shards from a meta model's own initializers, without building
full tensors (``local_state(..., source="init")``, :func:`from_init`).

How it works. The initializers run once on the meta tensors (cheap: no storage), in the order
a real construction runs them (:func:`init_calls`): ``reset_parameters()`` (and
``_reset_parameters()``, which ``nn.MultiheadAttention`` uses) of every module, children before
parents; then, when a module or an ancestor defines ``_init_weights`` (Hugging Face's
``PreTrainedModel`` and nanoGPT-style models), ``owner._init_weights(module)`` for every
module, children first, as ``PreTrainedModel.initialize_weights`` does. A
``TorchDispatchMode`` records every in-place op that writes a tracked meta tensor (or a view
of it that is a box: select / slice / narrow / transpose), and the meta no-op shortcuts of
``torch.nn.init`` (``trunc_normal_``, ``orthogonal_``, ``dirac_``, ``sparse_``) are
intercepted for the duration. Then, per tensor, the recorded sequence from its last
whole-tensor overwrite on is **replayed on a tensor of the local shape**: random fills
(``normal_``, ``uniform_``, ``trunc_normal_``, ``bernoulli_``, ...) draw from a
``torch.Generator`` seeded by ``(seed, fqn, shard key)`` — the shard key being the
coordinates on the mesh axes where the spec is ``Shard`` — and deterministic ops (``fill_``,
``zero_``, ``copy_`` from a real tensor, pointwise ``mul_`` / ``add_`` / ``clamp_`` /
``erfinv_`` ... with scalars or real tensors) are applied to the local part of their region.
Bounds computed from the shape (kaiming's ``1/sqrt(fan_in)``) come from the full meta
shape, so they are right. Hugging Face's flags, init-function tables and rotary buffers are
handled by :mod:`~fxpar.runtime.materialize.hf`.

Honest semantics: replicas of one shard get bitwise identical values on every rank and
different shards get independent draws, so the global tensor has the initializer's
distribution — but it depends on the layout (and the device: CPU and CUDA generators
differ); it is *statistically*, not bitwise, the single-device initialization. An all-``R``
spec gives the same tensor on every rank. On a ``Partial("sum")`` axis coordinate 0 holds
the value and the others zeros (as :func:`~fxpar.runtime.redistribute.distribute`).

Fallbacks and errors. A tensor whose initializer is not replayable elementwise (e.g.
``orthogonal_``, ``eye_``, an op reading another meta tensor, a write through a non-box
view, or writes that cover only part of it) is materialized whole on CPU — only that tensor,
re-running the initializer calls that touched it with the global CPU RNG seeded from
``(seed, fqn)`` so every rank builds the same full tensor — then sliced; a ``UserWarning``
names the fqn and the op. A tensor no initializer writes (a buffer computed in
``__init__``, whose value a meta tensor has lost) is taken from the model if real;
otherwise, for a Hugging Face rotary embedding (``inv_freq`` / ``original_inv_freq``) it is
recomputed from the module's config (:func:`~fxpar.runtime.materialize.hf.rope_value`;
transformers 5's ``_init_weights`` already does this through ``copy_``, which is recorded);
anything else raises :class:`~fxpar.errors.MaterializeError` naming the buffer rather than
returning garbage. Known gap: an initializer that skips meta tensors by itself (``if
t.is_meta: return`` in user code) cannot be seen; it would leave the earlier initializer's
values.

>>> import torch
>>> from torch import nn
>>> from fxpar.runtime.materialize.sources import model_entries
>>> from fxpar.spec import Spec
>>> with torch.device("meta"):
...     lin = nn.Linear(6, 4)
>>> entries, _ = model_entries(lin)
>>> want = {"weight": ("weight", Spec.parse("S(0)R"), (4, 6))}
>>> w = {c: from_init(lin, entries, want, (2, 2), c)["weight"] for c in [(0, 0), (0, 1), (1, 0)]}
>>> w[(0, 0)].shape, torch.equal(w[(0, 0)], w[(0, 1)]), torch.equal(w[(0, 0)], w[(1, 0)])
(torch.Size([2, 6]), True, False)
>>> bool((w[(1, 0)].abs() <= 6 ** -0.5).all())       # kaiming bound from the full fan_in
True
"""

from __future__ import annotations

import inspect
import math
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.errors import MaterializeError
from fxpar.runtime.materialize.hf import HFFlags, init_tables, rope_value
from fxpar.runtime.materialize.sources import Entry, set_owned
from fxpar.runtime.redistribute import distribute
from fxpar.runtime.rng import seed_from, shard_key
from fxpar.spec import Partial, Spec

__all__ = ["from_init", "init_calls"]


# ---------------------------------------------------------------------------------------------
# Regions: which part of a base tensor a view covers (a box, possibly strided / permuted)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Region:
    """Per base dim ``(start, step, count, view_dim or None)``; ``view_shape`` of the view."""

    dims: tuple[tuple[int, int, int, int | None], ...]
    view_shape: tuple[int, ...]
    full: bool


def _contig_strides(shape: Sequence[int]) -> list[int]:
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= max(int(s), 1)
    return st[::-1]


def _region(view: torch.Tensor, base_shape: tuple[int, ...], base_stride: tuple[int, ...],
            base_offset: int) -> _Region | None:
    """The box of the base that ``view`` covers, or None if it is not a box (e.g. a diagonal)."""
    vshape, vstride, voff = tuple(view.shape), tuple(view.stride()), view.storage_offset()
    n = len(base_shape)
    if (vshape, vstride, voff) == (base_shape, base_stride, base_offset):
        return _Region(tuple((0, 1, s, d) for d, s in enumerate(base_shape)), vshape, True)
    if list(base_stride) != _contig_strides(base_shape) and math.prod(base_shape) > 1:
        return None
    B = _contig_strides(base_shape)
    off = voff - base_offset
    numel = math.prod(base_shape)
    if off < 0 or (numel and off >= numel):
        return None
    start, rem = [0] * n, off
    for d in range(n):
        start[d], rem = divmod(rem, B[d])
        if start[d] >= max(base_shape[d], 1):
            return None
    if rem:
        return None
    mapped: dict[int, tuple[int, int]] = {}        # base dim -> (step, view dim)
    for j, (sz, st) in enumerate(zip(vshape, vstride)):
        if sz == 1:
            continue
        cand = [d for d in range(n) if base_shape[d] > 1 and B[d] <= st < B[d] * base_shape[d]]
        if len(cand) != 1:
            return None
        d = cand[0]
        step, r = divmod(st, B[d])
        if r or d in mapped or start[d] + step * (sz - 1) >= base_shape[d]:
            return None
        mapped[d] = (step, j)
    dims = []
    for d in range(n):
        if d in mapped:
            step, j = mapped[d]
            dims.append((start[d], step, vshape[j], j))
        else:
            dims.append((start[d], 1, 1, None))
    full = all(s == 0 and (c == base_shape[d]) and (st == 1 or c <= 1)
               for d, (s, st, c, _) in enumerate(dims))
    return _Region(tuple(dims), vshape, full)


def _local_view(local: torch.Tensor, gslices: Sequence[slice], region: _Region):
    """``(view of local, index into the view's coordinates)`` for the part of ``region`` held
    locally (``gslices`` = the local tensor's global slices), or None when they do not meet."""
    index: list = []
    view_index: list = [slice(None)] * len(region.view_shape)
    order: list[tuple[int, int]] = []              # (view dim, position in the indexed local)
    pos = 0
    for d, (s, step, cnt, j) in enumerate(region.dims):
        g0, g1 = gslices[d].start, gslices[d].stop
        lo = max(0, -(-(g0 - s) // step))
        hi = min(cnt, -(-(g1 - s) // step))
        if hi <= lo:
            return None
        if j is None:
            index.append(s - g0)
        else:
            index.append(slice(s + step * lo - g0, s + step * (hi - 1) - g0 + 1, step))
            view_index[j] = slice(lo, hi)
            order.append((j, pos))
            pos += 1
    sub = local[tuple(index)]
    sub = sub.permute([p for _, p in sorted(order)]) if order else sub
    for j, sz in enumerate(region.view_shape):
        if sz == 1 and all(j != jj for jj, _ in order):
            sub = sub.unsqueeze(j)
    return sub, tuple(view_index)



# ---------------------------------------------------------------------------------------------
# Recording the initializers on meta tensors
# ---------------------------------------------------------------------------------------------
class _Self:
    def __repr__(self) -> str:
        return "<self>"


_SELF = _Self()
_aten = torch.ops.aten
_OVERWRITE = {_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default, _aten.copy_.default}
_ELEMENTWISE = {_aten.abs_.default, _aten.masked_fill_.Scalar, _aten.masked_fill_.Tensor}


@dataclass
class _Op:
    fn: Callable                       # aten op or an original torch.nn.init function
    args: tuple
    kwargs: dict
    region: _Region
    overwrite: bool                    # the result does not depend on the old content
    random: bool                       # gets ``generator=`` on replay
    call: int                          # index of the init call that ran it
    reals: tuple = ()                  # (tensor, version) of the real tensors it reads
    bad: str | None = None             # why it cannot be replayed (then only a marker)


@dataclass
class _Track:
    entry: Entry
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    ops: list[_Op] = field(default_factory=list)
    calls: set[int] = field(default_factory=set)


def _skey(t: torch.Tensor):
    return t.untyped_storage()._cdata


class _Recorder(TorchDispatchMode):
    def __init__(self, tracks: dict[Any, _Track]) -> None:
        super().__init__()
        self.tracks = tracks
        self.call = -1

    def track_of(self, t) -> _Track | None:
        if isinstance(t, torch.Tensor) and t.is_meta:
            return self.tracks.get(_skey(t))
        return None

    def add(self, tr: _Track, op: _Op) -> None:
        tr.ops.append(op)
        tr.calls.add(self.call)

    def marker(self, t: torch.Tensor, why: str) -> None:
        tr = self.track_of(t)
        if tr is not None:
            self.add(tr, _Op(None, (), {}, None, False, False, self.call, bad=why))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        schema = func._schema
        written = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if (i < len(args) and not a.kwarg_only) else kwargs.get(a.name)
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                tr = self.track_of(t)
                if tr is not None:
                    written.append((i, a.name, t, tr))
        if written:
            self._note(func, args, kwargs, written)
        return func(*args, **kwargs)

    def _note(self, func, args, kwargs, written) -> None:
        name = str(func)
        if len(written) > 1 or written[0][0] != 0:
            for _, _, t, tr in written:
                self.add(tr, _Op(None, (), {}, None, False, False, self.call,
                                 bad=f"{name} (writes it as an output argument)"))
            return
        _, _, t, tr = written[0]
        if t.numel() == 0:
            return
        tags = func.tags
        random = torch.Tag.nondeterministic_seeded in tags and any(
            a.name == "generator" for a in func._schema.arguments)
        pointwise = torch.Tag.pointwise in tags or func in _ELEMENTWISE
        overwrite = random or func in _OVERWRITE
        bad = None
        if not (random or pointwise or overwrite):
            bad = name
        region = _region(t, tr.shape, tr.stride, tr.offset)
        if region is None and bad is None:
            bad = f"{name} through a view that is not a box of the tensor"
        reals = []
        new_args = [_SELF]
        rest = list(args[1:]) + list(kwargs.values())
        for v in rest:
            if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
                bad = bad or f"{name} with a list of tensors"
            elif isinstance(v, torch.Tensor):
                if v.is_meta:
                    bad = bad or f"{name} reading another meta tensor"
                else:
                    reals.append((v, v._version))
        if bad is not None:
            self.add(tr, _Op(None, (), {}, None, False, False, self.call, bad=bad))
            return
        new_args += list(args[1:])
        kw = {k: v for k, v in kwargs.items() if k != "generator"}
        if random:
            gi = [i for i, a in enumerate(func._schema.arguments) if a.name == "generator"][0]
            if gi < len(new_args):
                new_args = new_args[:gi]
        self.add(tr, _Op(func, tuple(new_args), kw, region, overwrite, random, self.call, tuple(reals)))



_META_SKIPPING = ("orthogonal_", "dirac_", "sparse_")
_PATCH_MODULES = ("torch.nn.init", "torch.nn.modules.activation", "torch.nn.modules.transformer",
                  "torch.nn.modules.linear", "torch.nn.modules.loss", "torch.nn.modules.batchnorm",
                  "torch.nn.modules.conv", "torch.nn.modules.normalization", "torch.nn.modules.rnn",
                  "torch.nn.modules.sparse")


class _InitPatches:
    """Intercept the ``torch.nn.init`` functions that return early on meta tensors: record
    ``trunc_normal_`` (elementwise, replayable) and mark ``orthogonal_``/``dirac_``/``sparse_``
    (not replayable) on tracked tensors. Restores everything on exit."""

    def __init__(self, rec: _Recorder) -> None:
        self.rec = rec
        self.saved: list[tuple[Any, str, Any, bool]] = []

    def _set(self, holder, key, value, is_dict=False):
        old = holder[key] if is_dict else getattr(holder, key)
        self.saved.append((holder, key, old, is_dict))
        if is_dict:
            holder[key] = value
        else:
            setattr(holder, key, value)

    def __enter__(self):
        init = torch.nn.init
        rec = self.rec
        orig_tn = init._no_grad_trunc_normal_

        def trunc(tensor, mean, std, a, b, generator=None):
            tr = rec.track_of(tensor)
            if tr is None:
                return orig_tn(tensor, mean, std, a, b, generator=generator)
            if tensor.numel():
                region = _region(tensor, tr.shape, tr.stride, tr.offset)
                if region is None:
                    rec.marker(tensor, "trunc_normal_ through a view that is not a box of the tensor")
                else:
                    rec.add(tr, _Op(orig_tn, (_SELF, mean, std, a, b), {}, region, True, True, rec.call))
            return tensor

        self._set(init, "_no_grad_trunc_normal_", trunc)
        for fname in _META_SKIPPING:
            orig = getattr(init, fname)

            def wrapper(tensor, *a, _orig=orig, _name=fname, **k):
                if rec.track_of(tensor) is not None:
                    rec.marker(tensor, _name)
                    return tensor
                return _orig(tensor, *a, **k)

            for mname in _PATCH_MODULES:
                mod = sys.modules.get(mname)
                if mod is not None and getattr(mod, fname, None) is orig:
                    self._set(mod, fname, wrapper)
            for table in init_tables():   # transformers' own references to them
                if table.get(fname) is orig:
                    self._set(table, fname, wrapper, is_dict=True)
        return self

    def __exit__(self, *exc):
        for holder, key, old, is_dict in reversed(self.saved):
            if is_dict:
                holder[key] = old
            else:
                setattr(holder, key, old)
        self.saved.clear()


def _no_arg_callable(fn) -> bool:
    if not callable(fn):
        return False
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in sig.parameters.values())


def _takes_module(fn, mod) -> bool:
    """``fn(module)`` is a valid call (the ``_init_weights(self, module)`` convention)."""
    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(mod)
    except (TypeError, ValueError):
        return False
    return True


def init_calls(model: nn.Module) -> list[tuple[str, Callable[[], Any], nn.Module]]:
    """The initializer calls in construction order: ``reset_parameters`` post-order, then
    ``owner._init_weights(module)`` post-order with the nearest owner defining it."""
    resets: list = []
    hf: list = []
    seen: set[int] = set()

    def visit(mod: nn.Module, owner):
        if id(mod) in seen:
            return
        seen.add(id(mod))
        own = mod if _takes_module(getattr(mod, "_init_weights", None), mod) else owner
        for child in mod.children():
            visit(child, own)
        for meth in ("reset_parameters", "_reset_parameters"):
            fn = getattr(mod, meth, None)
            if _no_arg_callable(fn):
                resets.append((f"{type(mod).__name__}.{meth}", fn, mod))
        if own is not None:
            hf.append((f"{type(own).__name__}._init_weights({type(mod).__name__})",
                       (lambda o=own, m=mod: o._init_weights(m)), mod))

    visit(model, None)
    return resets + hf



def _record(model: nn.Module, entries: Mapping[str, Entry], seed: int):
    tracks: dict[Any, _Track] = {}
    for e in entries.values():
        t = e.tensor
        if t.is_meta:
            tracks[_skey(t)] = _Track(e, tuple(t.shape), tuple(t.stride()), t.storage_offset())
    calls = init_calls(model)
    errors: dict[int, str] = {}
    if not tracks:
        return {}, calls
    rec = _Recorder(tracks)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), HFFlags(model):
        torch.default_generator.manual_seed(seed_from("fxpar.materialize.record", seed))
        with _InitPatches(rec), rec:
            for k, (label, fn, mod) in enumerate(calls):
                rec.call = k
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - reported per tensor below
                    errors[k] = f"{label} failed on meta tensors: {type(exc).__name__}: {exc}"
                    for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
                        rec.marker(t, errors[k])
    return {tr.entry.name: tr for tr in tracks.values()}, calls



# ---------------------------------------------------------------------------------------------
# Building one local tensor
# ---------------------------------------------------------------------------------------------
def _plan(tr: _Track) -> tuple[list[_Op] | None, str | None]:
    """``(ops to replay, None)`` or ``(None, why it must be built whole)``; ``(None, None)``
    when nothing writes the tensor."""
    ops = tr.ops
    last = max((i for i, o in enumerate(ops) if o.bad is None and o.overwrite and o.region.full), default=None)
    if last is None:
        if not ops:
            return None, None
        bad = next((o.bad for o in ops if o.bad), None)
        return None, bad or "writes that cover only part of it"
    tail = ops[last:]
    bad = next((o.bad for o in tail if o.bad), None)
    if bad:
        return None, bad
    for o in tail:
        if any(t._version != v for t, v in o.reals):
            return None, f"{o.fn} reading a tensor the initializer changed afterwards"
    return tail, None


def _replay(tr: _Track, ops: list[_Op], gslices, local: torch.Tensor, device, gen) -> torch.Tensor:
    """Run the replayable init ``ops`` on ``local``, the global box ``gslices`` (written in place)."""
    if local.numel() == 0:
        return local
    for op in ops:
        got = _local_view(local, gslices, op.region)
        if got is None:
            continue
        sub, vidx = got

        def fix(v):
            if v is _SELF:
                return sub
            if isinstance(v, torch.Tensor):
                return v.expand(op.region.view_shape)[vidx].to(device)
            return v

        args = [fix(a) for a in op.args]
        kwargs = {k: fix(v) for k, v in op.kwargs.items()}
        if op.random:
            kwargs["generator"] = gen
        op.fn(*args, **kwargs)
    return local


def _whole(model, tr: _Track, calls, seed: int, why: str) -> torch.Tensor:
    """Materialize one tensor whole on CPU by re-running the init calls that touched it."""
    e = tr.entry
    meta = e.tensor
    full = torch.empty(meta.shape, dtype=meta.dtype, device="cpu")
    if full.is_floating_point() or full.is_complex():
        full.fill_(float("nan"))
    real = nn.Parameter(full, requires_grad=meta.requires_grad) if e.is_param else full
    set_owned(e, real)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), HFFlags(model):
            torch.default_generator.manual_seed(seed_from("fxpar.materialize.whole", seed, e.name))
            for k in sorted(tr.calls):
                label, fn, _ = calls[k]
                try:
                    fn()
                except Exception as exc:
                    raise MaterializeError(
                        f"cannot materialize {e.name!r}: its initializer ({why}) had to run on the whole "
                        f"tensor and {label} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        set_owned(e, meta)
    if (full.is_floating_point() or full.is_complex()) and torch.isnan(full).any():
        raise MaterializeError(
            f"cannot materialize {e.name!r}: its initializers ({why}) leave part of it unset")
    return full.detach()



def from_init(model: nn.Module, entries: Mapping[str, Entry],
              want: Mapping[str, tuple[str, Spec, tuple[int, ...]]], mesh_shape: Sequence[int],
              coord: Sequence[int], seed: int = 0, device=None,
              finish: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``{key: local tensor}`` for ``want`` (``{key: (canonical name, spec, global shape)}``)
    from the model's initializers (module docstring); a tensor that is not on meta is sliced
    from the model. ``finish`` post-processes each result (``local_state``'s dtype, device,
    contiguity); ``device``: where replay runs (default CPU). Tied aliases must share a spec."""
    finish = finish or (lambda t: t.detach().contiguous())
    dev = torch.device("cpu") if device is None else torch.device(device)
    by_canon: dict[str, tuple[Spec, tuple[int, ...], str]] = {}
    for key, (canon, spec, shape) in want.items():
        if canon in by_canon and by_canon[canon][0] != spec:
            raise MaterializeError(
                f"{key!r} and {by_canon[canon][2]!r} are the same (tied) tensor but have different specs "
                f"({spec} and {by_canon[canon][0]}): under source='init' they must share one layout")
        by_canon.setdefault(canon, (spec, shape, key))
    need_record = any(entries[c].tensor.is_meta for c in by_canon)
    tracks, calls = _record(model, entries, seed) if need_record else ({}, [])
    built: dict[str, torch.Tensor] = {}
    for canon, (spec, shape, key) in by_canon.items():
        e = entries[canon]
        if not e.tensor.is_meta:
            built[canon] = finish(distribute(e.tensor.detach(), spec, mesh_shape, coord))
            continue
        tr = tracks[canon]
        ops, why = _plan(tr)
        local_shape = spec.local_shape(shape, mesh_shape, coord)
        zero = any(isinstance(p, Partial) and p.reduce_op == "sum" and coord[a] != 0
                   for a, p in enumerate(spec))
        if ops is not None:
            if zero:
                local = torch.zeros(local_shape, dtype=e.tensor.dtype, device=dev)
            else:
                gen = torch.Generator(device=dev)
                gen.manual_seed(seed_from("fxpar.materialize", seed, canon, shard_key(spec, coord)))
                local = torch.empty(local_shape, dtype=e.tensor.dtype, device=dev)
                d, boxes = spec.boxes(shape, mesh_shape, coord)
                for j, box in enumerate(boxes):   # a strided piece: one box per group along d
                    c = box[d].stop - box[d].start if d is not None else 0
                    _replay(tr, ops, box, local if d is None else local.narrow(d, j * c, c), dev, gen)
            built[canon] = finish(local.to(dev))
            continue
        if why is None:      # nothing writes it: a value computed in __init__, lost on meta
            value = rope_value(e.owners, e.tensor)
            if value is None:
                kind = "parameter" if e.is_param else "buffer"
                raise MaterializeError(
                    f"cannot materialize {kind} {canon!r} from the initializers: nothing in "
                    f"reset_parameters()/_init_weights writes it (its value was computed in __init__ and "
                    f"is lost on the meta device). Give it a real value on the model (e.g. assign the "
                    f"buffer after building on meta), or load it from a state dict / checkpoint")
            built[canon] = finish(distribute(value, spec, mesh_shape, coord).to(dev))
            continue
        warnings.warn(f"fxpar: materializing {canon!r} whole (shape {shape}) and slicing it: its "
                      f"initializer is not elementwise-replayable ({why})", stacklevel=3)
        full = _whole(model, tr, calls, seed, why)
        built[canon] = finish(distribute(full, spec, mesh_shape, coord).to(dev))
        del full
    return {key: built[canon] for key, (canon, _, _) in want.items()}
