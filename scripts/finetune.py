"""Fine-tune a checkpoint (ours, SmolLM2, MiniLM, any HF folder), optionally swapping its attention normalizer.

Examples::

    python scripts/finetune.py --model_name_or_path smollm2 --attn_implementation softmax1 \\
        --max_train_steps 50 --per_device_train_batch_size 1 --output_dir runs/smollm2-softmax1

Every flag: `python scripts/finetune.py --help`; the training loop is `hf_attnorm.lab.training` (docs/training.md).
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

from hf_attnorm.lab.training import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("finetune"))
