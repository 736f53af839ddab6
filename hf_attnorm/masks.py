"""From whatever mask transformers passes to the boolean keep-mask and the per-query key count n.

transformers (with our names registered in AttentionMaskInterface with ``sdpa_mask``) passes either a boolean mask
[B, 1, Lq, Lk] (True = keep) or None when nothing beyond causality is masked. With None the causal pattern is
rebuilt here, upper-left aligned like SDPA's ``is_causal`` (query i sees keys j <= i); a single query (cache decode)
sees every key. Additive float masks (eager style, 0 / finfo.min / -inf) are accepted too, but never added to the
scores: non-exponential normalizers would turn finfo.min into huge weights.

No host synchronisation: everything here is tensor ops on the mask (no ``.item()``, no ``bool(tensor)``), so a
call traces under ``torch.compile(fullgraph=True)``. Two things need the mask's values on the host, and both are done
once per mask (the same tensor object is passed to every layer of a forward, so ``build_mask_info`` keeps the last
result and returns it again to the next layer): the check that an int/float mask holds only keep/masked values
(eager CPU: a Python check with a clear error; elsewhere a device-side ``torch._assert_async``), and, only when a
path asks for it, ``MaskInfo.padding()`` (is it key padding x causal?; skipped under torch.compile).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch


class MaskError(TypeError):
    """An attention mask of an unsupported type or shape."""


@dataclasses.dataclass(eq=False)
class MaskInfo:
    """The visibility pattern of one attention call.

    keep: bool [B or 1, 1 or H, Lq or 1, Lk] (True = visible), or None for the structured cases below;
    causal: with keep None, query i sees keys j <= i (upper-left aligned); otherwise every key;
    n: float [B or 1, 1 or H, Lq], number of visible keys, clamped to >= 1 (a scale's log n stays finite);
    has_keys: bool like n, False on fully masked rows (their output is 0);
    dead: with keep given, bool [B or 1, 1, Lk, 1], True on keys no query sees (padding), else None;
    selected: keep holds a per-query key selection (``select_keys``: a sparse-attention indexer's top-k), which
    changes from one call to the next, so no state kept across calls may assume that a key visible once stays so.
    """

    keep: torch.Tensor | None
    causal: bool
    n: torch.Tensor
    has_keys: torch.Tensor
    lq: int
    lk: int
    dead: torch.Tensor | None = None
    #: (key_valid [B, Lk] bool, query_valid [B, Lq] bool, causal, offset) when known from how the mask was built
    _padding: tuple | None = None
    _padding_done: bool = False
    selected: bool = False
    _additive: dict = dataclasses.field(default_factory=dict)
    #: MaskInfos derived from this one (e.g. with memory key columns prepended), built once per mask
    derived: dict = dataclasses.field(default_factory=dict)

    @property
    def kind(self) -> str:
        """"given" (a keep-mask), "causal" or "none": what the paths' capability checks look at."""
        return "given" if self.keep is not None else ("causal" if self.causal else "none")

    def dense(self, device: torch.device | None = None) -> torch.Tensor:
        """The keep-mask materialised as bool [B or 1, 1 or H, Lq, Lk]."""
        if self.keep is not None:
            return self.keep
        device = device or self.n.device
        if self.causal:
            return causal_keep(self.lq, self.lk, device)
        return torch.ones(1, 1, 1, self.lk, dtype=torch.bool, device=device)

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """The keep-mask as an additive float mask (0 / -inf) in ``dtype``, built once per mask and dtype."""
        assert self.keep is not None
        if dtype not in self._additive:
            self._additive[dtype] = torch.zeros(self.keep.shape, dtype=dtype, device=self.keep.device).masked_fill_(
                ~self.keep, float("-inf"))
        return self._additive[dtype]

    def padding(self) -> tuple[torch.Tensor | None, torch.Tensor | None, bool, int] | None:
        """The visibility as (key_valid [B, Lk] or None, query_valid [B, Lq] or None, causal, offset) when it is
        "key padding x causal with a constant offset x fully masked rows" (query i sees key j iff key_valid[j],
        query_valid[i] and, if causal, j <= i + offset); None when it is not, or cannot be known without reading the
        mask under torch.compile. Known from shapes alone without a mask, for one query and for 2-D padding masks;
        a 4-D mask is analysed on the host once (then cached on this MaskInfo, which the layers share)."""
        if self.keep is None:
            return None, None, self.causal and self.lq > 1, 0
        if self._padding_done:
            return self._padding
        if self.keep.shape[1] != 1:
            return None
        if self.lq == 1 or self.keep.shape[2] == 1:
            return self.keep[:, 0, 0, :], None, False, 0  # every query sees the same keys
        if torch.compiler.is_compiling():
            return None
        self._padding, self._padding_done = _decompose(self.keep[:, 0], self.lq, self.lk), True
        return self._padding


def _decompose(keep: torch.Tensor, lq: int, lk: int) -> tuple | None:
    """keep [B, Lq, Lk] -> (key_valid, query_valid, causal, offset) or None; reads the mask (host sync)."""
    key_valid = keep.any(dim=1)  # [B, Lk]
    query_valid = keep.any(dim=2)  # [B, Lq]
    full = key_valid[:, None, :] & query_valid[:, :, None]
    if torch.equal(full, keep):
        return key_valid, query_valid, False, 0
    # causal with offset: the last visible key of query i is i + offset for every valid row
    last = torch.where(keep, torch.arange(lk, device=keep.device), -1).amax(dim=2)  # [B, Lq]
    rows = torch.arange(lq, device=keep.device)[None, :]
    offsets = torch.where(query_valid, last - rows, last.new_full((), -(1 << 30)))
    offset = int(offsets.max().item())
    i = torch.arange(lq, device=keep.device)[:, None]
    j = torch.arange(lk, device=keep.device)[None, :]
    if torch.equal(full & (j <= i + offset)[None], keep):
        return key_valid, query_valid, True, offset
    return None


def causal_keep(lq: int, lk: int, device: torch.device | str) -> torch.Tensor:
    """bool [1, 1, Lq, Lk]: key j visible to query i iff j <= i (SDPA's upper-left alignment)."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return (j <= i)[None, None]


_BIAS_MESSAGE = ("additive float attention masks may only hold 0 (keep) and -inf/finfo.min (masked); this one holds "
                 "other values (a position bias?), which hf_attnorm normalizers cannot apply. Pass a boolean mask.")
_INT_MESSAGE = "integer attention masks must hold only 0 (masked) and 1 (keep)"


def _check_values(ok: torch.Tensor, message: str) -> None:
    """Refuse a mask whose values are not keep/masked. Eager on CPU: a Python check raising MaskError (reading a CPU
    tensor costs no device sync); compiled or on an accelerator: a device-side assertion (no host sync)."""
    if ok.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(ok.all()):
            raise MaskError(message)
    else:
        torch._assert_async(ok.all(), message)


def _to_bool(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        # additive mask: 0 = keep; masked entries are -inf or at most half of finfo.min (eager uses finfo.min)
        masked = mask <= torch.finfo(mask.dtype).min / 2
        _check_values((mask == 0) | masked, _BIAS_MESSAGE)
        return ~masked
    if mask.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        _check_values((mask == 0) | (mask == 1), _INT_MESSAGE)
        return mask != 0
    raise MaskError(f"attention mask dtype {mask.dtype} is not supported; use bool (True = keep)")


#: the last float mask split into (keep, bias) (``_remembered``)
_LAST_SPLIT: list = [None, -1, None, None]


def _no_cache() -> bool:
    """Mask facts are not cached while tracing (nothing may persist across a graph) nor under inference_mode
    (tensors made there cannot be saved for backward by a later training step that would reuse them)."""
    return torch.compiler.is_compiling() or torch.is_inference_mode_enabled()


def _remembered(slot: list, mask: torch.Tensor, sizes: object, compute: Callable[[], Any]) -> Any:
    """``compute()``, remembered in ``slot`` ([weak reference to the mask, its version, ``sizes``, the result]) and
    given back for the same mask tensor, unchanged, with the same ``sizes``: the layers of one forward share it.
    Nothing is remembered while tracing or under inference_mode (``_no_cache``), nor for an inference tensor (no
    version counter, so an in-place change could not be noticed)."""
    if _no_cache() or mask.is_inference():
        return compute()
    ref, version, last_sizes, value = slot
    if ref is not None and ref() is mask and version == mask._version and last_sizes == sizes:
        return value
    value = compute()
    slot[:] = [weakref.ref(mask), mask._version, sizes, value]
    return value


def split_float_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An additive float mask -> (keep bool, bias float), both of its shape: entries <= finfo.min / 2 (or -inf) are
    masked (bias 0 there), the others are kept and their values are a score bias (eager attention adds them). The
    same mask tensor (unchanged) gives the same tensors back, so the layers of one forward share one keep-mask (and
    its MaskInfo). Nothing is read on the host."""

    def split() -> tuple[torch.Tensor, torch.Tensor]:
        keep = mask > torch.finfo(mask.dtype).min / 2
        return keep, torch.where(keep, mask, torch.zeros((), dtype=mask.dtype, device=mask.device))

    return _remembered(_LAST_SPLIT, mask, None, split)


#: the last additive mask turned into a keep-mask (``_remembered``)
_LAST_KEEP: list = [None, -1, None, None]


def additive_keep(mask: torch.Tensor) -> torch.Tensor:
    """An additive float mask that holds only 0 (keep) and masked entries (<= finfo.min / 2, -inf) -> the bool
    keep-mask of its shape (True = keep); MaskError when it holds anything else (a bias). The same mask tensor,
    unchanged, gives the same keep-mask back, so the layers of one forward share it (and its MaskInfo)."""
    if not mask.is_floating_point():
        raise MaskError(f"expected an additive float mask, got dtype {mask.dtype}")
    return _remembered(_LAST_KEEP, mask, None, lambda: _to_bool(mask))


#: (lq, lk, causal, device) -> MaskInfo of the calls without a mask (read-only tensors, shared by every layer)
_STRUCTURED: dict[tuple, MaskInfo] = {}
#: the last mask analysed, with the call's sizes (``_remembered``)
_LAST: list = [None, -1, None, None]


def build_mask_info(
    attention_mask: object, batch: int, heads: int, lq: int, lk: int, causal: bool, device: torch.device,
    remember: bool = True,
) -> MaskInfo:
    """Normalise ``attention_mask`` for a call with q [B, H, Lq, D] and k [B, Hkv, Lk, D].

    Accepted: None; bool/int/additive-float tensors of shape [B|1, 1|H, Lq, Lk] (the 4-D masks transformers
    builds), [B|1, Lq, Lk], or [B, Lk] (a padding mask over keys, combined with causality when ``causal``).
    The same mask tensor (unchanged) with the same sizes gives the same MaskInfo back (layers of one forward);
    ``remember=False`` (a mask derived from another, which caches it itself) leaves that memory alone.
    """
    if attention_mask is None:
        key = (lq, lk, causal and lq > 1, device)
        info = None if _no_cache() else _STRUCTURED.get(key)
        if info is None:
            if key[2]:
                i = torch.arange(lq, device=device, dtype=torch.float32)
                n = torch.clamp(i + 1, max=lk).view(1, 1, lq)
                info = MaskInfo(None, True, n, n > 0, lq, lk)
            else:
                n = torch.full((1, 1, lq), float(lk), device=device)
                info = MaskInfo(None, False, n.clamp_min(1), n > 0, lq, lk)
            if not _no_cache():
                if len(_STRUCTURED) > 64:  # decode: one entry per length; keep the recent ones
                    _STRUCTURED.pop(next(iter(_STRUCTURED)))
                _STRUCTURED[key] = info
        return info
    if not isinstance(attention_mask, torch.Tensor):
        raise MaskError(
            f"attention_mask of type {type(attention_mask).__name__} is not supported by hf_attnorm; expected None "
            "or a tensor (bool, 0/1 integer or additive float) of shape [B, 1, Lq, Lk], [B, Lq, Lk] or [B, Lk]"
        )
    def build() -> MaskInfo:
        return _build(attention_mask, batch, heads, lq, lk, causal, device)

    if not remember:
        return build()
    return _remembered(_LAST, attention_mask, (batch, heads, lq, lk, causal, device), build)


def _build(attention_mask: torch.Tensor, batch: int, heads: int, lq: int, lk: int, causal: bool,
           device: torch.device) -> MaskInfo:
    keep = _to_bool(attention_mask)
    padding = None
    if keep.dim() == 2:
        if keep.shape[1] != lk or keep.shape[0] not in (1, batch):
            raise MaskError(f"2-D padding mask must be [B={batch}, Lk={lk}], got {list(keep.shape)}")
        causal_pad = causal and lq > 1
        key_valid = keep.to(device)
        keep = keep[:, None, None, :]
        if causal_pad:
            keep = keep & causal_keep(lq, lk, keep.device)
        padding = (key_valid, None, causal_pad, 0)
    elif keep.dim() == 3:
        keep = keep[:, None]
    elif keep.dim() != 4:
        raise MaskError(f"attention mask must be 2-D, 3-D or 4-D, got shape {list(attention_mask.shape)}")
    b, h, mq, mk = keep.shape
    if b not in (1, batch) or h not in (1, heads) or mq not in (1, lq) or mk != lk:
        raise MaskError(
            f"attention mask of shape {list(attention_mask.shape)} does not fit queries [B={batch}, H={heads}, "
            f"Lq={lq}] and {lk} keys; expected [B or 1, 1 or H, Lq or 1, Lk]"
        )
    if padding is not None and padding[2]:
        # causal x padding: a query whose own key is padded can still see earlier keys; rows with none are dead
        padding = (padding[0], None, True, 0)
    return _from_keep(keep.to(device), causal, lq, lk, padding)


def _from_keep(keep: torch.Tensor, causal: bool, lq: int, lk: int, padding: tuple | None = None,
               selected: bool = False) -> MaskInfo:
    """The MaskInfo of a dense keep-mask [B or 1, 1 or H, Lq or 1, Lk]: n, has_keys and dead counted from it."""
    b = keep.shape[0]
    count = keep.sum(dim=-1, dtype=torch.int32).to(torch.float32)
    if count.shape[-1] != lq:
        count = count.expand(*count.shape[:-1], lq)
    dead = (~keep.any(dim=2).any(dim=1)).view(b, 1, lk, 1)
    return MaskInfo(keep, causal, count.clamp_min(1), count > 0, lq, lk, dead, padding, padding is not None,
                    selected=selected)


_INDEX_MESSAGE = "selection indices must lie in [-1, {n}) (-1: an unused slot); these hold other values"


def selected_keys(indices: torch.Tensor, lk: int, block: int = 1) -> torch.Tensor:
    """The keys a sparse-attention indexer selected, as a keep-mask.

    indices: integer [B, Lq, K] (one selection for every head) or [B, Hs, Lq, K] (one per selecting head), per
    query the selected keys (``block`` 1) or key blocks (block b holds keys b * block ... (b + 1) * block - 1, the
    last one cut at Lk); -1 marks an unused slot, and an index given twice selects its keys once (a set, as the
    masks transformers' eager paths build by scatter). Returns bool [B, 1 or Hs, Lq, Lk] (True = selected).
    Indices outside [-1, number of blocks) raise ``MaskError`` (eager CPU) or fail a device-side assertion."""
    if not isinstance(indices, torch.Tensor) or indices.is_floating_point() or indices.is_complex() \
            or indices.dtype == torch.bool or indices.dim() not in (3, 4):
        got = (f"{indices.dtype} of shape {list(indices.shape)}" if isinstance(indices, torch.Tensor)
               else type(indices).__name__)
        raise MaskError(f"selection indices must be an integer tensor [B, Lq, K] or [B, heads, Lq, K]; got {got}")
    if block < 1:
        raise MaskError(f"a selection's block size must be a positive integer, got {block!r}")
    nb = -(-lk // block)  # (ceil: the last block may be short)
    idx = indices.long()
    _check_values((idx >= -1) & (idx < nb), _INDEX_MESSAGE.format(n=nb))
    idx = torch.where(idx < 0, nb, idx)  # unused slots land in a column dropped below
    picked = torch.zeros(*idx.shape[:-1], nb + 1, dtype=torch.bool, device=idx.device)
    picked = picked.scatter(-1, idx, True)[..., :nb]
    if block > 1:
        picked = picked.repeat_interleave(block, dim=-1)[..., :lk]
    return picked if picked.dim() == 4 else picked[:, None]


def select_keys(info: MaskInfo, selection: torch.Tensor) -> MaskInfo:
    """The visibility of ``info`` restricted to ``selection``: bool [B or 1, 1 or H, Lq or 1, Lk] (True = the
    query may see the key), e.g. ``selected_keys``. A key is visible iff the mask keeps it and it is selected; n
    counts those keys, so the normalizer runs over exactly them. The result is marked ``selected``."""
    if selection.dtype != torch.bool or selection.dim() != 4 or selection.shape[-1] != info.lk \
            or selection.shape[2] not in (1, info.lq):
        raise MaskError(f"a key selection must be bool [B, 1 or H, Lq={info.lq} or 1, Lk={info.lk}], got "
                        f"{selection.dtype} of shape {list(selection.shape)}")
    return _from_keep(info.dense(selection.device) & selection, info.causal, info.lq, info.lk, selected=True)
