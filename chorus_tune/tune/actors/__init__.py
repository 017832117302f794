"""The Ray actors: the pool (one per job: seats, places and watches buckets) and the bucket actor
(the executor), with the Ray plumbing they need (sizing, liveness, where singletons live).
They apply rules/ to values/; the Tune adapters reach the pool only through ``client.py``."""
