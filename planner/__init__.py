"""meshplan's planner: profile a model, cost it on a cluster, search for a plan, simulate it.

The subpackages follow the data flow (`docs/architecture.md`):

    models -> profiling -> costing -> simulation -> search      (calibration fits costing's data)

and `contracts` holds the types they hand each other. The planner imports nothing of the
executor, the reports or the command line.
"""
