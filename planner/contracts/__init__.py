"""The types the stages hand each other: ModelGraph, ClusterProfile, ParallelConfig, Plan,
Prediction, Measurement, and meshplan's error type. A leaf: imports nothing else of meshplan."""
