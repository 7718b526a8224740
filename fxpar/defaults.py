"""Defaults shared across layers (plain constants, no fxpar imports): one place to change them.

>>> BUCKET_BYTES // 2**20, FIRST_BUCKET_BYTES // 2**20, CPU_STEP_PIECE * 4 // 2**10, LOSS_PREFIX
(25, 1, 512, 'model.')
"""

#: gradient bucket of the data-parallel reduction (DDP's ``bucket_cap_mb``; AMSP's ``U``)
BUCKET_BYTES = 25 * 2**20
#: the first bucket of each kind and axis, launched early (DDP's first bucket)
FIRST_BUCKET_BYTES = 2**20
#: parameter gathers are grouped until a group moves this many bytes per device (a norm, a
#: position table rides with the unit after it: :func:`fxpar.cost.step.gather_groups`): 64 KiB
#: take under 3 us at 25 GB/s, a collective's latency is 5 us or more (gloo's ~50 us)
TINY_GATHER_BYTES = 64 * 2**10
#: the most elements of one tensor the eager optimizer steps on a CPU (512 KiB fp32): a flat
#: bucket segment is stepped in pieces of this size. Each of Adam's ~10 operations allocates a
#: temporary the size of its tensor; above glibc's mmap threshold those come from fresh,
#: zero-filled pages on every step (a 2 MiB AdamW segment steps 2.3 ms, in 2**17 pieces 0.6 ms,
#: per parameter 1.1 ms). GPUs step whole segments (one kernel per operation).
CPU_STEP_PIECE = 2**17
#: the runtime steps an optimizer with a fused kernel (``fused=True``) where torch has one and
#: the user chose no implementation (:func:`fxpar.runtime.model_state.optimizer.fuse`)
FUSED_STEP = True
#: after the optimizer step under ZeRO-1/2, the updated parameters come back in all-gathers
#: whose outputs hold at most this many bytes (whole buckets; a bucket larger alone): the
#: gathered copy is a temporary beside the model states, bounded as DeepSpeed bounds its
#: ``allgather_bucket_size`` (5e8 elements), in a few collectives rather than one per bucket
OS_GATHER_BYTES = 2**30
#: under gloo a pipeline rank posts all of a step's receives at its start when their buffers
#: hold at most this many bytes (:meth:`fxpar.runtime.interpreter.PipelineRunner._ahead`):
#: the buffers of microbatches not yet in flight are memory the schedule would not hold
PREPOST_BYTES = 256 * 2**20
#: the prefix :class:`fxpar.capture.WithLoss` adds to the wrapped model's parameter names
LOSS_PREFIX = "model."
