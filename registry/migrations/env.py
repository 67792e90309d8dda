"""Alembic environment for the ledger. `registry.db.upgrade` passes the engine in; there
is no alembic.ini, so migrations run the same from any working directory."""
from __future__ import annotations

from alembic import context

from registry.models import Base

engine = context.config.attributes.get("engine")
if engine is None:
    raise RuntimeError("run the ledger migrations through registry.db.upgrade(url)")

with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=context.config.attributes["version_table"],
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER most things
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()
