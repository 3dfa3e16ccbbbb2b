"""One training step played as events (`simulator`, `engine`, `schedules`), and `estimate` of one
hand-written configuration on it (`estimator`)."""
