"""The recorder's environment variables and defaults, importable without torch (the CLI reads them)."""

DIR, STEPS = "DEVSHIM_COMPARE_DIR", "DEVSHIM_COMPARE_STEPS"
SAMPLE, FULL = "DEVSHIM_COMPARE_SAMPLE", "DEVSHIM_COMPARE_FULL"
REFERENCE_KERNELS = "DEVSHIM_REFERENCE_KERNELS"
DEFAULT_SAMPLE = 4096  # elements per tensor: enough for the metrics to see a wrong block, bounded on any model
