"""Convert a pretrained causal LM to another attention normalizer: attention transfer, then fine-tuning.

Examples::

    python scripts/convert.py --attn_implementation symax --output_dir runs/smollm2-symax
    python scripts/convert.py --attn_implementation ssmax --transfer_steps 0 --finetune_steps 60 \\
        --output_dir runs/smollm2-ssmax-finetune-only

Every flag: `python scripts/convert.py --help`; the stages, outputs and the study on SmolLM2: docs/convert.md.
"""

from __future__ import annotations

import os
import sys

# nothing downloads from the hub at run time unless the user says otherwise
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import hf_attnorm  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_attnorm.lab.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
