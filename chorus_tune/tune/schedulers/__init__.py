"""Deciding trials: ``ChorusASHA`` (the Tune adapter) over the Ray-free rung arithmetic of cohort halving."""
