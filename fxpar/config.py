"""One parallel configuration: degrees per mesh axis, microbatching, schedule, recomputation
and model-state sharding, validated once (torchtitan's ``ParallelDims``, with AMSP's factors).

A :class:`ParallelConfig` is what a user tuple (``plan=dict(pp=4, dp=8, tp=8, ...)``) says, what
the joint search enumerates (:attr:`fxpar.planner.joint.Candidate.config`), what a realized
:class:`fxpar.Plan` carries (``plan.config``) and what the runners read (state factors,
recomputed layers). It is frozen and hashable; :meth:`ParallelConfig.validate` checks the rules
that need the cluster or the batch and says which rule failed and what would work.

Fields: ``pp`` pipeline ranks, ``dp`` data-parallel replicas (all of them: with ``1 < s_p <
dp`` they split into ``dp / s_p`` groups of ``dp_shard = s_p``, HSDP), ``tp`` tensor-parallel
devices, ``extra`` any other mesh axes as ``(name, degree)`` pairs (AxoNN's grids; ``cp``,
context parallelism: the sequence split over ``cp`` devices between ``dp`` and ``tp``, whose
parameter gradients are reduced with the ``dp`` replicas', :attr:`ParallelConfig.replicas`);
``microbatch`` samples per replica per microbatch (``None``: not fixed),
``microbatches``; ``schedule`` a :class:`ScheduleKind`; ``chunks`` per pipeline rank
(``None``: the schedule's own, two for zbv and dualpipev, else one);
``recompute`` the layers whose forward runs again in backward (:func:`recompute_set`), at
``recompute_granularity`` (``"full"``: all of it; ``"selective"``: all but the GEMMs,
attention kernels and collectives, whose outputs the layer keeps,
:data:`fxpar.cost.memory.GRANULARITIES`);
``s_p | s_g | s_os`` AMSP's sharding factors of parameters, gradients and optimizer states
over a parameter's ``replicas`` (``dp``, times ``cp``; eq. 3): DDP ``(1, 1, 1)``, ZeRO-1
``(1, 1, dp)``, ZeRO-2 ``(1, dp, dp)``, ZeRO-3
``(dp, dp, dp)``.

>>> c = ParallelConfig(pp=2, dp=4, tp=2, microbatch=1, microbatches=8, schedule="interleaved",
...                    chunks=2, recompute={"layers.0", "(top)"}, s_g=4, s_os=4)
>>> c.schedule, str(c.schedule), c.devices, sorted(c.recompute)
(<ScheduleKind.INTERLEAVED: 'interleaved'>, 'interleaved', 16, ['layers.0'])
>>> c.name
'pp=2 dp=4 tp=2 b=1 m=8 interleaved v=2 recompute(1 layers) zero(g=4,os=4)'
>>> ParallelConfig.from_dict(c.to_dict()) == c
True
>>> ParallelConfig(dp=4, s_p=2, s_g=3)
Traceback (most recent call last):
  ...
fxpar.errors.PlanError: ParallelConfig: state factors s_p=2 | s_g=3 | s_os=1 must each divide the next and dp=4 (AMSP eq. 3); e.g. (2, 2, 2) or (2, 2, 4)
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields

from fxpar.cost.memory import GRANULARITIES
from fxpar.errors import PlanError
from fxpar.layers import is_layer
from fxpar.schedule.schedule import DIVIDES_M, MULTI_CHUNK, PLACEMENT_OF, default_chunks

__all__ = ["ParallelConfig", "ScheduleKind", "recompute_set", "is_layer", "TUPLE_KEYS"]


class ScheduleKind(str, enum.Enum):
    """Pipeline schedules; each prints as (and equals) its name in today's strings."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    EAGER_1F1B = "eager-1f1b"
    ZB_H1 = "zb-h1"
    LOOPED_BFS = "looped-bfs"
    INTERLEAVED_ZB = "interleaved-zb"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"
    #: a hand-written schedule (:meth:`fxpar.Schedule.from_csv`): its action lists are the plan's
    CUSTOM = "custom"

    def __str__(self) -> str:
        return self.value

    #: hashes as its name string, so ``{"1f1b": ...}[ScheduleKind.ONE_F_ONE_B]`` finds it
    __hash__ = str.__hash__

    @classmethod
    def parse(cls, s) -> ScheduleKind:
        try:
            return cls(str(s))
        except ValueError:
            raise PlanError(f"unknown schedule {s!r}; one of {[k.value for k in cls]}") from None


