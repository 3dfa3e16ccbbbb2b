"""One training step played as events (`simulator`, `engine`, `schedules`) and the closed form
(`estimator`)."""
