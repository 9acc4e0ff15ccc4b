"""Parquet prompt files as verl writes them, read into the same rows as prompts.jsonl (pyarrow, imported lazily).

verl's data files hold one prompt per row: `prompt` (chat messages), `data_source`, `ability`,
`reward_model` ({"style", "ground_truth"}) and `extra_info` (a dict). Rows come back as plain JSON
values; `reward_model.ground_truth` becomes the row's `ground_truth` when it has none of its own, and
every column is kept (so `extra_info` reaches reward functions as it is in the file).
"""

from __future__ import annotations

import datetime
import decimal
import math
from pathlib import Path
from typing import Any

from rlx.errors import UserError

PARQUET_SUFFIXES = (".parquet", ".pq")


def is_parquet(path: str | Path) -> bool:
    """True for a file name ending in .parquet or .pq."""
    return str(path).lower().endswith(PARQUET_SUFFIXES)


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            "reading parquet prompt files needs pyarrow: pip install 'rlx[parquet]' (or pip install pyarrow)"
        ) from None
    return pq


def _jsonable(value: Any, where: str, column: str) -> Any:
    """A parquet cell as a JSON value: NaN becomes null, dates become ISO strings, bytes are refused."""
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, dict):
        return {str(k): _jsonable(v, where, column) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where, column) for v in value]
    if isinstance(value, (datetime.date, datetime.datetime, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, (bytes, bytearray)):
        raise UserError(f"{where}: column '{column}' holds binary data (e.g. images), which rlx prompts cannot carry")
    if value is None or isinstance(value, (str, int, bool)):
        return value
    raise UserError(f"{where}: column '{column}' holds a {type(value).__name__}, expected JSON-like values")


def _open(path: str | Path):
    from rlx.utils.io import is_remote, local

    if is_remote(path):
        import io

        from rlx.utils.storage import read_bytes

        return io.BytesIO(read_bytes(str(path)))
    p = local(path)
    if not p.is_file():
        raise UserError(f"{path}: no such file")
    return p


def read_parquet_rows(path: str | Path) -> list[tuple[str, dict]]:
    """(where, row) pairs of a verl-style parquet file, `where` naming the file and 0-based row."""
    pq = _pyarrow_parquet()
    import pyarrow as pa

    try:
        table = pq.read_table(_open(path))
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable parquet file ({str(e).splitlines()[0][:200]})") from None
    rows = []
    for index, row in enumerate(table.to_pylist()):
        where = f"{path}:row {index}"
        obj = {column: _jsonable(value, where, column) for column, value in row.items()}
        reward_model = obj.get("reward_model")
        if obj.get("ground_truth") is None and isinstance(reward_model, dict) and "ground_truth" in reward_model:
            obj["ground_truth"] = reward_model["ground_truth"]
        obj = {k: v for k, v in obj.items() if not (k == "id" and v is None)}
        rows.append((where, obj))
    return rows
