"""What Tune runs and keeps: the ``ChorusTrainable`` trial that reads one
member, and its checkpoints (a trial process never loads torch)."""
