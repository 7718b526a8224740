"""placeholder"""
from fxpar.solver.problem import Solution, StrategyProblem, brute_force, fmt_bytes
from fxpar.solver.reduce import ALL_REDUCTIONS, Reduced, choose_scale, reduce_problem
from fxpar.solver.ilp import EDGE_ENCODINGS, min_peak_memory, solve
