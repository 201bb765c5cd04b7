"""Stage 10: multi-scale deformable attention on the stable ABI passes stage 09's tests, run here.

The library compiles stage 09's kernels (ms_deform_attn_cpu.h) with glue written against
torch/csrc/stable, and its Python module is stage 09's, autocast registered from Python
(extops/python_keys.py). So every behaviour stage 09's tests check must hold here too: the float64
references in all four dtypes, gradcheck, opcheck, bad inputs and level tables refused the same
way, meta tensors, torch.compile, autocast, points outside and NaN, any batch, reproducibility
across runs and thread counts, the module. stages/09_ms_deform_attn/test_ms_deform_attn.py, every
test of it, once per stage.
"""

from workbook import testing

testing.run_tests_of("09_ms_deform_attn/test_ms_deform_attn.py", globals())
