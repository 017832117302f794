"""Value types every layer of the Tune layer passes (the bottom floor: imports nothing above it): the
run's bucket options, a member's join and plan, rung schedules, the chorus/* result keys, member
states as bytes, the pool's names and markers, and what a run tells its trials and buckets."""
