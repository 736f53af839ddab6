"""Speed: the goals every implementation is held to and the checks that need (or stand in for) a GPU.

* ``goals``: the speed goal of every implementation on the CPU and on a GPU, and the measured reason where one is
  missed (the goal table of docs/benchmarks.md);
* ``gpu_check``: the GPU check (``scripts/gpu_check.sh``): the ``gpu`` tests, the benchmark against SDPA's flash
  backend with the anchors beside it, results under ``bench/gpu/``;
* ``gpu_anchors``: the field's own GPU kernels timed beside ours;
* ``triton_ptx``: ahead-of-time tensor-core checks of the Triton kernels, without a GPU;
* ``timing``: interleaved per-call timing for the CPU micro-benchmarks.
"""
