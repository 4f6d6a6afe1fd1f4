import subprocess
import sys


def test_core_does_not_import_torch():
    code = (
        "import sys; import batchserve.core.scheduler, batchserve.core.kv_cache_manager, batchserve.core.block_pool, "
        "batchserve.core.request_queue, batchserve.core.outputs, batchserve.core.build, batchserve.config, batchserve.request; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
