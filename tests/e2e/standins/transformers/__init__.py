"""Import-only stand-in for ``transformers`` (see ../README.md): Megatron-DeepSpeed's
``megatron/tokenizer/tokenizer.py`` imports ``AutoTokenizer`` at module level, used only by its HFTokenizer."""

from _unavailable import module_getattr

__version__ = "0.0.0+devshim.standin"
__getattr__ = module_getattr(__name__)
