"""Watching a sweep: the buckets' Ray metrics, the Grafana dashboard of them, and what actors write to their logs."""
