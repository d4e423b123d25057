"""`quantdiff train RECIPE`: train the matched arms a recipe describes, for each of its seeds (resumes if interrupted)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

import typer

from quantdiff.cli.options import JsonOpt, QuietOpt

# What the --json result repeats of each arm's train_log.json (the whole log stays beside the model).
LOG_FIELDS = ("kind", "parameters", "steps", "tokens", "held_out_loss", "unigram_entropy", "final_train_loss", "wall_time_s")
SETTABLE = ("data", "model", "train", "tasks", "analysis")  # the sections of one key = value each ([[arms]] are tables)


def train(
    recipe: Annotated[str, typer.Argument(help="Recipe file, or a recipe name such as 'tiny'.")],
    out: Annotated[Path | None, typer.Option(help="Where the models go (OUT/<arm>: OUT/standard, OUT/diff by default; a recipe listing seeds: OUT/seed-<s>/<arm>); default runs/<recipe name>.")] = None,
    force: Annotated[bool, typer.Option(help="Retrain from scratch: ignore checkpoints and replace existing models (every seed), and an existing --json file.")] = False,
    jobs: Annotated[int, typer.Option("--jobs", help="Seeds trained at once, in worker processes sharing the CPU threads (each seed's output in OUT/seed-<s>/train_output.txt).")] = 1,
    settings: Annotated[list[str] | None, typer.Option("--set", help="SECTION.KEY=VALUE: a recipe value changed for this run (repeatable; VALUE in TOML, a bare word is a string), e.g. --set train.steps=500. The recipe.toml saved beside the models says so.")] = None,
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Train models that differ only in their attention, to compare them fairly.

    Every arm of the recipe (by default standard and Diff) is trained on the same batches in the same order, for
    each seed of the recipe; an interrupted run resumes from its last checkpoint and leaves finished seeds as they
    are."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # busy-waiting OpenMP threads stall CPU steps for seconds
    from quantdiff.train.determinism import pin_environment

    notes = pin_environment()  # before torch is imported: the kernels that make a seed's weights the same on any machine
    from quantdiff.cli.output import check_json, result_console, write_result
    from quantdiff.cli.validate import check_positive
    from quantdiff.report.console import line_console
    from quantdiff.train.guards import check_out
    from quantdiff.train.recipe import load_recipe, parse_recipe
    from quantdiff.train.seeds import run_dirs, train_seeds

    check_positive(jobs=jobs)
    parsed = load_recipe(recipe)
    if settings:
        parsed = parse_recipe(with_settings(parsed.source, settings), parsed.name)
    out = out or Path("runs") / parsed.name
    sources = [p for p in [Path(recipe)] if p.is_file()]
    # the models are written at the end: refuse what they may not replace before training
    dirs = run_dirs(parsed, out)
    if out not in dirs.values():
        check_out(out, (), sources)
    for directory in dirs.values():
        check_out(directory, parsed.arm_names, sources)
    check_json(json_path, sources, force, [("the arm directory", d / arm) for d in dirs.values() for arm in parsed.arm_names])
    for note in notes:  # after every check: a failing run prints only its error line
        line_console(stderr=True).print(note)
    runs = train_seeds(parsed, out, force=force, jobs=jobs, console=line_console(stderr=True, quiet=quiet))  # progress: stderr
    result_console(json_path, quiet).print("models saved: " + "  ".join(str(p) for paths in runs.values() for p in paths.values()))
    write_result(json_path, "train", {"recipe": parsed.name, "out": str(out), "runs": _run_records(runs)}, force)


def _run_records(runs: dict[int, dict[str, Path]]) -> list[dict]:
    """One record per seed and arm: where its model is and the headline figures of its train_log.json."""
    import json

    records = []
    for seed, paths in runs.items():
        for arm, path in paths.items():
            log = json.loads((path / "train_log.json").read_text(encoding="utf-8"))
            records.append({"seed": seed, "arm": arm, "path": str(path), **{key: log.get(key) for key in LOG_FIELDS}})
    return records


def with_settings(source: str, settings: list[str]) -> str:
    """Recipe text with each SECTION.KEY=VALUE set: the key's line replaced, or added at the top of its section
    (the section appended if absent). Text rather than parsed values, so that the recipe.toml saved beside the
    models, which resuming and `reproduce` read, is exactly what trained them."""
    import tomllib

    from quantdiff.core.errors import ConfigError
    from quantdiff.train.recipe_types import toml_text

    lines = source.splitlines()
    for setting in settings:
        match = re.fullmatch(r"([a-z_]+)\.([a-z_0-9]+)=(.*)", setting.strip())  # no newline: one line of TOML
        if not match or match.group(1) not in SETTABLE:
            raise ConfigError(f"--set takes SECTION.KEY=VALUE with SECTION one of {', '.join(SETTABLE)}, got {setting!r}")
        section, key, value = match.groups()
        try:
            value = toml_text(tomllib.loads(f"v = {value}")["v"])
        except tomllib.TOMLDecodeError:
            value = toml_text(value)  # a bare word: a string
        line = f"{key} = {value}  # --set"
        header = next((i for i, text in enumerate(lines) if re.match(rf"\s*\[{section}\]\s*(#.*)?$", text)), None)
        if header is None:
            lines += ["", f"[{section}]", line]
            continue
        end = next((i for i in range(header + 1, len(lines)) if re.match(r"\s*\[", lines[i])), len(lines))
        found = next((i for i in range(header + 1, end) if re.match(rf"\s*{key}\s*=", lines[i])), None)
        if found is None:
            lines.insert(header + 1, line)
        else:
            lines[found] = line
    return "\n".join(lines) + "\n"
