"""A Tune adapter, choosing trials: ``ChorusSearch`` draws them ahead of Tune and seats whole
cohorts (through ``client.py``), and says how the space splits into structures."""
