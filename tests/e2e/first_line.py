"""Run a third-party training script as if ``import devshim_core.auto`` were its first line, without editing it.

    torchrun ... tests/e2e/first_line.py [--script-dir-last] /path/to/checkout/pretrain_gpt.py --its --own --args

The script then sees what it would see if it had been launched directly with the import added:
``sys.argv[0]`` is its own path, its own directory is on ``sys.path`` (this one is not), and it runs as
``__main__``. Nothing else is imported or changed before it: the import below is the "first line".

``--script-dir-last`` puts the script's directory at the end of ``sys.path`` instead of the front. Megatron-LM
needs it: ``megatron`` is a namespace package there, and with the checkout first its ``megatron/core`` (sources
only, no compiled ``helpers_cpp``) would shadow the installed megatron-core of the same version; last, the
checkout contributes only what the installed package lacks (``megatron.training``, ``gpt_builders``...).
A checkout whose ``megatron`` is a regular package (Megatron-DeepSpeed) wins wherever it sits.
"""
# ruff: noqa: I001  (the devshim import must stay the first line)

import devshim_core.auto  # noqa: F401  (the first line; everything after it is the script's own)

import atexit
import os
import runpy
import sys


def report_platform() -> None:
    """One line a test can check: the plugin, device type and process-group backend this rank ran with."""
    import devshim_core
    import torch.distributed as dist

    session = devshim_core.active_session()
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    print(f"FIRST_LINE plugin={session.plugin} device_type={session.device_type} backend={backend}", flush=True)


def main() -> None:
    args = sys.argv[1:]
    script_dir_last = bool(args) and args[0] == "--script-dir-last"
    if script_dir_last:
        args = args[1:]
    if not args:
        raise SystemExit(f"usage: {sys.argv[0]} [--script-dir-last] SCRIPT [ARGS...]")
    script = os.path.abspath(args[0])
    sys.argv = [script, *args[1:]]
    here = os.path.dirname(os.path.abspath(__file__))
    # python puts the launched file's directory first on sys.path; make that the script's directory, as it would be
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    if script_dir_last:
        sys.path.append(os.path.dirname(script))
    else:
        sys.path.insert(0, os.path.dirname(script))
    atexit.register(report_platform)  # before the script's own handlers, so it runs after them
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
