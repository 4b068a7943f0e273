"""Test set-up: 8 fake CPU devices (set before jax is imported), float32 matmuls, and one persistent
compilation cache for the whole session (xdist workers and the subprocesses tests start inherit it
through the environment, so a program compiled once is not compiled again)."""
import os
from pathlib import Path

from xla_flags import TEST_COMPILE_FLAGS

# K3JAX_TEST_HOST_DEVICES changes the count (1: the one-device list scripts/gpu_check.sh runs on a
# GPU, checked on CPU with one device); the fake devices only exist on the host platform.
# Compiling is most of the suite's time: on the CPU the suite compiles with TEST_COMPILE_FLAGS
# (xla_flags.py: LLVM's expensive passes off, outputs bit for bit the same). A GPU run keeps XLA's.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={int(os.environ.get('K3JAX_TEST_HOST_DEVICES', '8'))}"
    + (f" {TEST_COMPILE_FLAGS}" if os.environ["JAX_PLATFORMS"] == "cpu" else "")
).strip()
# Several test processes compile for TPU topologies at once (xdist workers, subprocesses): libtpu
# otherwise takes an exclusive lock file and the second process aborts.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax-compilation-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

# Parity tests compare float32 numerics; the CPU default is already exact, keep it explicit.
jax.config.update("jax_default_matmul_precision", "highest")


import fcntl  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402

# Compile work of this process (tracing, lowering, XLA's compile or a persistent-cache hit), by
# function, for the timeline: each test report carries what happened since the previous report.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compiles: dict[str, list] = {}        # function -> [programs compiled, seconds]


def _on_compile_event(event, seconds, **kw):
    if event in _COMPILE_EVENTS:
        name = str(kw.get("fun_name", "?"))
        name = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
        entry = _compiles.setdefault(name, [0, 0.0])
        entry[0] += event == _COMPILE_EVENTS[2]
        entry[1] += seconds


def _on_event(event, **kw):
    if event == "/jax/compilation_cache/cache_hits":     # a program read from the persistent cache
        _compiles.setdefault("(persistent cache hits)", [0, 0.0])[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_compile_event)
jax.monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    report.k3jax_compiles = {k: v for k, v in _compiles.items()}    # serialised to the xdist controller
    _compiles.clear()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The tiny K3 trained for 4 steps in f32 by ``python -m k3jax.train`` (checkpoints at steps 2
    and 4), once per test session: under xdist the first worker trains it and the others wait on a
    lock, then everyone reads it. -> namespace(root, run, checkpoint, args): ``args`` are the
    training overrides plus base_output_directory, the key=values that load it again."""
    from helpers import TINY_TRAIN, run_tool
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tiny-run"
    root.mkdir(parents=True, exist_ok=True)
    args = TINY_TRAIN + [f"base_output_directory={root}"]
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "done").exists():
            run_tool("train", *args, "run_name=r", "steps=4", "checkpoint_period=2")
            (root / "done").write_text("ok")
        fcntl.flock(lock, fcntl.LOCK_UN)
    return types.SimpleNamespace(root=root, run=root / "r", checkpoint=root / "r" / "checkpoints" / "4", args=args)


@pytest.fixture(scope="session")
def gcs():
    """A local GCS server (the pure-Python gcp-storage-emulator, in memory; tests/gcs_server.py) for the whole session,
    with one bucket; every client of this process and of the tools it starts finds it through the
    standard variables: STORAGE_EMULATOR_HOST (gcsfs, hence etils.epath), TENSORSTORE_GCS_HTTP_URL
    (tensorstore, hence orbax). Anonymous credentials; gcsfs's bucket-type lookup (a gRPC call that
    waits 60 s on an emulator) is off. -> namespace(url, bucket="gs://k3jax-test")."""
    import socket
    import subprocess
    import sys
    import time
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "gcs_server.py"), str(port), "k3jax-test"],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, "the GCS emulator did not start"
            time.sleep(0.2)
    url = f"http://localhost:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "FSSPEC_GCS_TOKEN": "anon",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec.config  # read FSSPEC_GCS_TOKEN at its import, which may have happened already
    fsspec.config.conf.setdefault("gcs", {})["token"] = "anon"
    try:
        yield types.SimpleNamespace(url=url, bucket="gs://k3jax-test")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(10)


def pytest_terminal_summary(terminalreporter):
    """The suite's timeline at the end of its output (under xdist, from the controller's reports): worker
    time per module with its compile share, the 15 slowest tests (setup + call + teardown summed) and
    the functions compiled most, so each change sees what it cost and where compiles repeat. Also
    written to .pytest_cache/timeline.json."""
    import json
    per_test: dict[str, float] = {}
    compile_test: dict[str, float] = {}
    functions: dict[str, list] = {}             # function -> [programs, seconds] over the session
    seen = set()
    for reports in terminalreporter.stats.values():
        for r in reports:
            if not (getattr(r, "nodeid", None) and isinstance(getattr(r, "duration", None), float)):
                continue
            if (r.nodeid, r.when) in seen:      # a report listed twice (e.g. a failed call: failed + error)
                continue
            seen.add((r.nodeid, r.when))
            per_test[r.nodeid] = per_test.get(r.nodeid, 0.0) + r.duration
            for name, (n, sec) in (getattr(r, "k3jax_compiles", None) or {}).items():
                compile_test[r.nodeid] = compile_test.get(r.nodeid, 0.0) + sec
                entry = functions.setdefault(f"{name}  ({r.nodeid.split('::')[0]})", [0, 0.0])
                entry[0] += n
                entry[1] += sec
    if not per_test:
        return
    per_module: dict[str, list] = {}
    for nodeid, t in per_test.items():
        entry = per_module.setdefault(nodeid.split("::")[0], [0.0, 0.0])
        entry[0] += t
        entry[1] += compile_test.get(nodeid, 0.0)
    total, compiling = sum(per_test.values()), sum(compile_test.values())
    hits = sum(n for name, (n, _) in functions.items() if name.startswith("(persistent cache hits)"))
    programs = sum(n for name, (n, _) in functions.items() if not name.startswith("(persistent cache hits)"))
    w = terminalreporter.write_line
    terminalreporter.section("timeline")
    w(f"worker time {total:.0f} s over {len(per_test)} tests, {compiling:.0f} s of it tracing, lowering and "
      f"compiling {programs} programs ({hits} read from the persistent cache) in the test processes "
      "(subprocesses not counted); per module (s, compiling s):")
    for mod, (t, c) in sorted(per_module.items(), key=lambda kv: -kv[1][0]):
        w(f"  {t:8.1f}  {100 * t / total:4.1f}%  {c:7.1f}  {mod}")
    w("15 slowest tests (setup + call + teardown, s):")
    for nodeid, t in sorted(per_test.items(), key=lambda kv: -kv[1])[:15]:
        w(f"  {t:8.1f}  {nodeid}")
    w("15 functions with the most compile time, per module (s, programs: one per shape / setting compiled):")
    for name, (n, sec) in sorted(functions.items(), key=lambda kv: -kv[1][1])[:15]:
        w(f"  {sec:8.1f}  {n:4d}  {name}")
    out = Path(__file__).resolve().parents[1] / ".pytest_cache" / "timeline.json"
    try:
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"worker_s": total, "compile_s": compiling, "modules": per_module,
                                   "tests": per_test, "compile_by_test": compile_test, "functions": functions},
                                  indent=1))
    except OSError:
        pass
