"""GPU kernels (Triton): paged attention that reads the K/V pool through the block tables in place.

Triton is optional (the `gpu` extra; CUDA builds of torch ship it). Tensors on the CPU run the same kernels under
Triton's interpreter, which is how CI tests them without a GPU.
"""
