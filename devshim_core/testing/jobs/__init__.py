"""The 2-rank jobs the conformance kit launches under torchrun (scripts; a package so that wheels carry them)."""
