"""Resharding plans (planning only: no process groups, nothing runs here).

==========  =================================================================================
``intra``   one mesh: the cheapest sequence of per-axis collectives between two specs
            (:func:`fxpar.reshard_plan`); run by :mod:`fxpar.runtime.redistribute`, priced by
            :mod:`fxpar.cost.reshard`
``cross``   two meshes: unit tasks, senders and their order (:func:`fxpar.cross_mesh_plan`);
            run by :mod:`fxpar.runtime.redistribute_cross`, priced by
            :mod:`fxpar.cost.reshard_cross`
==========  =================================================================================
"""
