"""A plugin whose import fails, as a vendor plugin does when its SDK's shared library is missing."""

raise ImportError("libvendor_runtime.so.3: cannot open shared object file")
