"""Does the wheel list of scripts/gpu_wheels.sh cover every import of scripts/gpu_check.sh's GPU path?

Run by ``scripts/gpu_check.sh --dry-run`` (CI) with the project's venv, no wheels needed:

1. The files the check runs (the benchmark scripts, the one-device test list, tests' helpers) and
   every module of k3jax / conversion / the benchmarks they import, at any depth (function-level
   imports too: they run on the GPU path), are parsed (ast), never imported.
2. Each package the wheel list carries that is installed here is followed the same way, but only
   through its module-level imports (what importing it runs), skipping imports guarded by
   ``try: ... except ImportError``, ``if TYPE_CHECKING:`` and ``if sys.platform ...``, and modules not
   installed here (the package imports here without them, so only under a condition, as flax's flaxlib).
3. Every third-party top-level module found must belong to a distribution that is preinstalled on
   the GPU image (IMAGE below, from the device docs' package list) or in the wheel list (its names in
   scripts/gpu_wheels.sh, its versions uv.lock's); and every
   requirement of a carried package on an image package whose image version is known (IMAGE_VERSIONS)
   must accept that version, or the package must travel too (transformers >= 5.24 needs a newer
   huggingface-hub than the image's).

    .venv/bin/python scripts/gpu_imports.py benchmarks/train_step.py ... -- tests/test_x.py ...
Prints what it found; exits 1 naming each module or requirement not covered.
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import os
import re
import sys

import lock_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The GPU image's Python packages (device docs, KINDS.md, read 2026-11-17), normalised names.
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split())
# Versions on the image that the device docs give (KINDS.md's pip list row).
IMAGE_VERSIONS = {"huggingface-hub": "1.33.0", "jax": "0.11.2", "jaxlib": "0.11.2", "numpy": "2.5.2",
                  "safetensors": "0.8.0", "tiktoken": "0.14.0", "tokenizers": "0.23.2", "torch": "2.11.0",
                  "transformers": "5.17.0", "triton": "3.6.0", "jaxtyping": "0.3.11", "accelerate": "1.15.0"}
# Top-level modules of packages not installed here (torch-side), and a few whose name differs.
MODULE_DIST = {"torch": "torch", "triton": "triton", "fla": "fla-core", "yaml": "pyyaml", "tensorboardX": "tensorboardx",
               "google": "protobuf", "jaxlib": "jaxlib", "pytest": "pytest", "_pytest": "pytest"}
LOCAL = {"k3jax": os.path.join(ROOT, "src", "k3jax"), "conversion": os.path.join(ROOT, "conversion")}
LOCAL_DIRS = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_list() -> dict[str, str]:
    """scripts/gpu_wheels.sh's NAMES at the versions uv.lock pins -> {normalised name: version}."""
    return lock_tool.gpu_wheels()


def _guarded(node, parents) -> bool:
    """Inside ``if TYPE_CHECKING`` or a ``try`` that catches ImportError / Exception."""
    for p in parents:
        if isinstance(p, ast.If) and any(w in ast.unparse(p.test) for w in ("TYPE_CHECKING", "sys.platform")):
            return True                       # type-checking only, or another platform's branch
        if isinstance(p, ast.Try):
            caught = " ".join(ast.unparse(h.type) for h in p.handlers if h.type is not None)
            if any(e in caught for e in ("ImportError", "ModuleNotFoundError", "Exception")) or any(
                    h.type is None for h in p.handlers):
                return True
    return False


def imports_of(path: str, package: str | None, module_level_only: bool) -> set[str]:
    """Absolute dotted names imported by one file (relative ones resolved against ``package``)."""
    try:
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
    except (SyntaxError, UnicodeDecodeError):
        return set()
    out: set[str] = set()

    def visit(node, parents):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)) and module_level_only \
                and not isinstance(node, ast.ClassDef):
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not (module_level_only and _guarded(node, parents)):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            else:
                base = node.module or ""
                if node.level:
                    parts = (package or "").split(".")
                    parts = parts[:len(parts) - node.level + 1] if node.level > 1 else parts
                    base = ".".join([*parts, *([base] if base else [])])
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
        for child in ast.iter_child_nodes(node):
            visit(child, parents + [node])

    visit(tree, [])
    return {n for n in out if n}


