"""The transformers integration: the attention function transformers calls (``forward``), the state on attention
modules (``state``), model-family facts (``families``), checkpoints (``persistence``) and the registration and
hooks that tie them to ``PreTrainedModel`` (``integration``). Dependency order: families <- state <- forward,
persistence <- integration.
"""
