#!/bin/sh
# Repro: create_app(config_class=Config) + app.config.from_object(): the kit
# calls it with a dict, from_object(dict) picks up nothing, and the served app
# (and create_all) run against the app's own configured database.
cd "$(dirname "$0")/userproj"
psql -qh 127.0.0.1 -U postgres -c "DROP DATABASE IF EXISTS kitrev_production" -c "CREATE DATABASE kitrev_production"
/work/main/.venv/bin/python -m pytest -p no:cacheprovider -q test_classcfg.py \
  -o idempotency_app=classcfg_app:create_app \
  --idempotency-database=postgresql+psycopg2://postgres@127.0.0.1/postgres 2>&1 | tail -25
echo "--- rows in the 'production' database after the test:"
psql -h 127.0.0.1 -U postgres -d kitrev_production -c "select * from orders" -c "select key, status from idempotency_keys"
