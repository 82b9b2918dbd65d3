"""The ftbridge benchmark suite (``ftbridge-bench``): overhead, recovery, heal speed and scaling.

Every figure is a ratio or count against a baseline run in the same
invocation (plain DeepSpeed, a torchrun restart from a checkpoint, a
loopback copy), the median of several repetitions with its spread. See
``docs/benchmarks.md``. Modules:

* :mod:`ftbridge.harness.bench.core`: :class:`Metric`, :class:`BenchSettings`, the registry;
* one module per benchmark, each registering a function ``run(settings) -> list[Metric]``.
"""
