"""Alembic environment for the ledger. `registry.db.upgrade` passes the engine in; there
is no alembic.ini, so migrations run the same from any working directory."""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from registry.models import Base

engine = context.config.attributes.get("engine")
if engine is None:
    raise RuntimeError("run the ledger migrations through registry.db.upgrade(url)")

with engine.connect() as connection:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # A batch migration copies a table, drops the original and renames the copy; with
        # foreign keys on, dropping a table that other rows reference fails. The pragma is
        # ignored inside a transaction, so it goes to the driver before Alembic begins one.
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")
    try:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            version_table=context.config.attributes["version_table"],
            render_as_batch=sqlite,  # SQLite cannot ALTER most things
            # SQLite's DDL is transactional too (Alembic assumes not): one transaction for
            # the whole upgrade, so a failed migration or the check below leaves no trace.
            transactional_ddl=True,
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
            if sqlite:
                # With the checks off, prove the copied tables still agree before committing.
                broken = connection.execute(text("PRAGMA foreign_key_check")).all()
                if broken:
                    raise RuntimeError(f"ledger migration left dangling foreign keys: {broken[:5]}")
    finally:
        if sqlite:
            if connection.in_transaction():  # left open only by a failure: undo it first,
                connection.rollback()  # or the pragma below would be ignored
            connection.connection.driver_connection.execute("PRAGMA foreign_keys=ON")
