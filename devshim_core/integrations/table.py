"""The ordered table of integrations the session walks: devshim's own, then third parties' (the
``devshim.integrations`` entry-point group). Listing it applies nothing."""

from __future__ import annotations

import importlib.metadata as metadata

from devshim_core import log
from devshim_core.integrations.base import Integration

ENTRY_POINT_GROUP = "devshim.integrations"


def builtin() -> list[Integration]:
    """devshim's own, in the order they install: torch.distributed's job sets, the CUDA redirect, then the frameworks
    (Megatron needs the redirect applied before it), then the checkpoints both frameworks save and load, then HF
    Accelerate's and transformers' device choice, and last ``devshim compare``'s recorder (it hooks what the others
    set up)."""
    from devshim_core.compare.integration import INTEGRATION as COMPARE
    from devshim_core.integrations.checkpoints.integration import INTEGRATION as CHECKPOINTS
    from devshim_core.integrations.cuda_redirect.integration import INTEGRATION as CUDA_REDIRECT
    from devshim_core.integrations.deepspeed.integration import INTEGRATION as DEEPSPEED
    from devshim_core.integrations.huggingface.integration import INTEGRATION as HUGGINGFACE
    from devshim_core.integrations.megatron.integration import INTEGRATION as MEGATRON
    from devshim_core.integrations.torch_distributed.integration import INTEGRATION as TORCH_DISTRIBUTED

    return [TORCH_DISTRIBUTED, CUDA_REDIRECT, DEEPSPEED, MEGATRON, CHECKPOINTS, HUGGINGFACE, COMPARE]


def third_party(taken: set[str]) -> list[Integration]:
    """The integrations other distributions register. One that fails to load, is not an :class:`Integration` or
    takes a name already used is left out, with a warning naming its entry point: it must not stop devshim."""
    found = []
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
        try:
            integration = ep.load()
        except Exception as exc:
            log.logger().warning(f"integration {ep.name} ({ep.value}) failed to load and is left out: "
                                 f"{type(exc).__name__}: {exc}")
            continue
        if not isinstance(integration, Integration):
            log.logger().warning(f"integration {ep.name} ({ep.value}) is a {type(integration).__name__}, not a "
                                 "devshim_core.integrations.base.Integration; it is left out")
        elif integration.name in taken:
            log.logger().warning(f"integration {ep.name} ({ep.value}) is named {integration.name!r}, which another "
                                 "integration has; it is left out")
        else:
            found.append(integration)
            taken.add(integration.name)
    return found


def load() -> list[Integration]:
    """Every integration, in install order."""
    own = builtin()
    return own + third_party({i.name for i in own})
