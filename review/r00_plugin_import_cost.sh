#!/bin/bash
# Repro: the plugin (loaded by the entry point in every pytest run) imports the
# whole flask_idempotency package (flask, sqlalchemy, dialects, apscheduler).
# One trivial test in an empty folder, with and without the plugin.
mkdir -p /tmp/kr/empty && cd /tmp/kr/empty && printf "def test_x():\n    assert 1\n" > test_a.py
P=/work/main/.venv/bin/python
for i in 1 2 3 4 5 6; do
 a=$( { /usr/bin/time -f %e $P -m pytest -q -p no:cacheprovider >/dev/null; } 2>&1 )
 b=$( { /usr/bin/time -f %e $P -m pytest -q -p no:cacheprovider -p no:flask_idempotency.testing.plugin >/dev/null; } 2>&1 )
 echo "with=$a without=$b"
done
