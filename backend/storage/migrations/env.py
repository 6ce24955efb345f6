"""Alembic environment: runs on the connection ``backend.storage.migrations`` hands it."""

from alembic import context

connection = context.config.attributes["connection"]
# render_as_batch: SQLite alters tables by copying them; PostgreSQL alters in place.
context.configure(connection=connection, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
