"""A study as written: the study file's models, the grid of points, the models and
traces it names, and its estimated wall time."""
