"""TPU topologies for ahead-of-time compilation from a host without TPUs.

libtpu's compiler runs on any host: ``jax.experimental.topologies.get_topology_desc`` returns the
devices of a TPU slice that does not exist here, and ``jit(...).lower(...).compile()`` against a
mesh of them gives the real TPU executable, its memory analysis and its cost analysis.

Names accepted by :func:`resolve`:

* ``v5p-2048``, ``tpu7x-1024``, ``v6e-256``: Cloud accelerator-type style, the number counts
  TensorCores as Cloud TPU does (v5p-8 = 4 chips). v5p runs its two cores per chip as one
  "megacore" JAX device; TPU7x (Ironwood) exposes each of its two cores as a JAX device, so
  tpu7x-1024 = 512 chips = 1024 devices; v5e/v6e have one core per chip.
* ``v5p:8x8x16``, ``tpu7x:2x2x1``, ``v6e:4x4``: an explicit chip grid (libtpu's own syntax).

Per-device HBM and peak bf16 FLOP/s come from the Cloud TPU product pages; for TPU7x the per-chip
figures (192 GB, 2307 TFLOP/s bf16 dense) are split over its two devices, since each JAX device is
one TensorCore with half of the chip's HBM.
"""
from __future__ import annotations

import dataclasses
import math
import os

from k3jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation: libtpu's name, per-chip figures and JAX devices per chip."""
    name: str                 # libtpu topology prefix
    hbm_bytes_per_chip: float
    peak_tflops_per_chip: float   # dense bf16
    hbm_gbps_per_chip: float      # HBM bandwidth, GB/s
    devices_per_chip: int
    cores_per_chip: int           # TensorCores counted by the accelerator-type suffix
    dims: int                     # 3 = 3D torus slices (v5p, TPU7x); 2 = 2D (v5e, v6e)
    ici_gbps_per_chip: float = 0.0  # ICI bandwidth into one chip, one direction, GB/s (0: unknown)
    device_kinds: tuple[str, ...] = ()  # jax Device.device_kind strings of this chip (MFU on a live TPU)
    dcn_gbps_per_chip: float = 0.0  # data center network (between slices) per chip, Gbit/s (0: unknown)
    host_gbps_per_chip: float = 0.0  # PCIe link to the host's memory, one direction, GB/s (0: unknown)

    @property
    def hbm_bytes(self) -> float:
        """HBM of one JAX device."""
        return self.hbm_bytes_per_chip / self.devices_per_chip

    @property
    def peak_flops(self) -> float:
        """Dense bf16 FLOP/s of one JAX device."""
        return self.peak_tflops_per_chip * 1e12 / self.devices_per_chip

    @property
    def ici_bandwidth(self) -> float:
        """ICI bytes/s into one JAX device (its share of the chip's links, one direction)."""
        return self.ici_gbps_per_chip * 1e9 / self.devices_per_chip

    @property
    def dcn_bandwidth(self) -> float:
        """DCN bytes/s of one JAX device (its share of the chip's slice-network bandwidth); 0 when unknown."""
        return self.dcn_gbps_per_chip * 1e9 / 8 / self.devices_per_chip

    @property
    def host_bandwidth(self) -> float:
        """Host-memory bytes/s of one JAX device, one direction (its share of the chip's PCIe link); 0 when unknown."""
        return self.host_gbps_per_chip * 1e9 / self.devices_per_chip

    @property
    def hbm_bandwidth(self) -> float:
        """HBM bytes/s of one JAX device."""
        return self.hbm_gbps_per_chip * 1e9 / self.devices_per_chip


GiB = 1024 ** 3
CHIPS = {
    # ICI: half the bidirectional per-chip figure (v5p: 1200 GB/s on the Cloud TPU page = its
    # 4800 Gbps; TPU7x: 1.2 TB/s bidirectional as announced; v6e 3584 Gbps; v5e 1600 Gbps).
    # DCN (between slices), Gbit/s per chip, from the "Data center network (DCN) bandwidth per chip"
    # rows of the Cloud TPU system-architecture tables: v5p 50 (cloud.google.com/tpu/docs/v5p), v6e
    # 100 and TPU7x 100 (cloud.google.com/tpu/docs/tpu7x, which lists all three); v5e and v4 unknown.
    # Host link (PCIe, what an offload to pinned_host crosses), GB/s per chip one way: "typically around
    # 1.5e10 bytes / second per chip", v6e "32GB/s, about 2x higher than v5" (How to Scale Your Model,
    # part 2, jax-ml.github.io/scaling-book/tpus); no published figure for TPU7x (left unknown).
    "v5p": Chip("v5p", 95 * GiB, 459.0, 2765.0, 1, 2, 3, 600.0, ("TPU v5p", "TPU v5"), 50.0, 15.0),
    "tpu7x": Chip("tpu7x", 192e9, 2307.0, 7370.0, 2, 2, 3, 600.0, ("TPU7x",), 100.0),
    "v6e": Chip("v6e", 32 * GiB, 918.0, 1640.0, 1, 1, 2, 448.0, ("TPU v6e", "TPU v6 lite"), 100.0, 32.0),
    "v5e": Chip("v5e", 16 * GiB, 197.0, 819.0, 1, 1, 2, 200.0, ("TPU v5e", "TPU v5 lite"), 0.0, 15.0),
    "v4": Chip("v4", 32 * GiB, 275.0, 1200.0, 1, 2, 3, 0.0, ("TPU v4",), 0.0, 15.0),
}


