"""devshim's benchmarks against its peers: ``make bench`` (``python -m bench``) runs them all."""
