"""Building the stages and importing them: the workbook's build system.

    stages        the stages, found on disk (stages/NN_name/stage.toml); nothing else lists them
    toolkit       finding (or installing from pip) a CUDA toolkit that matches torch
    compiler      the flags, headers and tools every extension is compiled with (setup.py's)
    builder       building one stage under build/, and knowing when it is out of date
    loader        importing a stage's package, built first where needed (import_stage)
    emulate       the emulated CUDA device: a stage's .cu files compiled for the CPU
    side_by_side  several stages built at once; ``python -m workbook.build N|all``
"""
