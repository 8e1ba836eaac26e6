"""Sparse prefill side by side (ours vs FlashMLA): see bench/sparse.py.

    python -m bench.sparse_prefill [--quick] [--out DIR]
"""

import sys

from bench import sparse

if __name__ == "__main__":
    sys.exit(sparse.main("prefill"))
