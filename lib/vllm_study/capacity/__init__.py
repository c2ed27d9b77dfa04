"""Capacity: the most load a server start sustains within an SLO, and its records."""
