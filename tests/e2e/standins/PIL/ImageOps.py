"""Stand-in for ``PIL.ImageOps``: every name is a placeholder that raises when used."""

from _unavailable import module_getattr

__getattr__ = module_getattr(__name__)
