"""The configuration search: its space, its loop and its report section."""
