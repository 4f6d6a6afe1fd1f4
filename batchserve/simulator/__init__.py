"""The real scheduler and KV cache manager (batchserve/core) on a virtual clock, with step times from a profile:
capacity planning and tuning without running a model. See docs/SIMULATOR.md."""
