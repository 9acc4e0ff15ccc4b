"""`rlx report`: plots and a summary of an `rlx ppo` run folder (finished or still running)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlx.commands._common import reporting


def report(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="Run folder written by `rlx ppo --out`.")],
    overwrite: Annotated[
        bool, typer.Option(help="Replace an earlier RUN_DIR/report/ (e.g. of a running run).")
    ] = False,
) -> None:
    """Plot a run's metrics (reward, response length, KL, entropy, clip fraction, MFU) to RUN_DIR/report/*.png
    and write RUN_DIR/report/summary.md (progress, reward trend, best step, step time).

    Works on a run in progress: a partly written last line of metrics.jsonl is skipped. Needs
    matplotlib (pip install 'rlx[report]'). Prints the summary's path.
    """
    with reporting("report"):
        from rlx.stages.report import write_report

        result = write_report(run_dir, overwrite=overwrite)
        print(result.summary)
