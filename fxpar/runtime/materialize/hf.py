"""Hugging Face special cases of materializing from a model's initializers.

The init replay (:mod:`~fxpar.runtime.materialize.init_replay`) runs a model's initializers on
meta tensors; three things of ``transformers`` need care there:

* :class:`HFFlags` hides ``_is_hf_initialized`` flags while the initializers run (its init
  functions skip flagged tensors; on meta nothing was really loaded) and restores them after;
* :func:`init_tables` is where ``transformers`` keeps its own references to ``torch.nn.init``
  functions (``transformers.initialization.TORCH_INIT_FUNCTIONS``), which the replay's patches
  must reach too;
* :func:`rope_value`: a rotary embedding's ``inv_freq`` / ``original_inv_freq`` is computed in
  ``__init__`` (lost on meta) and no initializer writes it before transformers 5 (whose
  ``_init_weights`` copies it in, which is recorded); it is recomputed from the module's
  config with its ``rope_init_fn`` / ``compute_default_rope_parameters``.

Nothing here imports ``transformers``: a model that is not a Hugging Face one passes through.

>>> import torch
>>> from torch import nn
>>> class ToyRotaryEmbedding(nn.Module):        # the shape of HF's: a config and an init fn
...     def __init__(self):
...         super().__init__()
...         self.config = {"dim": 4}
...         self.register_buffer("inv_freq", torch.empty(2, device="meta"), persistent=False)
...     def rope_init_fn(self, config, device):
...         return 1.0 / 10000 ** (torch.arange(0, config["dim"], 2) / config["dim"]), 1.0
>>> rot = ToyRotaryEmbedding()
>>> rope_value([(rot, "inv_freq")], rot.inv_freq)
tensor([1.0000, 0.0100])
>>> rope_value([(rot, "weight")], rot.inv_freq) is None     # not a rotary buffer
True
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["HFFlags", "init_tables", "rope_value"]


class HFFlags:
    """Hide Hugging Face's ``_is_hf_initialized`` flags (its init functions skip flagged
    tensors; on meta nothing was really loaded) and restore them after."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.saved: list = []

    def __enter__(self):
        objs = list(self.model.modules()) + list(self.model.parameters()) + list(self.model.buffers())
        for o in objs:
            if "_is_hf_initialized" in getattr(o, "__dict__", {}):
                self.saved.append((o, o.__dict__["_is_hf_initialized"]))
                delattr(o, "_is_hf_initialized")
        return self

    def __exit__(self, *exc):
        for o, v in self.saved:
            setattr(o, "_is_hf_initialized", v)


def init_tables() -> list[dict]:
    """The dicts in which a loaded ``transformers`` keeps ``torch.nn.init`` functions by name
    (``transformers.initialization.TORCH_INIT_FUNCTIONS``; none if it is not loaded)."""
    hf = sys.modules.get("transformers.initialization")
    table = getattr(hf, "TORCH_INIT_FUNCTIONS", None) if hf is not None else None
    return [table] if isinstance(table, dict) else []


def rope_value(owners: Iterable[tuple[nn.Module, str]], meta: torch.Tensor) -> torch.Tensor | None:
    """A Hugging Face rotary embedding's ``inv_freq``/``original_inv_freq`` from its config
    (``owners``: the ``(module, attribute)`` pairs holding the buffer, ``meta`` its meta
    tensor); ``None`` if no owner is one or the result does not fit."""
    for mod, attr in owners:
        if attr not in ("inv_freq", "original_inv_freq") or "Rotary" not in type(mod).__name__:
            continue
        cfg = getattr(mod, "config", None)
        fn = getattr(mod, "rope_init_fn", None) or getattr(mod, "compute_default_rope_parameters", None)
        if cfg is None or not callable(fn):
            continue
        try:
            out = fn(cfg, torch.device("cpu"))
        except TypeError:
            out = fn(cfg)
        value = out[0] if isinstance(out, tuple) else out
        if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(meta.shape):
            return value.to(meta.dtype)
    return None
