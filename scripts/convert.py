"""Convert a pretrained causal LM to another attention normalizer: attention transfer, then fine-tuning.

Examples::

    python scripts/convert.py --attn_implementation symax --output_dir runs/smollm2-symax
    python scripts/convert.py --attn_implementation ssmax --transfer_steps 0 --finetune_steps 60 \\
        --output_dir runs/smollm2-ssmax-finetune-only

Every flag: `python scripts/convert.py --help`; the stages, outputs and the study on SmolLM2: docs/convert.md.
"""

from __future__ import annotations

import os
import runpy
import sys

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout


from hf_attnorm.lab.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
