"""Python shared by every stage of the workbook: build helpers, float64 references, the shared
test base and the timing harness. Put ``common/`` on ``sys.path`` to import it."""