def local_file(name: str) -> tuple[str, str] | None:
    """(file, package) of a module of this repo: k3jax.*, conversion.*, or a script beside the entries."""
    top, *rest = name.split(".")
    if top in LOCAL:
        base = os.path.join(LOCAL[top], *rest)
    elif not rest and any(os.path.exists(os.path.join(d, top + ".py")) for d in LOCAL_DIRS):
        d = next(d for d in LOCAL_DIRS if os.path.exists(os.path.join(d, top + ".py")))
        return os.path.join(d, top + ".py"), ""
    else:
        return None
    if os.path.isdir(base):
        return os.path.join(base, "__init__.py"), name
    if os.path.exists(base + ".py"):
        return base + ".py", name.rpartition(".")[0]
    return None


def installed_file(name: str) -> tuple[str, str] | None:
    """(file, package) of an installed module, found on disk without importing anything."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)            # a top-level find_spec imports nothing
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    if not spec.submodule_search_locations:
        return (spec.origin, "") if spec.origin.endswith(".py") and not rest else None
    for d in spec.submodule_search_locations:
        base = os.path.join(d, *rest)
        if os.path.exists(os.path.join(base, "__init__.py")):
            return os.path.join(base, "__init__.py"), name
        if rest and os.path.exists(base + ".py"):
            return base + ".py", name.rpartition(".")[0]
    return None


def main(argv: list[str]) -> int:
    wheels = wheel_list()
    covered = IMAGE | set(wheels)
    dists = {m: [norm(d) for d in ds] for m, ds in md.packages_distributions().items()}
    entries = [os.path.abspath(p) for p in argv if p != "--"]
    seen_files: set[str] = set()
    third: dict[str, str] = {}                         # top-level module -> first file importing it
    todo = [(p, "", False) for p in entries]
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    while todo:
        path, pkg, module_only = todo.pop()
        if path in seen_files:
            continue
        seen_files.add(path)
        for name in sorted(imports_of(path, pkg, module_only)):
            top = name.split(".")[0]
            if top in stdlib:
                continue
            loc = local_file(name)
            if loc:
                todo.append((*loc, False))
                continue
            if top in LOCAL or local_file(top):
                continue
            if module_only and importlib.util.find_spec(top) is None:
                continue       # a carried package imports it only conditionally: it imports here without it
            third.setdefault(top, os.path.relpath(path, ROOT) if path.startswith(ROOT) else path)
            ds = dists.get(top) or [norm(MODULE_DIST.get(top, top))]
            if any(d in wheels for d in ds):       # follow what importing a carried package runs
                f = installed_file(name) or installed_file(top)
                if f:
                    todo.append((*f, True))
    missing = []
    for top, where in sorted(third.items()):
        ds = dists.get(top) or [norm(MODULE_DIST.get(top, top))]
        if not any(d in covered for d in ds):
            missing.append(f"module {top!r} (distribution {', '.join(ds)}; imported by {where}) is neither on the "
                           "GPU image nor in scripts/gpu_wheels.sh's WHEELS")
    # Requirements of carried packages on image packages of a known version.
    from packaging.requirements import Requirement
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    unchecked = []
    for dist, version in sorted(wheels.items()):
        try:
            reqs = md.requires(dist) or []
            here = md.version(dist)
        except md.PackageNotFoundError:
            unchecked.append(dist)
            continue
        if here != version:
            missing.append(f"{dist}=={version} in the wheel list, but {here} here: CI tests another version")
        for r in map(Requirement, reqs):
            if r.marker is not None and not r.marker.evaluate(env):
                continue
            name = norm(r.name)
            if name in wheels:
                if not r.specifier.contains(wheels[name], prereleases=True):
                    missing.append(f"{dist} needs {r}, the wheel list has {name}=={wheels[name]}")
            elif name in IMAGE_VERSIONS and not r.specifier.contains(IMAGE_VERSIONS[name], prereleases=True):
                missing.append(f"{dist} needs {r}; the image has {name} {IMAGE_VERSIONS[name]}: add it to the wheels")
    print(f"gpu imports: {len(seen_files)} files walked, third-party top-level modules: {', '.join(sorted(third))}")
    print(f"gpu imports: wheel list {', '.join(f'{k}=={v}' for k, v in sorted(wheels.items()))}"
          + (f"; requirements not checked (not installed here): {', '.join(unchecked)}" if unchecked else ""))
    for m in missing:
        print(f"error: {m}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
