import subprocess
import sys


def test_core_does_not_import_torch():
    code = (
        "import sys; import batchserve.core.scheduler, batchserve.core.kv_cache_manager, batchserve.core.block_pool, "
        "batchserve.core.request_queue, batchserve.core.outputs, batchserve.core.build, batchserve.config, batchserve.request; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_classifying_engine_errors_imports_no_engine():
    """The body-parser child (entrypoints/openai/bodies.py) and every front end classify engine failures: that takes
    the error classes only, not the engine's modules (torch and the model loader: seconds of CPU per process)."""
    code = (
        "import sys; import batchserve.serving.errors, batchserve.entrypoints.openai.bodies; "
        "heavy = [m for m in ('torch', 'batchserve.engine.llm_engine', 'batchserve.models.loader') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_api_server_process_imports_no_torch():
    """The API server process (its engine core runs elsewhere) and the Ray ingress serve HTTP and gRPC, tokenize and
    check requests: torch and xgrammar (seconds of CPU at every server start) stay in the engine's processes."""
    code = (
        "import sys; import batchserve.entrypoints.openai.launch, batchserve.distributed.ingress; "
        "heavy = [m for m in ('torch', 'xgrammar', 'batchserve.models.loader') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
