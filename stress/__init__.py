"""Reliability loops kept out of CI: ``python -m stress`` (``make stress``)."""
