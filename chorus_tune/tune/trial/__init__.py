"""A Tune adapter, what Tune runs and keeps: the ``ChorusTrainable`` trial that reads one member
(reaching the pool through ``client.py``), and its checkpoints (a trial process never loads torch)."""
