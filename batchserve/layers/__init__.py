"""The building blocks models are made of: paged attention (and its native kernels), RoPE, norms, linear, MLP."""
