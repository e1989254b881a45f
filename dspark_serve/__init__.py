"""dspark-serve: a DSpark draft and a Qwen3/Qwen2 target for lossless speculative decoding."""

import os as _os

__version__ = "0.1.0"

# In a source checkout the subpackages are the top-level folders (models/, engine/, ...): let them import
# as dspark_serve.<folder> without an install too (Ray workers and GPU hosts that start in the repo root).
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "engine")):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821
