"""The main job (``scripts/compare.py``): which normalizers keep working beyond the training length, with error bars.

* ``job``: the command line and the job's order (train, probe, report);
* ``sweep``: one cached, resumable run per (task, implementation, seed);
* ``charlm``: the character-level language model on the embedded Shakespeare corpus;
* ``report``: the tables, claim checks and plots; ``verdicts``: claims a rerun does not overturn;
* ``stats``: means, confidence intervals and paired comparisons (pure Python).
"""
