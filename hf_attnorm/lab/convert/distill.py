"""Distilling the original model's next-token distribution in stage 2 of a conversion (``--distill``).

After attention transfer, RADLADS (arXiv 2505.03005) and Mamba-in-the-Llama (arXiv 2408.15237) train the converted
model on the KL divergence to the original model's output distribution rather than on the next-token loss alone.
The teacher here is the original model itself, before any training: its distributions over the stage-2 batches are
computed once, before stage 1 changes any weight (the attention observer in "record" mode runs the model's own
softmax attention in every layer, so the pass is the original model's), and kept as each position's top-k
log-probabilities plus the log-mass of the rest of the vocabulary. No second copy of the model is held, and no
weights are switched back during training (after stage 1's LoRA is merged, "the same weights with the adapters
off" would no longer be the original model).

The loss is the KL divergence between the two distributions coarsened to k + 1 outcomes (the teacher's top-k tokens,
then everything else): exact for that partition, and at most the full KL (coarsening cannot raise a divergence).
With k = the vocabulary it is the full KL.
"""

from __future__ import annotations

import dataclasses

import torch

Tensor = torch.Tensor


@dataclasses.dataclass
class TeacherTopK:
    """One batch's teacher distributions, per position: ``log_probs`` [b, L, k] (float32, the top-k log-probabilities,
    descending), ``indices`` [b, L, k] (int64, their tokens), ``rest`` [b, L] (float32, log of the probability of
    every other token; -inf when k covers the vocabulary)."""

    log_probs: Tensor
    indices: Tensor
    rest: Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.log_probs, self.indices, self.rest))


def _log_rest(log_probs: Tensor, indices: Tensor) -> Tensor:
    """log of the probability mass outside ``indices``: log_probs [..., V] -> [...] (exact: a masked logsumexp)."""
    return log_probs.scatter(-1, indices, float("-inf")).logsumexp(-1)


def teacher_top_k(logits: Tensor, k: int) -> TeacherTopK:
    """logits [b, L, V] of the teacher -> its top-k (computed in float32 whatever the logits' dtype)."""
    log_probs = torch.log_softmax(logits.detach().float(), dim=-1)
    top = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
    return TeacherTopK(top.values.contiguous(), top.indices.contiguous(), _log_rest(log_probs, top.indices))


def top_k_kl(student_logits: Tensor, teacher: TeacherTopK) -> Tensor:
    """KL(teacher || student) over the k + 1 outcomes of the teacher's top-k and the rest, per position, averaged
    over the positions. student_logits [b, L, V] (any dtype; float32 inside) -> a scalar with a gradient."""
    log_q = torch.log_softmax(student_logits.float(), dim=-1)
    q_top = log_q.gather(-1, teacher.indices)
    per_position = (teacher.log_probs.exp() * (teacher.log_probs - q_top)).sum(-1)
    if teacher.indices.shape[-1] < log_q.shape[-1]:  # (k = V: no rest, whose logsumexp of nothing has no gradient)
        q_rest = _log_rest(log_q, teacher.indices)
        p_rest = teacher.rest.exp()
        # 0 where the teacher gives the rest no mass (underflow): p log p -> 0
        per_position = per_position + torch.where(p_rest > 0, p_rest * (teacher.rest - q_rest),
                                                  torch.zeros_like(p_rest))
    return per_position.mean()
