"""fxpar: an auto-parallelizing compiler for PyTorch training (see DESIGN.md).

>>> import fxpar
>>> mesh = fxpar.Mesh(fxpar.Cluster.preset("dgx-a100", nodes=2), dp=2, tp=8)
>>> print(fxpar.reshard_plan("S(0)S(1)", "RR", mesh, (1024, 1024), "float32"))
S(0)S(1) -> RS(1) -> RR
"""

from fxpar.errors import (
    CaptureError,
    ClusterError,
    CollectiveTimeoutError,
    FxparError,
    GuardError,
    MaterializeError,
    MeshError,
    PassError,
    PlanError,
    ReshardError,
    ScheduleError,
    SpecError,
)
from fxpar.spec import Partial, Placement, Replicate, Shard, Spec
from fxpar.cluster import Cluster
from fxpar.mesh import Mesh
from fxpar import ir
from fxpar.capture import capture, run_captured
from fxpar.ir import InputInfo, OutputInfo, ParamInfo, TensorMeta
from fxpar.resharding.intra import ReshardPlan, ReshardStep, reshard_plan
from fxpar.resharding.cross import CrossMeshPlan, cross_mesh_plan
from fxpar.config import ParallelConfig, ScheduleKind
from fxpar.plan_data import EdgePlan, NodePlan, Plan, StepCost
from fxpar.planner import PlannerOptions, plan_graph
from fxpar.api import Planned, compile, plan
from fxpar.program import Program, Runner, load
from fxpar.schedule import Action, Schedule
from fxpar.sim import SimResult, simulate
from fxpar.verify import Divergence, VerifyReport
from fxpar.runtime.profile import Profile
from fxpar.runtime.hf_checkpoint import HFCheckpoint

__version__ = "0.1.0"

__all__ = [
    "CaptureError", "ClusterError", "CollectiveTimeoutError", "FxparError", "GuardError", "MaterializeError", "MeshError",
    "PassError", "PlanError", "ReshardError", "ScheduleError", "SpecError",
    "Partial", "Placement", "Replicate", "Shard", "Spec",
    "Cluster", "Mesh",
    "ir", "capture", "run_captured", "InputInfo", "OutputInfo", "ParamInfo", "TensorMeta",
    "reshard_plan", "ReshardPlan", "ReshardStep", "cross_mesh_plan", "CrossMeshPlan",
    "ParallelConfig", "ScheduleKind", "Plan", "NodePlan", "EdgePlan", "StepCost", "PlannerOptions", "plan_graph",
    "plan", "compile", "Planned", "Program", "Runner", "load",
    "Action", "Schedule", "SimResult", "simulate", "VerifyReport", "Divergence", "Profile", "HFCheckpoint",
]
