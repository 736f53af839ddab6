"""Fine-tune a checkpoint (ours, SmolLM2, MiniLM, any HF folder), optionally swapping its attention normalizer.

Examples::

    python scripts/finetune.py --model_name_or_path smollm2 --attn_implementation softmax1 \\
        --max_train_steps 50 --per_device_train_batch_size 1 --output_dir runs/smollm2-softmax1

Every flag: `python scripts/finetune.py --help`; the training loop is `hf_attnorm.lab.training` (docs/training.md).
"""

from __future__ import annotations

import os
import runpy
import sys

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout


from hf_attnorm.lab.training import finetune_main as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
