"""One short rank of the exit stress loop: ``examples/train_gpt.py``, unmodified, after ``import devshim_core.auto``.

``--without-settle`` (the loop's control arm) reverts devshim's exit patch first, so the loop also measures
how often a rank aborts without it. Every other argument goes to the training script.
"""

import devshim_core.auto  # noqa: I001 - first, as in a user's script

import runpy
import sys
from pathlib import Path

from devshim_core.integrations.torch_distributed.clean_exit import patch_set
from devshim_core.patching import REGISTRY

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--without-settle" in args:
        args.remove("--without-settle")
        name = patch_set(devshim_core.auto.session.device).name
        assert REGISTRY.revert(name), f"the {name!r} patch set was not applied"
    sys.argv = [str(SCRIPT), *args]
    runpy.run_path(str(SCRIPT), run_name="__main__")
