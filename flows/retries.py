"""Which failures a task retries: only those that can go away by themselves.

A lost connection (ledger, MLflow server, artifact store), a timeout or a database that was
briefly unavailable is retried; a diverged run, a shape error, a refused promotion or a bad
config fails at once, because running the same deterministic code again gives the same error
and only delays it. Every task with `retries=` passes `retry_condition_fn=transient_only`.
"""

from __future__ import annotations


def is_transient(error: BaseException) -> bool:
    """A network, timeout or database-connection error (requests' and SQLAlchemy's included)."""
    from requests.exceptions import ConnectionError as RequestsConnectionError
    from requests.exceptions import Timeout
    from sqlalchemy.exc import DisconnectionError, OperationalError

    transient = (ConnectionError, TimeoutError, DisconnectionError, OperationalError, RequestsConnectionError, Timeout)
    return isinstance(error, transient) or (error.__cause__ is not None and is_transient(error.__cause__))


def transient_only(task, task_run, state) -> bool:
    """Prefect's retry_condition_fn: retry the failed run only if its error is transient."""
    try:
        state.result()
    except Exception as e:
        return is_transient(e)
    return True
