# The two commands of the README. Each installs what it needs on first use (scripts/setup.sh).
export OMP_WAIT_POLICY := PASSIVE

.PHONY: reproduce test test-isolation setup lock ranges

setup:
	bash scripts/setup.sh

reproduce: setup
	.venv/bin/quantdiff reproduce bb --out report --items 100 --force

# One pytest-xdist worker per core. worksteal: a worker that runs out takes queued tests from the other, and
# tests/scheduling.py puts the minutes-long end-to-end tests where no core waits idle on them at the end. (loadgroup, which would keep the tests of a
# module-scoped fixture on one worker, does nothing under pytest 9: xdist 3.8 renames item._nodeid, which pytest 9
# no longer reads.)
# Bytecode caching on, whatever the shell says (PYTHONDONTWRITEBYTECODE=1 makes each of the suite's ~45 fresh
# processes compile quantdiff's modules again, ~1.3 s of CPU each, and pytest rewrite every test module's asserts
# again in each process); the caches go to __pycache__/, which git ignores.
test: setup
	env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest -q -p no:randomly -m "not real_exports and not pipeline" -n auto --dist worksteal --basetemp=/tmp/quantdiff-tests-$$(id -u)

# Order dependence made visible: the quick tests in a random order (seed printed), then every module alone
# (scripts/test_isolation.sh). CI runs it after make test.
test-isolation: setup
	env -u PYTHONDONTWRITEBYTECODE bash scripts/test_isolation.sh

# Re-resolve the lock to the newest releases, reinstall, run the suite and the tested-range check (scripts/lock.sh).
lock:
	bash scripts/lock.sh

# The fast subset in throwaway venvs: transformers at both ends of its range, torch 2.14.1 and 2.15.0 (the registry's
# CUDA wheels, run on the CPU; never installed by setup), every requirement at its lower bound (scripts/tested_ranges.sh).
ranges: setup
	bash scripts/tested_ranges.sh
