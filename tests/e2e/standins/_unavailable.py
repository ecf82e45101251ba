"""Placeholders for names a third-party module imports but a GPT run never uses: any use raises."""


class Unavailable:
    """Stands for ``qualname``; calling it, instantiating it or reading an attribute of it raises."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def _fail(self):
        raise RuntimeError(f"{self._qualname} is an import-only stand-in (tests/e2e/standins): the real package "
                           "is not installed in this test environment")

    def __call__(self, *args, **kwargs):
        self._fail()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self._qualname}.{name}")


def module_getattr(module_name: str):
    """A module-level ``__getattr__`` that hands out placeholders for ``from module import anything``."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{module_name}.{name}")

    return __getattr__
