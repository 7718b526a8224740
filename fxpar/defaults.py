"""Defaults shared across layers (plain constants, no fxpar imports): one place to change them.

>>> BUCKET_BYTES // 2**20, FIRST_BUCKET_BYTES // 2**20, LOSS_PREFIX
(25, 1, 'model.')
"""

#: gradient bucket of the data-parallel reduction (DDP's ``bucket_cap_mb``; AMSP's ``U``)
BUCKET_BYTES = 25 * 2**20
#: the first bucket of each kind and axis, launched early (DDP's first bucket)
FIRST_BUCKET_BYTES = 2**20
#: the prefix :class:`fxpar.capture.WithLoss` adds to the wrapped model's parameter names
LOSS_PREFIX = "model."
