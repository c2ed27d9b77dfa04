"""The kit's vocabulary: the grid axes and the metrics, each defined once."""
