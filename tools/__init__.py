"""Developer tools run by ``make lint``."""
