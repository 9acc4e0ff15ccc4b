"""Experiment-tracker sinks for `Tracker`: TensorBoard, Weights & Biases (offline) and MLflow (local files).

Each sink writes under the run dir and needs no network. Each imports its library inside its
constructor, so this module (and `rlx.observe.tracking`) imports without torch or the trackers; a
tracker chosen but not installed raises a UserError naming the pip package to install.

Every sink has the same three methods, fed by `Tracker`:
  log(step, metrics)        finite numbers only, names as in metrics.jsonl (`reward/mean`, `perf/mfu`)
  log_traces(step, rows)    a table of rollout samples (columns: TRACE_COLUMNS); a no-op where unsupported
  close()                   flush and finish the run
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from rlx.errors import UserError

TRACE_COLUMNS = ("step", "id", "prompt", "response", "reward", "advantage")
# files that remember a tracker's run id, so a resumed rlx run continues the same tracker run
_RUN_ID_FILE = "rlx-run-id"


def require(module: str, tracker: str, package: str):
    """Import `module` for tracker `tracker`, or raise a UserError naming the pip package."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"tracker '{tracker}' needs the {package} package: pip install {package} "
            f"(or pip install 'rlx[tracking]'), or remove '{tracker}' from tracking.backends"
        ) from None


def persistent_run_id(folder: Path) -> str:
    """A run id stored in `folder` (created on first use), reused when the rlx run is resumed."""
    path = folder / _RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    folder.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:16]
    path.write_text(run_id + "\n")
    return run_id


def cell_text(value) -> str:
    """A table cell as text: chat messages as `role: content` lines, numbers and strings as they are."""
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: list[dict]) -> str:
    """Rows as a Markdown table (TensorBoard's text plugin renders it); `|` and newlines escaped."""

    def cell(value) -> str:
        return cell_text(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(TRACE_COLUMNS) + " |", "|" + "---|" * len(TRACE_COLUMNS)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in TRACE_COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b": "value"} (MLflow params are flat strings)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flatten(value, name))
        else:
            out[name] = json.dumps(value) if not isinstance(value, str) else value
    return out


class TensorBoardSink:
    """SummaryWriter event files under RUN_DIR/tensorboard: scalars, the config and trace tables as text.

    Uses torch.utils.tensorboard; without torch, tensorboard's own (scalar-only) writer, and traces
    and the config are then not written to TensorBoard (they are still in traces.jsonl/recipe.json).
    A resumed run passes `start_step`: events after it (from the crashed attempt) are purged.
    """

    def __init__(self, run_dir: Path, config: dict, start_step: int = 0):
        require("tensorboard", "tensorboard", "tensorboard")
        log_dir = str(run_dir / "tensorboard")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from tensorboard.summary import Writer

            self.writer, self.has_text = Writer(log_dir), False
            return
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=start_step + 1 if start_step else None)
        self.has_text = True
        if not start_step:
            text = json.dumps(config, indent=2, default=str)
            self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_traces(self, step: int, rows: list[dict]) -> None:
        if self.has_text:
            self.writer.add_text("traces", markdown_table(rows), step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbSink:
    """A Weights & Biases run in offline mode under RUN_DIR/wandb (never touches the network).

    Upload later with `wandb sync RUN_DIR/wandb/offline-run-*`. The run id is kept in
    RUN_DIR/wandb/rlx-run-id, so a resumed rlx run continues the same W&B run. Console capture is
    off (rlx prints its own step lines).
    """

    def __init__(self, run_dir: Path, config: dict, project: str, run_name: str):
        wandb = require("wandb", "wandb", "wandb")
        self.wandb = wandb
        folder = run_dir / "wandb"
        self.run = wandb.init(
            project=project,
            name=run_name,
            id=persistent_run_id(folder),
            resume="allow",
            dir=str(run_dir),  # wandb adds the "wandb" folder itself
            mode="offline",
            config=config,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_traces(self, step: int, rows: list[dict]) -> None:
        data = [[cell_text(row.get(c)) if c in ("prompt", "id") else row.get(c) for c in TRACE_COLUMNS] for row in rows]
        self.run.log({"traces": self.wandb.Table(columns=list(TRACE_COLUMNS), data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run in a local file store under RUN_DIR/mlflow (`mlflow ui --backend-store-uri file://...`).

    The experiment is named after `project`; the config becomes flat params (`train.optim.lr`). MLflow 3
    refuses file stores unless MLFLOW_ALLOW_FILE_STORE is true; this sink sets it (when unset)
    for the process. The run id is kept in RUN_DIR/mlflow/rlx-run-id so a resumed rlx run continues
    the same MLflow run. Traces are not sent to MLflow (they are in traces.jsonl).
    """

    def __init__(self, run_dir: Path, config: dict, project: str, run_name: str):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow = require("mlflow", "mlflow", "mlflow")
        self.entities = mlflow.entities
        folder = (run_dir / "mlflow").resolve()
        folder.mkdir(parents=True, exist_ok=True)
        self.client = mlflow.MlflowClient(tracking_uri=folder.as_uri())
        self.run_id = self._open_run(folder, project, run_name, config)

    def _open_run(self, folder: Path, project: str, run_name: str, config: dict) -> str:
        id_file = folder / _RUN_ID_FILE
        if id_file.is_file():
            run_id = id_file.read_text().strip()
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [self.entities.Param(k, v[:500]) for k, v in flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run_id, params=params[start : start + 100])
        id_file.write_text(run_id + "\n")
        return run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        batch = [self.entities.Metric(key, value, now, step) for key, value in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_traces(self, step: int, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
