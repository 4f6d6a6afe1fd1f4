"""`python -m batchserve.layers.kernels`: build the native CPU kernels now (set-up does, so that no test or first
request pays for it); prints where they are, or why they are not. Exits 0 either way: the kernels are optional."""

from __future__ import annotations

import logging
import sys

from batchserve.layers import kernels


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    module = kernels.load()
    if module is None:
        print("native CPU kernels: not built (see the warning above); the torch code paths run instead")
    else:
        print(f"native CPU kernels: ready ({module.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
