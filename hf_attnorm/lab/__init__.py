"""The lab: training, data, evaluation, diagnostics, plots, scale analysis, model cards and offline assets.

Not needed to use an attention implementation; these modules need the ``[train]``/``[eval]`` extras
(``pip install "hf_attnorm[all]"``). Nothing in the plugin core imports from here.
"""
