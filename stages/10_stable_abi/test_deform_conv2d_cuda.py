"""Stage 10: the deformable convolution's CUDA kernels on the stable ABI pass stage 07's tests, run
here.

The library compiles stage 07's kernels (deform_conv2d_cuda.cuh) with glue written against
torch/csrc/stable and torch's CUDA C shims (the guard, the current stream, cuBLAS's GEMMs). So
every behaviour stage 07's tests check must hold here too: the float64 references in all four
dtypes and both backward modes (the deterministic one bitwise the same run to run), agreement with
the CPU kernels, chunking, bad inputs named the same way (a tensor left on the CPU included),
opcheck, CUDA graph capture, torch.compile. stages/07_cuda_library/test_deform_conv2d_cuda.py,
every test of it, once per stage. Without a GPU they run on the emulated CUDA device (test ids say
emulated_cuda), which compiles this stage's CUDA glue with the emulator's stand-ins for those shims:
the arithmetic, indexing and launches are proved there, not the speed or the real shims.
"""

from workbook import testing

testing.run_tests_of("07_cuda_library/test_deform_conv2d_cuda.py", globals())
