"""Stage 06: the LLTM in the extops library passes stage 05's tests, run here on this library.

The library compiles stage 05's kernels as they are (setup.py), so the op is stage 05's in every
behaviour; what this stage changes is around them: the ops' names in one namespace
(torch.ops.extops.lltm_forward), autograd in C++ (csrc/lltm/autograd/), the package. Stage 05's
test file names the library under test by its stage, never `lltm` itself, so the same tests run
here against extops: stages/05_cuda_accessors/test_lltm.py, every test of it, once per stage.
"""

from workbook import testing

testing.run_tests_of("05_cuda_accessors/test_lltm.py", globals())
