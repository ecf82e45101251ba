"""Stand-in for ``PIL.ImageFilter``: every name is a placeholder that raises when used."""

from _unavailable import module_getattr

__getattr__ = module_getattr(__name__)