def recompute_set(names: Iterable[str] | None) -> frozenset[str]:
    """The recomputable layers among ``names`` (:func:`is_layer`), as a frozenset.

    >>> sorted(recompute_set(["blocks.1", "(top)", "blocks.0"]))
    ['blocks.0', 'blocks.1']
    """
    return frozenset(n for n in (names or ()) if is_layer(n))


#: the keys of a user tuple ``plan={...}`` (and of :meth:`ParallelConfig.from_tuple`)
TUPLE_KEYS = ("pp", "dp", "tp", "cp", "microbatch", "schedule", "chunks", "recompute", "s_p",
              "s_g", "s_os")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class ParallelConfig:
    """One configuration (module docstring). Invalid degrees or factors raise
    :class:`~fxpar.errors.PlanError` at construction."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    microbatch: int | None = None
    microbatches: int = 1
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    chunks: int | None = None
    recompute: frozenset[str] = field(default_factory=frozenset)
    s_p: int = 1
    s_g: int = 1
    s_os: int = 1
    extra: tuple[tuple[str, int], ...] = ()
    recompute_granularity: str = "full"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "schedule", ScheduleKind.parse(self.schedule))
        set_(self, "chunks", default_chunks(str(self.schedule), self.chunks))  # None: a V's two
        set_(self, "recompute", recompute_set(self.recompute))
        set_(self, "extra", tuple((str(a), int(k)) for a, k in self.extra))
        for f in ("pp", "dp", "tp", "microbatches", "chunks", "s_p", "s_g", "s_os"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"ParallelConfig: {f}={v!r} must be a positive integer")
        if self.recompute_granularity not in GRANULARITIES:
            raise PlanError(f"ParallelConfig: recompute_granularity={self.recompute_granularity!r}, "
                            f"one of {GRANULARITIES}")
        if self.microbatch is not None and (not isinstance(self.microbatch, int) or self.microbatch < 1):
            raise PlanError(f"ParallelConfig: microbatch={self.microbatch!r} must be a positive integer")
        for a, k in self.extra:
            if a in ("pp", "dp", "dp_shard", "tp") or k < 1:
                raise PlanError(f"ParallelConfig: extra axis {a}={k} (pp, dp, dp_shard, tp have "
                                "their own fields; degrees are positive)")
        f = (self.s_p, self.s_g, self.s_os)
        n = self.replicas
        if n % self.s_os or self.s_os % self.s_g or self.s_g % self.s_p:
            ok = [(p, g, o) for p in _divisors(n) for g in _divisors(n)
                  for o in _divisors(n) if g % p == 0 and o % g == 0 and p == self.s_p][:2]
            ok = ok or [(1, 1, 1), (n,) * 3]
            what = f"dp={self.dp}" if n == self.dp else f"dp·cp={n}"
            raise PlanError(f"ParallelConfig: state factors s_p={f[0]} | s_g={f[1]} | s_os={f[2]} "
                            f"must each divide the next and {what} (AMSP eq. 3); e.g. "
                            + " or ".join(str(x) for x in ok))
        if self.chunks > 1 and str(self.schedule) not in MULTI_CHUNK | {"custom"}:
            raise PlanError(f"ParallelConfig: chunks={self.chunks} needs schedule='interleaved' "
                            f"or another of several chunks per rank ({', '.join(sorted(MULTI_CHUNK))}; "
                            f"got {self.schedule})")
        if str(self.schedule) in PLACEMENT_OF and self.chunks != 2:
            raise PlanError(f"ParallelConfig: {self.schedule} places two chunks per pipeline rank "
                            f"in a V; chunks={self.chunks} (pass chunks=2)")
        if str(self.schedule) in DIVIDES_M and self.pp > 1 and self.microbatches % self.pp:
            raise PlanError(f"ParallelConfig: {self.schedule} needs microbatches ({self.microbatches}) "
                            f"divisible by pp={self.pp}; e.g. microbatches="
                            f"{math.ceil(self.microbatches / self.pp) * self.pp}")
        if (self.pp > 1 or self.microbatches > 1) and self.s_p not in (1, self.dp):
            raise PlanError(f"ParallelConfig: s_p={self.s_p} with a pipeline or microbatches: "
                            f"parameters are sharded over all of a stage's replicas (s_p = dp = "
                            f"{self.dp}) or none (s_p = 1); groups of replicas need pp=1 and one "
                            "microbatch")
        if self.s_p > 1 and (self.pp > 1 or self.microbatches > 1) and (self.s_g, self.s_os) != (self.dp,) * 2:
            raise PlanError(f"ParallelConfig: ZeRO-3 over a stage's replicas is (dp, dp, dp) = "
                            f"{(self.dp,) * 3}, got {f}")

    # -- derived ---------------------------------------------------------------------------
    @property
    def dp_shard(self) -> int:
        """Replicas per parameter-sharding group when ``1 < s_p < dp`` (an HSDP mesh axis)."""
        return self.s_p if 1 < self.s_p < self.dp else 1

    @property
    def cp(self) -> int:
        """Context-parallel devices per replica (the ``cp`` axis of ``extra``, else 1)."""
        return dict(self.extra).get("cp", 1)

    @property
    def replicas(self) -> int:
        """Devices holding a copy of each parameter and a partial sum of its gradient:
        ``dp·cp`` (the group gradients are reduced over, states sharded in)."""
        return self.dp * self.cp

    @property
    def degrees(self) -> dict[str, int]:
        """Every axis and its degree (``dp`` split into ``dp`` × ``dp_shard`` under HSDP),
        outermost first: the mesh a plan of this configuration is built on."""
        out = {"pp": self.pp} if self.pp > 1 else {}
        if self.dp_shard > 1:
            out.update(dp=self.dp // self.dp_shard, dp_shard=self.dp_shard)
        else:
            out["dp"] = self.dp
        out.update(self.extra)
        out["tp"] = self.tp
        return out

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.tp * math.prod(k for _, k in self.extra)

    @property
    def state(self) -> tuple[int, int, int]:
        return (self.s_p, self.s_g, self.s_os)

    @property
    def name(self) -> str:
        """One line, as the joint search prints candidates."""
        b = f" b={self.microbatch}" if self.microbatch is not None else ""
        v = f" v={self.chunks}" if self.chunks > 1 else ""
        ex = "".join(f" {a}={k}" for a, k in self.extra)
        g = "selective, " if self.recompute_granularity == "selective" else ""
        r = f" recompute({g}{len(self.recompute)} layers)" if self.recompute else ""
        return (f"pp={self.pp} dp={self.dp} tp={self.tp}{ex}{b} m={self.microbatches} "
                f"{self.schedule}{v}{r} zero({'p=%d,' % self.s_p if self.s_p > 1 else ''}"
                f"g={self.s_g},os={self.s_os})")

    # -- rules that need the cluster or the batch -------------------------------------------
    def validate(self, cluster=None, batch: int | None = None) -> ParallelConfig:
        """Check what needs the ``cluster`` (every device used; ``tp`` inside a node; state
        groups that tile the nodes) and the global ``batch`` (``dp·microbatch·microbatches``);
        returns ``self``, or raises :class:`PlanError` naming the rule and what would work.

        >>> import fxpar
        >>> ParallelConfig(pp=2, dp=2, tp=2).validate(fxpar.Cluster.preset("dgx-a100"), batch=8).degrees
        {'pp': 2, 'dp': 2, 'tp': 2}
        >>> ParallelConfig(dp=16).validate(fxpar.Cluster.preset("dgx-a100", nodes=2), batch=8)
        Traceback (most recent call last):
          ...
        fxpar.errors.PlanError: ParallelConfig pp=1 dp=16 tp=1 m=1 1f1b zero(g=1,os=1): batch 8 is too small for dp=16 replicas (each needs at least one sample); at most dp=8, or a batch that dp=16 divides
        """
        if cluster is not None:
            n, R = cluster.num_devices, cluster.devices_per_node
            if self.devices != n:
                raise PlanError(f"ParallelConfig {self.name}: pp·dp·tp = {self.devices} devices, the "
                                f"cluster has {n}; e.g. dp={n // (self.pp * self.tp)}"
                                if n % (self.pp * self.tp) == 0 else
                                f"ParallelConfig {self.name}: pp·dp·tp = {self.devices} devices, "
                                f"the cluster has {n} (pp·tp must divide it)")
            if R % self.tp and self.tp % R:
                raise PlanError(f"ParallelConfig {self.name}: tp={self.tp} neither divides a node's "
                                f"{R} devices nor is a multiple of them (its groups would straddle "
                                "nodes unevenly)")
            n = self.replicas
            d0 = math.gcd(n, max(1, R // self.tp)) if self.devices >= R else n
            for k, f in zip(("s_p", "s_g", "s_os"), self.state):
                if d0 % f and f % d0:
                    raise PlanError(f"ParallelConfig {self.name}: {k}={f} neither divides nor is a "
                                    f"multiple of the {d0} replicas inside a node (its groups would "
                                    f"not tile the nodes); e.g. {k}={math.gcd(f, d0)}")
        if batch is not None:
            if batch < self.dp or batch % self.dp:
                best = max((d for d in _divisors(batch) if d <= self.dp), default=1)
                raise PlanError(f"ParallelConfig {self.name}: batch {batch} is too small for dp="
                                f"{self.dp} replicas (each needs at least one sample); at most "
                                f"dp={best}, or a batch that dp={self.dp} divides"
                                if batch < self.dp else
                                f"ParallelConfig {self.name}: dp={self.dp} does not divide the batch "
                                f"{batch}; e.g. dp={best}")
            if self.microbatch is not None and batch != self.dp * self.microbatch * self.microbatches:
                raise PlanError(f"ParallelConfig {self.name}: dp·microbatch·microbatches = "
                                f"{self.dp * self.microbatch * self.microbatches} is not the batch "
                                f"{batch}")
        return self

    # -- conversions -------------------------------------------------------------------------
    @classmethod
    def from_tuple(cls, only: Mapping) -> dict:
        """Check a user tuple's keys and values (``TUPLE_KEYS``; the rest searched) and return
        it normalized (``schedule`` a :class:`ScheduleKind`, ``recompute`` a bool, or
        ``"selective"`` for that granularity; ``"full"`` is ``True``)."""
        bad = set(only) - set(TUPLE_KEYS)
        if bad:
            raise PlanError(f"plan={dict(only)}: unknown keys {sorted(bad)}; a degree tuple takes "
                            f"{TUPLE_KEYS}")
        out = dict(only)
        if "schedule" in out:
            out["schedule"] = ScheduleKind.parse(out["schedule"])
        for k in ("pp", "dp", "tp", "cp", "microbatch", "chunks", "s_p", "s_g", "s_os"):
            if k in out and (not isinstance(out[k], int) or isinstance(out[k], bool) or out[k] < 1):
                raise PlanError(f"plan={dict(only)}: {k}={out[k]!r} must be a positive integer")
        if "recompute" in out:
            r = out["recompute"]
            if isinstance(r, str) and r not in GRANULARITIES:
                raise PlanError(f"plan={dict(only)}: recompute={r!r} must be a bool or one of "
                                f"{GRANULARITIES}")
            out["recompute"] = "selective" if r == "selective" else bool(r)
        return out

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["schedule"] = self.schedule.value
        d["recompute"] = sorted(self.recompute)
        d["extra"] = [list(x) for x in self.extra]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> ParallelConfig:
        d = dict(d)
        d["extra"] = tuple(tuple(x) for x in d.get("extra", ()))
        d["recompute"] = frozenset(d.get("recompute", ()))
        return cls(**d)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)[:3])
        return f"ParallelConfig({shown}, ...)"
