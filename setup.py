"""k3jax: JAX/TPU training and decoding for Kimi K3 and its family.

Name, version and Python come from pyproject.toml; the dependency ranges are here, and uv.lock pins
them for the repo's own commands (`make lock` refreshes it; tests/test_lock.py checks it against
these ranges). `pip install -e .` outside those commands still resolves the ranges.
"""
from setuptools import find_packages, setup

setup(
    package_dir={"": "src", "conversion": "conversion"},
    packages=find_packages("src") + ["conversion"],
    install_requires=[
        # below 0.12.1: with it (2026-12-06) tokamax 0.0.17's Mosaic loss kernel no longer compiles for
        # TPU ("Unsupported comparison direction: une") and a 2-process CPU pod (gloo) hangs in its first
        # train step (tests/test_multihost.py); 0.12.0.1 is what the tests pass with
        "jax>=0.11.2,<0.12.1",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "grain>=0.2.18",
        "tokamax>=0.0.12",
        "tiktoken>=0.14.0",
        "transformers>=5.24.0",
        "safetensors>=0.6",
        "pyyaml>=6.0",
        "numpy>=2.0",
        "ml_dtypes>=0.5",
        "jinja2>=3.1.6",       # transformers' chat-template renderer
        "pyarrow>=18",         # Parquet data source
        "tensorboardX>=2.6",   # TensorBoard scalars
        "etils[epath]>=1.7",   # gs:// paths (k3jax.paths), as orbax uses them
        "gcsfs>=2024.2",       # gs:// for etils.epath and the data sources' ranged reads
        "psutil>=5.9",
        "tensorstore>=0.1.60",  # streaming converter writes orbax leaves slice by slice
        "fastapi>=0.165.0",    # k3jax.serve: the OpenAI-compatible HTTP API
        "uvicorn>=0.54.0",     # k3jax.serve: the ASGI server
        "prometheus-client>=0.26.0",  # k3jax.serve: /metrics
        "Pillow>=11.0",        # k3jax.data.vision_processor: image decode and bicubic resize
        "regex>=2024.11.6",    # k3jax.serve.k3_toolcalls: partial matches of a K3 tag while it streams
    ],
    extras_require={
        # libtpu gives the TPU compiler for ahead-of-time compilation tests on a CPU host.
        "dev": ["pytest>=8.0", "pytest-xdist>=3.5", "libtpu>=0.0.20", "matplotlib>=3.8",
                "openai>=3.57.0",     # the server tests talk to it with the real OpenAI client
                "lm-eval[api]>=0.4.13",   # lm-evaluation-harness against the server (no torch)
                "gcp-storage-emulator>=2026.7.19",   # a local GCS server for the gs:// tests
                "uv>=0.13.10"],       # installs the lock (scripts/setup.sh) and refreshes it (make lock)
        "tpu": ["jax[tpu]>=0.11.2,<0.12.1"],
        "cuda": ["jax[cuda13]>=0.11.2,<0.12.1"],   # NVIDIA GPUs: jax's CUDA 13 plugin with its CUDA wheels
        # the torch-side reference that scripts/gpu_check.sh runs beside k3jax's KDA (benchmarks/kda_fla.py);
        # locked so the GPU wheel list (scripts/gpu_wheels.sh) takes its versions from uv.lock too
        "fla": ["flash-linear-attention>=0.6.0"],
    },
)
