"""Import-only stand-in for ``torchvision`` (see ../README.md): ``transforms`` and ``datasets.VisionDataset``."""

from _unavailable import module_getattr

from . import datasets, transforms  # noqa: F401  (``import torchvision.transforms as T``, ``from torchvision import datasets``)

__version__ = "0.0.0+devshim.standin"
__getattr__ = module_getattr(__name__)  # ``get_image_backend`` and the like: placeholders that raise when used
