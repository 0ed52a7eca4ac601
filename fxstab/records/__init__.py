"""What an analysis records: one report per instrumented operator and call
(:mod:`~fxstab.records.report`), CADNA's instability counters (:mod:`~fxstab.records.counters`),
how each operator ran (:mod:`~fxstab.records.coverage`), and the state the analyses of one
backend share while they run (:mod:`~fxstab.records.run`).

The modules are imported by name; this package imports none of them.
"""

__all__ = ["report", "counters", "coverage", "run"]
