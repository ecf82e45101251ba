"""devshim's DeepSpeed integration: an accelerator on the facade, op builders backed by plugin kernels."""
