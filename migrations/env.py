"""Alembic environment of the kvhub store.

Run through ``kvhub db upgrade`` (kvhub.store.migrate builds the Config), or by developers with
``alembic -c migrations/alembic.ini ...`` (the URL then comes from ``-x db=URL``, ``KVHUB_DB_URL`` or
the default store).  Every migration runs in batch mode so the same scripts work on SQLite, whose
ALTER TABLE is limited, and PostgreSQL.  On SQLite foreign keys are off while tables are rebuilt
(dropping a parent table would otherwise cascade) and checked with ``PRAGMA foreign_key_check`` before
commit.  Concurrent upgrades of one database are serialised: by the write lock on SQLite (one
``BEGIN IMMEDIATE`` transaction for the whole upgrade), by an advisory lock on PostgreSQL.
"""

from alembic import context

from kvhub.errors import StoreError
from kvhub.store.engine import make_engine, write_engine
from kvhub.store.location import resolve_db_url

VERSION_TABLE = "kvhub_alembic_version"
_PG_LOCK_KEY = 0x6B76_6875_6200  # "kvhub\0": any constant shared by all kvhub processes

config = context.config
if config.config_file_name is not None:  # the developer's alembic CLI; `kvhub db` configures logging itself
    from logging.config import fileConfig

    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _target_metadata():
    """Live metadata, for `alembic check` / autogenerate only; migration scripts never import it."""
    metadata = config.attributes.get("target_metadata")
    if metadata is None:
        from kvhub.store.tables import Base

        metadata = Base.metadata
    return metadata


def _url() -> str:
    given = context.get_x_argument(as_dictionary=True).get("db") or config.get_main_option("sqlalchemy.url")
    return given or resolve_db_url()


def _configure(**kwargs) -> None:
    context.configure(
        target_metadata=_target_metadata(),
        render_as_batch=True,
        compare_type=True,
        version_table=VERSION_TABLE,
        **kwargs,
    )


def run_migrations_offline() -> None:
    """Emit SQL instead of running it (`alembic upgrade head --sql`)."""
    _configure(url=_url(), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _run(connection) -> None:
    # One transaction for the whole upgrade on SQLite too (Alembic's SQLite default commits per
    # migration): kvhub's engine begins it IMMEDIATE, so concurrent upgrades queue for the write lock
    # and each reads the stamped revision only once it holds it.
    _configure(connection=connection, transactional_ddl=True)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK_KEY})")
        context.run_migrations()
        if connection.dialect.name == "sqlite":
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if broken:
                raise StoreError(f"migration left dangling foreign keys {broken[:5]}; the upgrade was rolled back")


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = write_engine(make_engine(_url(), foreign_keys=False))
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
