"""The rank side: code that runs inside each engine process.

Named ``runtime`` rather than ``rank`` because ``notebook_dist.rank`` is the rank
number helper users read inside a cell. Nothing here imports IPython display code or
ipywidgets (a test checks), so a rank stays light and a torchrun export can use it.
"""
