"""yarn: YaRN's attention temperature, scores x (0.1 ln s + 1)^2, for models that do not apply it themselves.

Peng, Quesnelle, Fan and Shippole, "YaRN: Efficient Context Window Extension of Large Language Models" (arXiv
2309.00071, section 3.4): softmax(q.k / (t sqrt(d))) with sqrt(1/t) = 0.1 ln s + 1, s the context-extension factor
(s <= 1: no change). transformers applies sqrt(1/t) as ``attention_factor`` (``mscale``) to the rotary cos/sin of a
model whose ``rope_parameters`` (``rope_scaling``) has rope_type "yarn" (``modeling_rope_utils``:
``_compute_yarn_parameters``, ``get_mscale``), i.e. to both q and k, so the scores get (0.1 ln s + 1)^2: this scale
multiplies by the same. Such a model already has it, so this scale refuses it at load/set time (it would be applied
twice), unless its attention_factor is explicitly 1; use it with a model that extends its context some other way
(linear / dynamic NTK rope scaling, YaRN's frequencies with attention_factor 1, or none).

s: option ``yarn_factor`` (>= 1), or, when null (default), YaRN's dynamic scaling per query,
s = max(1, n / L_train) (n = keys the query sees, L_train = option ``train_length`` or the model's
max_position_embeddings): no change inside the training length.
"""

from __future__ import annotations

import torch

from ..normalizers.base import Ctx
from ..registry import register_scale
from ..settings import AttnormSettings, declare_option
from .base import Scale
from .log_train_n import train_length
from .qwen_logn import TRAIN_LENGTH

YARN_FACTOR = declare_option(
    "yarn_factor", float, None,
    "yarn: context-extension factor s >= 1 of the temperature (0.1 ln s + 1)^2; null = max(1, n / train_length)",
    optional=True, check=lambda v: "must be >= 1 (the context-extension factor)" if not v >= 1 else None,
)


def yarn_mscale(s: torch.Tensor | float) -> torch.Tensor:
    """0.1 ln s + 1 for s >= 1 (1 below), transformers' ``get_mscale(s)``."""
    s = torch.as_tensor(s, dtype=torch.float32)
    return torch.where(s > 1, 0.1 * torch.log(s.clamp(min=1)) + 1.0, torch.ones_like(s))


def applies_yarn(module_info: dict) -> bool:
    """Whether the model's rotary settings are YaRN's with a temperature (transformers then applies it itself):
    rope_type "yarn" unless attention_factor is explicitly 1 (YaRN's frequencies without its temperature)."""
    for r in module_info.get("rope", ()):
        if str(r.get("rope_type", r.get("type", ""))).lower() == "yarn":
            factor = r.get("attention_factor")
            if factor is None or float(factor) != 1.0:
                return True
    return False


@register_scale
class Yarn(Scale):
    name = "yarn"
    paper = "Peng et al. 2023, YaRN, https://arxiv.org/abs/2309.00071"
    description = "scaling * (0.1 ln s + 1)^2, YaRN's temperature (s = yarn_factor, or max(1, n/L_train))"
    options = (YARN_FACTOR, TRAIN_LENGTH)

    def refuses(self, module_info: dict) -> str | None:
        if applies_yarn(module_info):
            return (f"the yarn scale would apply YaRN's attention temperature twice: the config of "
                    f"{module_info.get('family', 'this model')} has rope_parameters of rope_type 'yarn', whose rotary "
                    "embedding already multiplies q and k by attention_factor (0.1 ln s + 1); use another scale, or a "
                    "model without yarn rope scaling")
        return None

    def prepare(self, settings: AttnormSettings, module_info: dict) -> None:
        reason = self.refuses(module_info)
        if reason:
            raise ValueError(reason)
        if settings.yarn_factor is None:
            train_length(settings, module_info, "yarn (with yarn_factor null)")

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        factor = ctx.settings.yarn_factor
        if factor is None:
            s = n / train_length(ctx.settings, ctx.module_info, "yarn (with yarn_factor null)")
        else:
            s = torch.full_like(n[..., :1], float(factor))
        m = yarn_mscale(s.to(torch.float32)).to(n.dtype)
        return m * m
