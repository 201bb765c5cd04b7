"""Stage 10: the LLTM on the stable ABI passes stage 05's tests, run here on this library.

The library compiles stage 05's kernels as they are, with glue written against torch/csrc/stable;
its Python modules are stage 06's, with autograd and autocast registered from Python
(extops/python_keys.py). So every behaviour stage 05's tests check must hold here too: the
references in all four dtypes, gradcheck, opcheck, bad inputs named the same way, meta tensors,
torch.compile, autocast. stages/05_cuda_accessors/test_lltm.py, every test of it, once per stage.
"""

from workbook import testing

testing.run_tests_of("05_cuda_accessors/test_lltm.py", globals())
