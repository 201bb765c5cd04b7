"""The reliability net: what checks every op beyond its stage's own tests, wherever a stage
implements it (workbook.ops.implementations), so that a new op or stage is covered by adding it.

    matrix      hostile-input tables per op, each row run eager, on meta and compiled, in a
                child process (tests/test_matrix.py)
    fuzz        hypothesis examples of every op against its float64 reference (tests/test_fuzz.py,
                make fuzz)
    sanitize    the stages built with ASan+UBSan and tested on it (make sanitize)

(tests/test_concurrency.py, threads calling every op at once, needs nothing more than its test.)
"""