def chip_of_device_kind(kind: str) -> Chip | None:
    """The chip whose JAX ``device_kind`` is ``kind`` (longest matching prefix), or None."""
    names = sorted(((n, c) for c in CHIPS.values() for n in c.device_kinds), key=lambda nc: -len(nc[0]))
    return next((c for n, c in names if kind.startswith(n)), None)


@dataclasses.dataclass(frozen=True)
class Topology:
    """A resolved slice: chip kind, chip grid, and the libtpu topology string."""
    chip: Chip
    grid: tuple[int, ...]

    @property
    def libtpu_name(self) -> str:
        return f"{self.chip.name}:{'x'.join(map(str, self.grid))}"

    @property
    def num_chips(self) -> int:
        return math.prod(self.grid)

    @property
    def num_devices(self) -> int:
        return self.num_chips * self.chip.devices_per_chip

    def __str__(self) -> str:
        return f"{self.libtpu_name} ({self.num_chips} chips, {self.num_devices} devices)"


def _balanced_grid(chips: int, dims: int) -> tuple[int, ...]:
    """Smallest-surface grid of power-of-two sides (the shapes Cloud TPU offers), ascending:
    4 -> 2x2x1, 512 -> 8x8x8, 1024 -> 8x8x16."""
    if chips & (chips - 1):
        raise ConfigError(f"{chips} chips is not a power of two; give the grid explicitly, e.g. v5p:4x4x12")
    grid = [1] * dims
    for i in range(chips.bit_length() - 1):  # factors of two round-robin keep the sides within 2x
        grid[i % dims] *= 2
    # ascending, with flat axes last as Cloud TPU writes them: 2x2x1, not 1x2x2
    return tuple(sorted(g for g in grid if g > 1)) + (1,) * grid.count(1)


def resolve(name: str) -> Topology:
    """'v5p-2048' | 'tpu7x-1024' | 'v5p:2x2x1' | 'v6e:4x4' -> Topology (validated)."""
    raw = name.strip()
    low = raw.lower()
    if ":" in low:
        kind, grid_s = low.split(":", 1)
        chip = CHIPS.get(kind)
        if chip is None:
            raise ConfigError(f"topology '{raw}': unknown chip '{kind}'; known: {', '.join(CHIPS)}")
        try:
            grid = tuple(int(x) for x in grid_s.split("x"))
        except ValueError:
            raise ConfigError(f"topology '{raw}': grid must look like 2x2x1") from None
        if len(grid) != chip.dims or min(grid) < 1:
            raise ConfigError(f"topology '{raw}': {chip.name} grids have {chip.dims} positive dimensions")
        return Topology(chip, grid)
    kind, _, count = low.rpartition("-")
    chip = CHIPS.get(kind)
    if chip is None or not count.isdigit():
        raise ConfigError(f"topology '{raw}': expected <chip>-<cores> (e.g. v5p-2048, tpu7x-1024) or "
                          f"<chip>:<grid> (e.g. v5p:2x2x1); chips: {', '.join(CHIPS)}")
    cores = int(count)
    if cores % chip.cores_per_chip or cores == 0:
        raise ConfigError(f"topology '{raw}': {chip.name} has {chip.cores_per_chip} cores per chip; "
                          f"{cores} is not a multiple")
    chips = cores // chip.cores_per_chip
    return Topology(chip, _balanced_grid(chips, chip.dims))


def _harmless_env() -> None:
    """libtpu reads these at load; set placeholders so a CPU host can describe TPU slices. Compiling
    needs no chip, so the single-user lockfile (/tmp/libtpu_lockfile) is waived: several compiles
    (tests, a planner, another shell) may then run side by side."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def devices(topo: Topology, num_slices: int = 1):
    """The (virtual) TPU devices of ``num_slices`` slices of ``topo`` (each device carries its
    ``slice_index``); raises RuntimeError when libtpu is unavailable."""
    _harmless_env()
    from jax.experimental import topologies  # lazy: only ahead-of-time compiles need it (after _harmless_env)
    extra = {"num_slices": num_slices} if num_slices > 1 else {}
    try:
        desc = topologies.get_topology_desc(topology_name=topo.libtpu_name, platform="tpu", **extra)
    except Exception as e:  # libtpu missing, or a grid libtpu rejects: both end the run
        raise RuntimeError(f"cannot describe TPU topology {topo.libtpu_name}: {str(e).splitlines()[0]}") from e
    devs = list(desc.devices)
    if len(devs) != topo.num_devices * num_slices:
        raise RuntimeError(f"libtpu gave {len(devs)} devices for {num_slices} x {topo.libtpu_name}, expected "
                           f"{topo.num_devices * num_slices}")
    return devs


def libtpu_available() -> bool:
    """True when the TPU compiler plugin can be loaded (tests skip otherwise)."""
    try:
        devices(resolve("v5p:2x2x1"))
        return True
    except (RuntimeError, ImportError):
        return False
