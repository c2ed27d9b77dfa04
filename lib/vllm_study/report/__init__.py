"""What a run shows: the report, its figures, the comparison of two runs, the export."""
