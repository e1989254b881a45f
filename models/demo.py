"""The demo pair: Qwen2.5-Coder-0.5B-Instruct (fetched into the user cache) and the DSpark drafter shipped here."""

from __future__ import annotations

from pathlib import Path

from .fetch import GGUFSource, default_cache_dir

DEMO_DRAFTER = Path(__file__).resolve().parent / "checkpoints" / "qwen2.5-coder-0.5b-dspark"
# FR-Spec token map: the 32768 target tokens most frequent in the drafter's training prompts (dspark-serve token-map)
DEMO_TOKEN_MAP = DEMO_DRAFTER / "token_map_32768.pt"


def demo_target_dir(cache_dir: str | Path | None = None) -> Path:
    """Where `dspark-serve fetch` puts the converted target (it may not exist yet)."""
    return (Path(cache_dir) if cache_dir else default_cache_dir()) / GGUFSource().out_name
