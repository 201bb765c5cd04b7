"""Stage 10: the library where models are trained and shipped, on the stable ABI: stage 06's
deployment tests, run here on this library.

Every path they check must hold for the one binary too: TorchScript, the errors torchvision's
callers catch, torchvision's and mmcv's checkpoints, ONNX export run in ONNX Runtime,
torch.export, an AOTInductor package loaded in a fresh process (the compiled model calls the ops
through the dispatcher, as it calls stage 06's), DistributedDataParallel. One test knows the ABI:
a direct call of torch.ops.extops.* raises what the C++ check can throw, ValueError from ATen's
library and RuntimeError, with "[ValueError] " first, from this one (workbook/checks.h).
stages/06_op_library/test_deploy.py, every test of it, once per stage.
"""

from workbook import testing

testing.run_tests_of("06_op_library/test_deploy.py", globals())
