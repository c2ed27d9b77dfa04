"""The requests a round sends: synthetic workloads, trace replay, arrival schedules."""
