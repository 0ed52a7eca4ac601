"""The operator level's rules (docs/design.md §3): how each torch-level operator kind runs on N
stacked samples.

* :mod:`.registry`: the table ``OP_RULES[kind]`` and the :func:`~.registry.op_rule` decorator
  (the order in which a kind's rules are asked, the default);
* the rules, by way of running: :mod:`.gemm` (modelled accumulators; linear and attention
  batched), :mod:`.elementwise`, :mod:`.draws` (random draws and dropout), :mod:`.per_sample`
  (batch statistics, recurrent layers), :mod:`.structural` (metadata, casts, tuple items,
  input scalars), and :mod:`.lifted`, the default (vmap, else once per sample);
* :mod:`.tracer`: :class:`~.tracer.SampleTracer`, which looks each node's kind up in the table
  and does what every operator shares (the GEMM surrogate, rounding and measuring the
  selected outputs, coverage notes).

``describe(kind)`` (:mod:`.registry`) prints how a kind runs.
"""
