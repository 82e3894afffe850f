"""What a scenario is given: the run's sizes, its PostgreSQL and where to print."""

from __future__ import annotations

import dataclasses
import sys
import typing as t

from reliability import _harness as h


@dataclasses.dataclass
class Context:
    scale: h.Scale
    #: The run's own PostgreSQL cluster (``tests.support.private_servers.PgCluster``).
    cluster: t.Any
    #: Settings the cluster was started with (a restart passes them again).
    settings: dict[str, t.Any]
    driver: str = "psycopg2"

    def database(self, name: str) -> str:
        """A new database ``name`` in the cluster (dropped first if there); its URL."""
        return h.new_database(self.cluster, name, self.driver)

    def restart_database(self, mode: str) -> None:
        """Halt the cluster (``fast`` or ``immediate``) and start it again."""
        self.cluster.halt(mode)
        self.cluster.start(**self.settings)

    def show(self, result: h.Result) -> None:
        print(result.line(), flush=True)
        for key, value in result.extra.items():
            print(f"    {key}: {value}", flush=True)
        for note in result.notes:
            print(f"    {note}", flush=True)

    def say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)
