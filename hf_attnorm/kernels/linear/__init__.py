"""Linear attention (``normalizers/linear.py``, whose ``reference`` is the naive quadratic form): ``chunked.py``
(running sums over query chunks, path ``linear_chunked``) and ``recurrent.py`` (one decode step from the state a
cache keeps, path ``linear_recurrent``)."""

from . import chunked, recurrent  # noqa: F401  (the paths register at import)
