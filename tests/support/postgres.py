"""A throwaway PostgreSQL cluster for the tests: initdb into a temporary directory, listening on 127.0.0.1.

The binaries come from Debian's ``postgresql`` package (``/usr/lib/postgresql/<version>/bin``) or ``PATH``;
``.ci/run`` installs it. PostgreSQL refuses to run as root, so as root the server runs as the ``postgres``
user (``runuser``) in a directory it owns. Durability is off (``fsync``): the cluster dies with the tests.
Every test database gets its own name (``fresh_dsn``); clients connect as the superuser with trust auth.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from tests.support.ports import free_port

USER = "postgres"


def find_bindir() -> Path | None:
    """The directory holding initdb and pg_ctl, newest version first; None when PostgreSQL is absent."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
                        if Path(p).parent.name.isdigit() else 0, reverse=True)
    for directory in candidates:
        if (Path(directory) / "initdb").is_file() and (Path(directory) / "pg_ctl").is_file():
            return Path(directory)
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb and pg_ctl:
        return Path(initdb).resolve().parent
    return None


class PostgresCluster:
    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="chatbridge-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str, timeout: float = 60) -> None:
        command = [*args]
        if self._as_postgres:
            command = ["runuser", "-u", USER, "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=timeout)

    def start(self) -> None:
        if self._as_postgres:
            shutil.chown(self.root, USER, USER)
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8",
                  "--locale=C.UTF-8", "--no-sync")
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -F"
                   " -c full_page_writes=off -c synchronous_commit=off -c max_connections=200")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"),
                  "-o", options, "-w", "-t", "60", "start")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def fresh_dsn(self) -> str:
        """A new, empty database of its own."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self._run(str(self.bindir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, "-d", "postgres",
                  "-q", "-c", f"CREATE DATABASE {name}")
        return self.dsn(name)


@contextlib.contextmanager
def running_cluster() -> Iterator[PostgresCluster | str]:
    """A started cluster, or the reason there is none (to skip with)."""
    bindir = find_bindir()
    if bindir is None:
        yield ("PostgreSQL is not installed (initdb and pg_ctl; Debian: apt-get install postgresql)")
        return
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        yield "running as root, and runuser (to start PostgreSQL as the postgres user) is missing"
        return
    cluster = PostgresCluster(bindir)
    try:
        cluster.start()
    except (subprocess.SubprocessError, OSError) as exc:
        log = cluster.root / "server.log"
        detail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
        cluster.stop()
        raise RuntimeError(f"cannot start the test PostgreSQL cluster: {exc}\n{detail}") from exc
    try:
        yield cluster
    finally:
        cluster.stop()
