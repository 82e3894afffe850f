#!/bin/bash
# Repro: pytest stopped by SIGINT / SIGTERM / SIGKILL while a kit test runs.
# Lists what is left: the kit's gunicorn processes (ours: cwd is this project)
# and the kit_<hex> databases this run created.
cd "$(dirname "$0")/userproj"
HERE=$(pwd -P)
export PYTHONPATH=/work/wt-kitrev
ours() {  # kit server processes whose cwd is this project
  for p in $(pgrep -f "flask_idempotency.testing._serve:create"); do
    [ "$(readlink /proc/$p/cwd 2>/dev/null)" = "$HERE" ] && echo $p; done; }
dbs() { psql -h 127.0.0.1 -U postgres -Atc "select datname from pg_database where datname like 'kit\_%' order by 1"; }
for sig in ${SIGS:-INT TERM KILL}; do
  before=$(dbs)
  # (a background job ignores SIGINT: restore it, as a terminal would deliver it)
  /work/main/.venv/bin/python -c "import os,signal,sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, [sys.executable, '-m', 'pytest', '-p', 'no:cacheprovider', '-q', 'test_hang.py'])" >/tmp/kr/hang.$sig.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do [ -n "$(ours)" ] && break; sleep 0.2; done
  sleep ${SETTLE:-8}
  kill -$sig $pid; wait $pid; rc=$?
  sleep ${SETTLE:-8}
  new=$(comm -13 <(echo "$before") <(dbs))
  left=$(ours | tr '\n' ' ')
  echo "SIG$sig: pytest rc=$rc; kit_ databases left by this run: ${new:-none}; kit server pids left: ${left:-none}"
  [ -n "$left" ] && ps -o pid,ppid,sid,etime,cmd -p $(echo $left | tr ' ' ',') | cut -c1-110
  for p in $left; do kill -9 $p 2>/dev/null; done          # only ours
  for d in $new; do psql -qh 127.0.0.1 -U postgres -c "DROP DATABASE \"$d\" WITH (FORCE)"; done
done
