"""``import devshim_core.auto``: detect the device, select its plugin, patch DeepSpeed/Megatron. Idempotent.

The only devshim import with side effects. Switches: DEVSHIM_PLUGIN, DEVSHIM_DISABLED_PLUGINS,
DEVSHIM_DISABLE_PLUGIN_AUTOLOAD + DEVSHIM_PLUGINS, DEVSHIM_PATCH_DEEPSPEED, DEVSHIM_PATCH_MEGATRON.
"""

from devshim_core.session import activate

session = activate()
device = session.device
