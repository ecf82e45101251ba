"""The conformance kit's checks; collected by ``pytest --devshim-plugin=NAME``."""
