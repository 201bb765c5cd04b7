"""What the notebooks and the exercises are made of.

    exercises   exercises carved from the stages' sources: list, carve, check, reveal
    notebook    the notebooks' helpers: source excerpts, commands, tables, sweeps, plots
    pictures    the notebooks' pictures, each checked against real tensors before it is drawn
    pytest_gate, pytest_running
                make verify's pytest plugins: tests that wait for the build, a crash named

exercises and the plugins import no torch: make verify's own process starts the build and the
tests at once, without loading it (seconds on a laptop); its tests' process loads it.
"""
