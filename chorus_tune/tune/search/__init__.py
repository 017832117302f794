"""Choosing trials: ``ChorusSearch`` draws them ahead of Tune and seats whole
cohorts; the run's plan it gathers for the buckets."""
