"""Repro probe: Database.exists() compares a traced primary key (JSON: str for a
UUID, str for a datetime) with an untyped column. Does it find the row?"""
import datetime as dt
import json
import sys
import uuid

import sqlalchemy as sa

from flask import Flask
from flask_idempotency.testing._control import Control, TraceEntry
from flask_idempotency.testing._database import Database

url = sys.argv[1]
eng = sa.create_engine(url)
md = sa.MetaData()
t1 = sa.Table("kr_uuid_pk", md, sa.Column("id", sa.Uuid, primary_key=True))
t2 = sa.Table("kr_dt_pk", md, sa.Column("at", sa.DateTime(timezone=True), primary_key=True),
              sa.Column("n", sa.Integer, primary_key=True))
md.drop_all(eng); md.create_all(eng)
u = uuid.uuid4(); now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
with eng.begin() as c:
    c.execute(t1.insert().values(id=u)); c.execute(t2.insert().values(at=now, n=1))
import tempfile
d = Database(Flask("x"), url, Control(tempfile.mkdtemp()))
for table, cols, pk in [("kr_uuid_pk", ("id",), (u,)), ("kr_dt_pk", ("at", "n"), (now, 1))]:
    # the trace goes through JSON (TraceEntry.as_json uses default=str)
    e = TraceEntry.from_json(TraceEntry("r", "k", "row", table, cols, pk, 1).as_json())
    try:
        print(f"{url.split(':')[0]:28} {table}: pk={e.pk!r} exists={d.exists(e)}")
    except Exception as exc:
        print(f"{url.split(':')[0]:28} {table}: pk={e.pk!r} RAISES {type(exc).__name__}: {str(exc).splitlines()[0]}")
md.drop_all(eng)
