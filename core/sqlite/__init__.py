"""The SQLite backend of the Store, by concern.

``schema`` (tables, indexes, forward migrations), ``procedures`` (the write statements, each one atomic
statement), ``rows`` (rows to records and back), ``writer`` (the one connection that writes, and how writes
share its commits). ``core.sqlite_store.SqliteStore`` puts them together behind the ``Store`` protocol.
"""
