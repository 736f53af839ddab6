"""Which transformers versions the integration runs on, and how it stays out of the way of the others.

Supported: ``MIN_TRANSFORMERS`` and newer (tested: ``MIN_TRANSFORMERS`` and ``TESTED_NEWEST`` in CI; 5.5.4, 5.12.1
and 5.22.2 by hand). Older versions lack what the integration relies on (5.3: GPT-2's attention module has no
``scaling`` attribute, so its per-head values could not be created at build time; < 5.3: other signatures of the
private methods hooked). There ``register()`` installs no hook on ``PreTrainedModel`` except a guard on
``post_init`` (a public method with no arguments since transformers 4.0) that refuses models using our names with
an error saying which versions work, and registers our names with a function that raises the same error: models
that do not use our names behave exactly as without ``import hf_attnorm``.

Every private transformers internal the integration touches is listed in docs/internals.md with the guard.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import transformers

from ..registry import AttnormError

#: the lowest transformers version hf_attnorm supports (tested in CI's second environment)
MIN_TRANSFORMERS = "5.4.0"
#: the newest version the test suite ran on (CI's main environment); newer ones are allowed, not yet tested
TESTED_NEWEST = "5.23.0"


def release(version: str) -> tuple[int, int, int]:
    """``"5.4.0"`` -> (5, 4, 0); pre-releases and local tags count as their release (``"5.24.0.dev0"`` -> 5.24.0)."""
    m = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"not a version number: {version!r}")
    return tuple(int(x or 0) for x in m.groups())  # type: ignore[return-value]


def transformers_version_string() -> str:
    return str(transformers.__version__)


def unsupported_reason(version: str | None = None) -> str | None:
    """None when ``version`` (default: the installed transformers, read at call time) is supported, else why not."""
    v = version if version is not None else transformers.__version__
    if release(v) < release(MIN_TRANSFORMERS):
        return (f"hf_attnorm needs transformers >= {MIN_TRANSFORMERS} (tested up to {TESTED_NEWEST}); this is "
                f"transformers {v}. Upgrade with pip install 'transformers>={MIN_TRANSFORMERS}'")
    return None


def refusing_forward(name: str, reason: str) -> Callable[..., Any]:
    """The attention function registered for ``name`` on an unsupported transformers: raises ``reason``."""

    def refuse(module: Any, *args: Any, **kwargs: Any) -> Any:
        raise AttnormError(f"attention implementation {name!r}: {reason}")

    refuse.__name__ = f"hf_attnorm_{name}_unsupported"
    return refuse


def accepts(func: Callable[..., Any], *names: str) -> bool:
    """Whether ``func`` takes every keyword in ``names`` (or ``**kwargs``): hooks pass only what the hooked
    version accepts, so one wrapper serves every signature."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return all(n in params for n in names)


def hook(owner: type, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]],
         *, classmethod_: bool = False) -> bool:
    """Replace ``owner.attr`` by ``make(original)`` if ``owner`` defines it; False (nothing replaced) otherwise."""
    orig = inspect.getattr_static(owner, attr, None)
    if orig is None:
        return False
    func = orig.__func__ if isinstance(orig, (classmethod, staticmethod)) else orig
    new = functools.wraps(func)(make(func))
    setattr(owner, attr, classmethod(new) if classmethod_ else new)
    return True
