"""fxpar.cost: pure cost functions of shapes, specs, meshes and a Cluster (no process groups).

=================  ==============================================================================
``comm``           ring collectives (AxoNN eq. 1–3 + α per step), placement-aware bandwidth (eq. 10
                   generalized, leaf-spine level from AMSP §V-D), per-axis convenience
``calibration``    fitting measured collective times to α and β, compute times to rate curves
                   (used by ``Cluster.calibrate``)
``compute``        FLOPs and bytes per ATen op, forward and backward; roofline or calibrated time
``memory``         model states under (s_p, s_g, s_os) sharding, activation liveness, stage peaks
``pipeline``       GPipe / 1F1B / interleaved / eager-1F1B bubbles, warm-ups, in-flight microbatches
``reshard``        cost of one per-axis redistribution step (plans: :mod:`fxpar.resharding.intra`)
``reshard_cross``  cost of cross-mesh transfers: unit tasks, hop links, lower bound (plans:
                   :mod:`fxpar.resharding.cross`)
``axonn``          AxoNN's per-layer 4D communication model and configuration ranking
``amsp``           AMSP's T_p, T_g, T_os terms, memory model and its sharding program
``megatron``       Megatron-LM's parameter, FLOP, traffic and training-time formulas
=================  ==============================================================================
"""
