"""The one exception type for problems the user can fix: reported as one line, exit code 1."""


class UserError(Exception):
    """Bad input (a file, a line, an option, a recipe key): printed without a traceback, exit code 1."""


class Terminated(Exception):
    """The process got SIGTERM (e.g. SLURM preemption): the command stops, its temporaries removed, exit 143."""
