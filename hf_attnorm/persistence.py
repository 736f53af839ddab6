"""Saving and verifying checkpoints (filled in by the persistence issue)."""

from __future__ import annotations

from typing import Any

from torch import nn


def finalize_saved(model: nn.Module, save_directory: Any, kwargs: dict) -> None:
    """Called after ``save_pretrained``."""


def verify_loaded(model: nn.Module, path: Any, kwargs: dict) -> None:
    """Called after ``from_pretrained``."""
