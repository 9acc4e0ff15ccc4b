"""Stage runners: one module per command, each the whole of a stage end to end (options in, artifacts out); the
only floor besides the driver that imports many packages.
"""
