"""Over a whole run: intervals, comparisons, the noise floor, and the decision."""
