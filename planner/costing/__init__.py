"""Costs of a layer, a collective and the model state on a cluster, and the per-layer cost tables
the search and the simulator share."""
