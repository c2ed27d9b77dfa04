"""The typed records a run folder holds, and the folder itself."""
