"""Helpers every ledger module uses: checked names, row lookups, JSON values, retries."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, TypeVar

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from registry.db import LedgerError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
T = TypeVar("T")


def require_name(value: str, field: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise LedgerError(f"{field}: expected letters, digits, '_', '.' or '-', got {value!r}")
    return value


def require_row(session: Session, model: type, row_id: int, what: str) -> Any:
    row = session.get(model, row_id)
    if row is None:
        raise LedgerError(f"{what} id {row_id} does not exist in the ledger")
    return row


def once_more_on_conflict(create: Callable[[], T]) -> T:
    """Run a get-or-create again if a concurrent writer inserted the same row first."""
    try:
        return create()
    except IntegrityError:
        return create()


def json_field(value: dict[str, Any], field: str) -> dict[str, Any]:
    """A JSON column value; NaN/inf are refused because PostgreSQL's json type rejects them."""
    if not isinstance(value, dict):
        raise LedgerError(f"{field}: expected a dict, got {type(value).__name__}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise LedgerError(f"{field}: not storable as JSON ({e}); use null or a string for NaN/inf") from e
    return dict(value)
