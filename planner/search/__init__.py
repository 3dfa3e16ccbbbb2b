"""Search for a plan: enumerate uniform candidates, place layers with an ILP per candidate
(`ilp/`), rank the best by simulation and assemble the Plan."""
