# The two commands of the README. Each installs what it needs on first use (scripts/setup.sh).
export OMP_WAIT_POLICY := PASSIVE

.PHONY: reproduce test setup

setup:
	bash scripts/setup.sh

reproduce: setup
	.venv/bin/quantdiff reproduce bb --out report --items 100 --force

test: setup
	.venv/bin/python -m pytest -q --basetemp=/tmp/quantdiff-tests-$$(id -u)
