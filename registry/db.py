"""Connecting to the ledger database and migrating it.

SQLite (a file) is the default; PostgreSQL is used by URL. On SQLite every transaction
starts with BEGIN IMMEDIATE, so two processes that both want to write are serialised at
the start of the transaction instead of failing at commit; on PostgreSQL, writers that
must not interleave lock a row with SELECT ... FOR UPDATE (see `promotion.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "ledger_alembic_version"  # not `alembic_version`: MLflow may share the database


class LedgerError(Exception):
    """Bad input to the ledger or a reference to a row that does not exist."""


def default_ledger_url(state_dir: str | Path) -> str:
    """The embedded default: a SQLite file inside the project's state folder."""
    return f"sqlite:///{Path(state_dir).expanduser().resolve() / 'ledger.db'}"


def normalize_url(url: str) -> str:
    """Use psycopg 3 for plain `postgresql://` URLs (SQLAlchemy would pick psycopg2)."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite files get WAL, foreign keys and BEGIN IMMEDIATE."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if not parsed.database or parsed.database == ":memory:":
        raise LedgerError(f"ledger URL {url!r}: SQLite needs a file path (sqlite:///path/ledger.db)")
    Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": 60})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        # Let SQLAlchemy's "begin" event below decide how transactions start.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:  # type: ignore[no-untyped-def]
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["engine"] = engine
    config.attributes["version_table"] = VERSION_TABLE
    return config


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Apply the ledger's migrations up to `revision` (no alembic.ini needed)."""
    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    command.upgrade(_alembic_config(engine), revision)


def downgrade(url_or_engine: str | Engine, revision: str) -> None:
    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    command.downgrade(_alembic_config(engine), revision)


def init_db(url: str) -> "Ledger":
    """Create or migrate the ledger at `url` to the newest schema and open it."""
    ledger = Ledger(url)
    upgrade(ledger.engine)
    return ledger


class Ledger:
    """A handle on the ledger database. Open it with `init_db(url)`."""

    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self.engine = make_engine(self.url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session whose work is committed at the end of the block, or not at all."""
        with self._sessions() as session, session.begin():
            yield session

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
