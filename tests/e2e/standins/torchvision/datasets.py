"""Stand-in for ``torchvision.datasets``: ``VisionDataset`` is subclassed at import time, so it is a real class."""

from _unavailable import module_getattr


class VisionDataset:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision.datasets.VisionDataset is an import-only stand-in (tests/e2e/standins)")


__getattr__ = module_getattr(__name__)
