# The two commands of the README. Each installs what it needs on first use (scripts/setup.sh).
export OMP_WAIT_POLICY := PASSIVE

.PHONY: reproduce test setup lock ranges

setup:
	bash scripts/setup.sh

reproduce: setup
	.venv/bin/quantdiff reproduce bb --out report --items 100 --force

# One pytest-xdist worker per core. loadgroup: each test goes to whichever worker is free, except that the
# modules marked xdist_group, each kept on one worker so its module-scoped fixtures (a real model measured, exports
# built) are built once.
test: setup
	.venv/bin/python -m pytest -q -n auto --dist loadgroup --basetemp=/tmp/quantdiff-tests-$$(id -u)

# Re-resolve the lock to the newest releases, reinstall, run the suite and the tested-range check (scripts/lock.sh).
lock:
	bash scripts/lock.sh

# The fast subset against the lowest and the newest transformers that pyproject.toml allows.
ranges: setup
	bash scripts/tested_ranges.sh
