import pytest

from batchserve.layers import kernels
from tests.forcing import (  # noqa: F401  (fixtures of the tests here)
    force_gemm,
    force_lora_path,
    force_prefill,
    force_prefill_kernel,
    force_quant_gemm,
    force_small_gemm,
)


@pytest.fixture(scope="session")
def native_kernels():
    """The compiled native kernels, built (or found in the on-disk cache) once per session when a test first asks;
    the test is skipped where they cannot be built."""
    native = kernels.load()
    if native is None:
        pytest.skip("native kernels not built here")
    return native
