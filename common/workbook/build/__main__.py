"""python -m workbook.build N [N ...] | all [--force] [--require-cuda]: see
workbook.build.side_by_side."""

import sys

from workbook.build.side_by_side import main

sys.exit(main())
