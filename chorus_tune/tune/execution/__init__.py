"""Running the buckets: the pool and bucket actors (Ray plumbing) over Ray-free
rules for placement, members, resources and waits."""
