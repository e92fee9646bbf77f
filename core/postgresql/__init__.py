"""The PostgreSQL backend of the Store, by concern.

``schema`` (tables, indexes, forward migrations under an advisory lock), ``writes`` (a session write: lock
the row, then one statement), ``landing`` (operations that land even when their caller is cancelled),
``errors`` (driver failures to ``StoreError``), ``rows`` (rows to records and back), ``glob`` (SQLite
``GLOB`` patterns as PostgreSQL regular expressions). ``core.postgresql.store.PostgresqlStore`` puts them
together behind the ``Store`` protocol, over an asyncpg connection pool.
"""
