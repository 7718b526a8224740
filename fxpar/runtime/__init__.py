"""Run-time pieces of fxpar: collectives, resharding execution, schedules."""

from fxpar.runtime.redistribute_cross import cross_mesh_reshard

__all__ = ["cross_mesh_reshard"]
