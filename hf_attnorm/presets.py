"""Presets: the attention-implementation names a user passes as ``attn_implementation=``."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Preset:
    """A registered attention-implementation name: a normalizer, a scale and fixed option values."""

    name: str
    description: str
    settings: dict[str, Any]
