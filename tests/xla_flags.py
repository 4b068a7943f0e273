"""XLA flags the test suite compiles with (tests/conftest.py adds them to XLA_FLAGS; helpers.tool_env
and the tests that start a tool with their own XLA_FLAGS pass them on). jax-free, so conftest can
import it before jax.

``--xla_llvm_disable_expensive_passes=true``: XLA's HLO passes run as for users, and LLVM skips its
expensive optimisation passes on the code XLA emits. Compiling is most of the suite's time; the
programs the tests compile most compile in 0.90-0.99x the time and compute bit for bit what the
default flags compute (benchmarks/compile_flags.py runs them both ways and compares every
output; docs/benchmarks.md has its table). XLA:CPU's -O0 (--xla_backend_optimization_level=0)
is not used: it changes the HLO passes and the numerics (the Kimi Linear tiny's float64 parity went
from 1.1e-6 to 1.3e-5, over its bound)."""
TEST_COMPILE_FLAGS = "--xla_llvm_disable_expensive_passes=true"
