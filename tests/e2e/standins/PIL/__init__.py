"""Import-only stand-in for Pillow (see ../README.md): the submodules Megatron-DeepSpeed's vision code imports."""

from . import Image, ImageEnhance, ImageFilter, ImageOps  # noqa: F401
