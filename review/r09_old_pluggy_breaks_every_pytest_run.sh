#!/bin/bash
# Repro: the pytest11 entry point is registered by every install of
# flask-idempotency (not only the [testing] extra). Its plugin uses
# @pytest.hookimpl(wrapper=True), which needs pluggy >= 1.2. With pytest 7.2
# and pluggy 1.0 (allowed by pytest 7.x), pytest cannot start in ANY project.
set -e
V=/tmp/kr/venv7
[ -x $V/bin/python ] || { python3 -m venv $V; $V/bin/pip install -q "pytest==7.2.2" "pluggy==1.0.0"; }
SP=$($V/bin/python -c "import site;print(site.getsitepackages()[0])")
# flask, sqlalchemy, flask-idempotency (its entry point) from the project venv, after pytest 7.2's
echo "import site; site.addsitedir('/work/main/.venv/lib/python3.11/site-packages')" > $SP/zz_main.pth
mkdir -p /tmp/kr/empty && cd /tmp/kr/empty
printf 'def test_x():\n    assert 1\n' > test_a.py
PYTHONPATH=${KIT_TREE:-/work/wt-kitrev} $V/bin/python -m pytest -q -p no:cacheprovider -p no:xdist -p no:xdist.looponfail 2>&1 | tail -3
