"""One training step played as events (`simulator`, `step_costs`, `event_engine`, `schedules`), and `estimate` of one
hand-written configuration on it (`estimator`)."""
