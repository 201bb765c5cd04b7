"""Stage 10: multi-scale deformable attention's CUDA kernels on the stable ABI pass stage 09's
tests, run here.

The library compiles stage 09's kernels (ms_deform_attn_cuda.cuh) with glue written against
torch/csrc/stable and torch's CUDA C shims (the guard, the current stream). So every behaviour
stage 09's CUDA tests check must hold here too: the float64 references in all four dtypes and both
backward modes (the deterministic one bitwise the same run to run), agreement with the CPU
kernels, bad inputs and level tables refused the same way, points outside and NaN.
stages/09_ms_deform_attn/test_ms_deform_attn_cuda.py, every test of it, once per stage. Without a
GPU they run on the emulated CUDA device (test ids say emulated_cuda), which compiles this stage's
CUDA glue with the emulator's stand-ins for those shims: the arithmetic, indexing and launches are
proved there, not the speed or the real shims.
"""

from workbook import testing

testing.run_tests_of("09_ms_deform_attn/test_ms_deform_attn_cuda.py", globals())
