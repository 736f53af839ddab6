"""Pretrain a GPT-2, BERT (masked LM) or Llama model from scratch with any hf_attnorm attention.

Examples::

    python scripts/pretrain.py --model_type llama --model_size tiny --attn_implementation symax \\
        --max_train_steps 300 --output_dir runs/llama-symax
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 scripts/pretrain.py ...

Every flag: `python scripts/pretrain.py --help`; the training loop is `hf_attnorm.lab.training` (docs/training.md).
"""

from __future__ import annotations

import os
import runpy
import sys

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout


from hf_attnorm.lab.training import pretrain_main as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
