"""Two ranks on two different plugins, as on nodes with different devshim plugins installed (``test_plugin_agreement``).

Rank 0 keeps the job's ``DEVSHIM_PLUGIN``; rank 1 selects the one named by ``--rank1-plugin``. Both then
initialize the same gloo process group, as a script that names its backend does.
"""

import os
import sys

if os.environ.get("LOCAL_RANK") == "1":  # before devshim selects: this rank's "node" has another plugin
    os.environ["DEVSHIM_PLUGIN"] = sys.argv[sys.argv.index("--rank1-plugin") + 1]

import devshim_core.auto  # noqa: F401, I001 - devshim first, as in a user script

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
print(f"rank {dist.get_rank()} passed the barrier", flush=True)
