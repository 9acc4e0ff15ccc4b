"""Chat rendering and token-exact trajectories, tool-call parsing and episode images: shared by the agent driver,
the server and SFT.
"""
