"""Which platforms jax starts on, chosen when ``import k3jax`` runs, before any tool touches a device
(``quiet_cpu_start``): a host with libtpu installed and no TPU starts on its CPU without libtpu's
start-up errors. Imported by ``k3jax/__init__.py``, so it imports no k3jax module, and jax only
inside the functions that need it: where nothing is to be chosen (no libtpu), ``import k3jax``
does not import jax at all.
"""
from __future__ import annotations

import glob
import importlib.util
import os

# Variables a TPU VM or a GKE TPU pod sets for libtpu (and jax's own switch): a user who sets one
# means to use a TPU. (TPU_SKIP_MDS_QUERY is not one: jax sets it itself where it finds no TPU.)
TPU_ENV_VARS = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_TOPOLOGY",
                "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_PROCESS_BOUNDS",
                "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_VISIBLE_CHIPS", "JAX_FORCE_TPU_INIT")
NVIDIA_DEVICES = ("dev/nvidia0", "dev/nvidiactl", "dev/dxg")


def tpu_chips() -> int:
    """TPU chips on this host's PCI bus, counted as jax counts them before it starts libtpu."""
    # lazy: keeps `import k3jax` free of jax where nothing is to be chosen (module docstring)
    from jax._src import hardware_utils
    return hardware_utils.num_available_tpu_chips_and_device_id()[0]


def tpu_visible(environ=os.environ, root: str = "/", chips=tpu_chips) -> bool:
    """Whether this host shows a TPU: a TPU environment variable, a /dev/accel* device (TPU v2-v4)
    or TPU chips on the PCI bus (every generation; v5 and later attach through vfio)."""
    if any(v in environ for v in TPU_ENV_VARS):
        return True
    return bool(glob.glob(os.path.join(root, "dev", "accel*"))) or chips() > 0


def default_platforms(environ=os.environ, root: str = "/", chips=tpu_chips) -> str | None:
    """The JAX_PLATFORMS a tool sets for itself when the user set none, or None to leave jax's own
    choice: with libtpu installed and no TPU on the host, jax would start libtpu anyway (its start-up
    errors on stderr and ~0.5 s) before falling back, so "cpu", or "cuda,cpu" where an NVIDIA GPU
    and jax's CUDA plugin are both present. A host with a TPU, or without libtpu, is left alone, as
    is one with a GPU but no CUDA plugin (jax then says so itself)."""
    if environ.get("JAX_PLATFORMS") or environ.get("JAX_PLATFORM_NAME"):
        return None
    if not _installed("libtpu") or tpu_visible(environ, root, chips):
        return None
    if any(os.path.exists(os.path.join(root, d)) for d in NVIDIA_DEVICES):
        return "cuda,cpu" if any(_installed(f"jax_plugins.xla_cuda{v}") for v in (13, 12)) else None
    return "cpu"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:      # its parent package is missing
        return False


def quiet_cpu_start() -> None:
    """Set JAX_PLATFORMS to ``default_platforms()`` when the user set none (``import k3jax`` calls
    this, before any tool touches a device): a CPU host with libtpu installed starts quietly on its
    CPU, while a TPU host still uses its TPU. Ahead-of-time TPU compiles (k3jax.compile / plan) load
    libtpu for the topology themselves and need no TPU backend. Too late once jax's backends are up."""
    platforms = default_platforms()
    if platforms is None:
        return
    import jax                   # already imported by tpu_chips; it read its environment then
    from jax._src import xla_bridge  # lazy, as jax above (module docstring)
    if xla_bridge.backends_are_initialized():
        return
    jax.config.update("jax_platforms", platforms)
    os.environ["JAX_PLATFORMS"] = platforms      # and for the processes this one starts
