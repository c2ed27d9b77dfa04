"""One server start measured: its rounds, the client, the server's counters, per-round
figures, and the unit of work a sweep hands an executor."""
