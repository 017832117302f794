"""A Tune adapter, deciding trials: ``ChorusASHA`` over the Ray-free rung arithmetic of cohort
halving (``rules/halving.py``)."""
