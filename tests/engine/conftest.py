"""Fixtures shared by the engine tests."""

from tests.forcing import force_auto_flags, force_quant_gemm  # noqa: F401  (fixtures of the tests here)
