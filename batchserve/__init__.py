"""batchserve: continuous batching over a paged KV cache."""

__version__ = "0.1.0"

from batchserve.request import LoRARequest  # noqa: E402
from batchserve.sampling_params import SamplingParams  # noqa: E402

__all__ = ["SamplingParams", "LoRARequest", "LLM", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model; import it lazily so `batchserve.core` stays torch-free.
    if name == "LLM":
        from batchserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
