"""Load a built extension under the running torch and print torch's version and every op it
registered in torch.ops.mla_backend with its schema; exit 1 when it does not load or registers
nothing. No GPU needed (nothing runs).

    python scripts/extension_ops.py [path/to/_C.abi3.so]   # default: the package's extension
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mla_backend import _extension  # noqa: E402  (the repository root, put on the path above)


def main() -> int:
    if len(sys.argv) > 1:
        os.environ["MLA_BACKEND_EXTENSION"] = sys.argv[1]
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) from "
          f"{os.path.dirname(torch.__file__)}")
    print(f"extension {_extension.extension_path()}")
    if not _extension.load():
        print(f"not loaded: {_extension.load_error()}")
        return 1
    schemas = _extension.registered_schemas()
    for schema in schemas.values():
        print(f"  {schema}")
    if not schemas:
        print("loaded, but no op is registered in torch.ops.mla_backend")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
