"""Stage 10: the deformable convolution on the stable ABI passes stage 06's tests, run here.

The library compiles stage 06's kernels (deform_conv2d_cpu.h) with glue written against
torch/csrc/stable, and its Python modules are stage 06's, autocast registered from Python
(extops/python_keys.py). So every behaviour stage 06's tests check must hold here too: the float64
references in all four dtypes, gradcheck, opcheck, bad inputs named the same way, meta tensors,
torch.compile, autocast, torchvision's results, reproducibility across thread counts, the
column budget's chunking, the modules. stages/06_op_library/test_deform_conv2d.py, every test of
it, once per stage.
"""

from workbook import testing

testing.run_tests_of("06_op_library/test_deform_conv2d.py", globals())
