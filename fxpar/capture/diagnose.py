"""Why a capture failed: one line per frontend tried, and the static-shape check of a graph.

Contract: :func:`fxpar.capture.capture` tries its frontends under :func:`quiet_torch_logs`
(torch's log records and graph dumps of a failing frontend are held back; ``FXPAR_DEBUG=1``
shows them), reports each failure with :func:`failure_reason` (the frontend's label, the first
line of its error, and for a data-dependent failure the op and the user's source line that made
it) and, when none succeeds, raises :func:`capture_error`'s :class:`~fxpar.errors.CaptureError`
(``err.failures`` maps each label to its exception). A graph a frontend did produce is checked
last by :func:`refuse_data_dependent`: fxpar plans static shapes, so a node whose output size
or value is known only at run time is refused, naming the node and op (a value read with
``.item()`` that sets a size or a branch was specialized before, :mod:`fxpar.capture.specialize`;
one left here is used as a number in the computation). Messages are
deterministic (sets of unbacked symbols sorted), so every rank raises the same one.

Example::

    >>> import torch
    >>> from fxpar.capture import capture
    >>> class NonZero(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.nonzero()
    >>> capture(NonZero(), (torch.randn(4),))
    Traceback (most recent call last):
    ...
    fxpar.errors.CaptureError: could not capture NonZero: node nonzero (aten.nonzero.default) has a data-dependent output shape (sizes ['u0'] known only at run time); fxpar plans static shapes, ...
    >>> failure_reason("export(non-strict)", ValueError("bad input\\ndetails"), debug=False)
    'export(non-strict): ValueError: bad input'
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import traceback

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.errors import CaptureError

__all__ = ["quiet_torch_logs", "failure_reason", "capture_error", "refuse_data_dependent",
           "DATA_DEPENDENT_ERRORS"]

#: export's errors for a size known only at run time (an op such as ``combinations`` whose fake
#: kernel leaves an unbacked size export cannot bind): reported as a data-dependent shape.
DATA_DEPENDENT_ERRORS = frozenset({"GuardOnDataDependentSymNode", "PendingUnbackedSymbolNotFound",
                                   "DataDependentOutputException", "DynamicOutputShapeException"})


@contextlib.contextmanager
def quiet_torch_logs(debug: bool):
    """Hold back torch's own log output while a frontend is tried: export logs ERROR-level
    tracebacks and graph dumps for a model it then fails on, and fxpar's :class:`CaptureError`
    already names each frontend's reason (``FXPAR_DEBUG=1``: logs shown, full tracebacks in
    the error)."""
    if debug:
        yield
        return
    prev = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # graph dumps written to stderr
            yield
    finally:
        logging.disable(prev)


def failure_reason(label: str, e: BaseException, *, debug: bool) -> str:
    """``"LABEL: [data-dependent ... at OP ...: ]FIRST LINE OF THE ERROR"`` for one frontend's
    failure (``debug``: the full traceback on the following lines)."""
    name = type(e).__name__
    dd = ("data-dependent value" if name == "GuardOnDataDependentSymNode"  # a branch
          # an op returning a Python value read from tensor data (torch.equal)
          else "data-dependent output value" if name == "DataDependentOutputException"
          else "data-dependent output shape" if name in DATA_DEPENDENT_ERRORS else "")
    if dd:  # name the op and the line that made it (not just the model's class)
        dd = f"{dd}{_failure_site(e)}: "
    return (f"{label}: {dd}{_sorted_symbol_sets(_first_line(e))}" +
            ("\n" + "".join(traceback.format_exception(e)) if debug else ""))


def capture_error(owner: str, reasons: list[str],
                  failures: dict[str, BaseException]) -> CaptureError:
    """The error of a capture no frontend could make: every reason, and why static shapes and
    control flow matter when a failure was data-dependent; ``err.failures`` is ``failures``."""
    why = ""
    if any(type(f).__name__ in DATA_DEPENDENT_ERRORS for f in failures.values()):
        why = (" (fxpar plans static shapes and static control flow: an op whose output shape "
               "depends on tensor values, a Python value read from a tensor (torch.equal, "
               "if t:, int(t)), or a branch or size taken from one, cannot be captured, but one "
               "read with .item()/.tolist() is specialized to the example inputs' value when "
               "they are real)")
    err = CaptureError(f"could not capture {owner}: " + "; ".join(reasons) + why)
    err.failures = failures  # type: ignore[attr-defined]
    return err


def _sorted_symbol_sets(msg: str) -> str:
    """torch prints sets of unbacked symbols (``{u2, u1, u3}``) in hash order, which differs
    between processes: sorted, every rank raises the same message.

    >>> _sorted_symbol_sets("Pending unbacked symbols {u10, u2, u1} not in returned outputs")
    'Pending unbacked symbols {u1, u2, u10} not in returned outputs'
    """
    import re

    def sort(m: re.Match) -> str:
        syms = sorted(m.group(1).split(", "), key=lambda t: (t[0], int(t[1:])))
        return "{" + ", ".join(syms) + "}"

    return re.sub(r"\{([a-z]\d+(?:, [a-z]\d+)*)\}", sort, msg)


def _in_capture(mod: str) -> bool:
    """Whether module ``mod`` is this package (``fxpar.capture`` or one of its modules)."""
    return mod == "fxpar.capture" or mod.startswith("fxpar.capture.")


def _failure_site(e: BaseException) -> str:
    """Where a tracing error happened, as `` at OP in API, called from USER (FILE:LINE: `SRC`)``:
    the ATen op being traced (the innermost frame of torch's dispatch that holds it), the public
    torch function it happened in (``torch.nn.functional.gaussian_nll_loss``: a check on a
    tensor value in Python), and the innermost frame of the caller's own code (outside torch
    and ``fxpar.capture``). Parts that cannot be found are left out; ``""`` when none is."""
    import linecache
    import sysconfig

    frames = []
    seen: set[int] = set()
    while e is not None and id(e) not in seen and len(seen) < 8:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frames.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    stdlib = sysconfig.get_paths().get("stdlib") or "\0"
    op = user = api = None
    for i, (fr, line) in enumerate(frames):
        fn = fr.f_locals.get("func")
        if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            op = fn
        mod = str(fr.f_globals.get("__name__") or "")
        path = fr.f_code.co_filename
        if (mod and mod.split(".")[0] != "torch" and not _in_capture(mod)
                and not path.startswith(stdlib) and not path.startswith("<")):
            user, api = (fr, line), None
        elif user is not None and mod.startswith("torch.") and not any(
                part.startswith("_") for part in mod.split(".")) and not mod.startswith(
                ("torch.fx", "torch.export", "torch.utils", "torch.overrides",
                 "torch.nn.modules.module")):
            api = (fr, line)
    parts = []
    if op is not None:
        parts.append(f"at {op}")
    if api is not None:
        fr, line = api
        parts.append(f"in {fr.f_globals['__name__']}.{fr.f_code.co_qualname} "
                     f"({os.path.basename(fr.f_code.co_filename)}:{line})")
    if user is not None:
        fr, line = user
        path = fr.f_code.co_filename
        rel = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
        src = linecache.getline(path, line).strip()
        src = f": `{src[:80]}`" if src else ""
        parts.append(f"called from {fr.f_code.co_qualname} ({rel}:{line}{src})")
    return (" " + ", ".join(parts)) if parts else ""


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else '(no message)'}"


def refuse_data_dependent(gm: fx.GraphModule, owner: str) -> None:
    """Raise :class:`CaptureError` naming the first node whose output shape depends on the
    data (``nonzero``, ``argwhere``, ``unique``, ``masked_select``...: export gives it an
    unbacked size ``u0``). fxpar plans static shapes (every spec's local shape is computed up
    front), so such a graph cannot be planned; without this check the planner would fail on
    ``int(u0)`` with a raw ``GuardOnDataDependentSymNode``. Deterministic, so every rank raises
    the same error."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        v = n.meta.get(ir.VAL)
        if v is None:
            continue
        try:
            syms = free_unbacked_symbols(v)
        except Exception:  # noqa: BLE001 - a value free_unbacked_symbols cannot walk has none
            syms = set()
        if syms:
            what = ("output shape (sizes" if isinstance(v, (torch.Tensor, tuple, list))
                    else "output value (a Python number read from a tensor, as .item() does:")
            read = n.target in (torch.ops.aten.item.default,
                                torch.ops.aten._local_scalar_dense.default)
            raise CaptureError(
                f"could not capture {owner}: node {n.name} ({n.target}) has a data-dependent "
                f"{what} {sorted(map(str, syms))} known only at run time)" + (
                    " used as a number in the computation; fxpar specializes a value read with "
                    ".item()/.tolist() to the example inputs' only when it sets a size or a "
                    "branch: keep this one a tensor (x * t, not x * t.item())" if read else
                    "; fxpar plans static shapes, so ops such as nonzero, argwhere, unique, "
                    "masked_select and boolean-mask indexing are not supported"))
