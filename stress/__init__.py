"""Reliability loops kept out of CI: ``python -m stress`` (``make stress``) and ``python -m stress.chaos``
(``make chaos``)."""
