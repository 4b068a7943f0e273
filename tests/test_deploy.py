"""The launch recipes stay valid: the GKE JobSet manifest's container arguments load through
k3jax.config (keys, types, gs:// paths) and give a mesh that fits the slice it asks for."""
from pathlib import Path

import yaml

from k3jax import config as C
from k3jax.topology import resolve

REPO = Path(__file__).resolve().parents[1]


def test_jobset_args_are_a_valid_config_for_the_slice():
    doc = yaml.safe_load((REPO / "deploy" / "jobset-v5p.yaml").read_text())
    pod = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "k3jax.train"]
    args = container["args"]
    assert args[0] == "configs/base.yml"
    cfg = C.load(REPO / args[0], args[1:])
    assert cfg.mesh.enable_distributed and cfg.model_name == "kimi-k3"
    topo = pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    devices = resolve(f"v5p:{topo}").num_devices
    hosts = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"]
    assert hosts * container["resources"]["limits"]["google.com/tpu"] == devices   # one pod per host
    C.validate(cfg, num_devices=devices)        # the mesh fills the slice
    assert pod["terminationGracePeriodSeconds"] >= 60


def test_multi_slice_aot_devices_make_a_hybrid_mesh():
    """compile_topology_num_slices=2: libtpu's virtual devices of two v5p:2x2x1 slices, and the
    mesh puts dcn_data_parallelism across them (ici_* within each)."""
    import pytest

    from k3jax import topology as TP
    from k3jax.compile import topology_mesh
    if not TP.libtpu_available():
        pytest.skip("libtpu is not installed")
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", "compile_topology=v5p:2x2x1",
                                               "compile_topology_num_slices=2", "dcn_data_parallelism=2"])
    _, mesh = topology_mesh(cfg, cfg.compile.compile_topology)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "context": 1, "expert": 1, "tensor": 1}
    for i in range(2):   # each data row is one slice
        assert {d.slice_index for d in mesh.devices[i].flat} == {i}
    with pytest.raises(C.ConfigError, match="dcn parallelism product 1 != number of slices 2"):
        topology_mesh(C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", "compile_topology_num_slices=2"]),
                      "v5p:2x2x1")
