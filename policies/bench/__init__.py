"""The benchmark: every family's policies on the held-out split, beside the family's bound.

One runner (:mod:`policies.bench.runner`) plays every family: a family is a roster of rows, an
environment factory and a bound -- :mod:`policies.bench.single` (one request, ``specenv bench``),
:mod:`policies.bench.batch` (a batch of requests, ``specenv bench --batch B``) and
:mod:`policies.bench.caps` (the joint (k, expert cap) action, ``specenv bench-caps``). Each returns
the one result type :class:`policies.bench.result.BenchResult`; :mod:`policies.bench.stats` holds the
statistics of the rows, :mod:`policies.bench.tables` the Markdown tables, :mod:`policies.bench.figures`
the figures and :mod:`policies.bench.outputs` the files a run writes. What every family fits on the
train split is :mod:`policies.bench.context`.
"""
