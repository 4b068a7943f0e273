"""uv.lock: made from setup.py, inside its ranges, and what this test session runs on (scripts/setup.sh
installs exactly it); the GPU wheel list takes its versions from it."""
import importlib.metadata as md
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import lock_tool  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))


def test_lock_matches_setup_ranges():
    assert lock_tool.check() == []


def test_check_names_a_moved_range_and_an_outside_pin(tmp_path):
    """The check fails, naming the package, when setup.py's range changes after the lock was made, and
    when the lock pins a version outside a range."""
    setup = tmp_path / "setup.py"
    setup.write_text((ROOT / "setup.py").read_text().replace('"flax>=0.12.8"', '"flax>=0.13"'))
    errors = lock_tool.check(str(ROOT / "uv.lock"), str(setup))
    assert any("flax" in e and "make lock" in e for e in errors), errors
    assert any("flax==" in e and "outside" in e for e in errors), errors
    lock = tmp_path / "uv.lock"
    shutil.copy(ROOT / "uv.lock", lock)
    jax = lock_tool.locked_versions()["jax"][0]
    lock.write_text(lock.read_text().replace(f'name = "jax"\nversion = "{jax}"', 'name = "jax"\nversion = "0.12.1"'))
    errors = lock_tool.check(str(lock), str(ROOT / "setup.py"))
    assert errors and all(e.startswith("uv.lock pins jax==0.12.1, outside setup.py's jax") for e in errors), errors
    assert len(errors) == 3, errors          # install_requires, and the tpu and cuda extras' jax[...]


def test_this_environment_is_the_lock():
    """Every locked package installed here is at the locked version (a .venv made by scripts/setup.sh)."""
    locked = lock_tool.locked_versions()
    off = {}
    for dist in md.distributions():
        name = lock_tool.norm(dist.metadata["Name"])
        if name in locked and dist.version not in locked[name]:
            off[name] = (dist.version, locked[name])
    assert not off, f"installed versions differ from uv.lock (run make setup): {off}"


def test_gpu_wheels_come_from_the_lock():
    wheels = lock_tool.gpu_wheels()
    assert set(wheels) == {lock_tool.norm(n) for n in lock_tool.gpu_wheel_names()}
    locked = lock_tool.locked_versions()
    assert all(v in locked[k] for k, v in wheels.items())
