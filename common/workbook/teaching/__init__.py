"""What the notebooks and the exercises are made of.

    exercises   exercises carved from the stages' sources: list, carve, check, reveal
    notebook    the notebooks' helpers: source excerpts, commands, tables, sweeps, plots
    pictures    the notebooks' pictures, each checked against real tensors before it is drawn
"""
