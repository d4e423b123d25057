"""Options that several commands take, defined once so that each is spelled and means the same everywhere.

`--quiet` and `--json` are every command's: --quiet leaves only warnings and errors on the terminal, --json
writes the command's result as a JSON document (`"schema": "quantdiff.<command>"`), '-' to stdout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

QUIET_HELP = "Print only warnings and errors: no progress bars, tables or status lines (the result still goes to --json, --out, --plot)."
JSON_HELP = "Write the result as JSON to this file (\"schema\": \"quantdiff.<command>\"); '-' writes it to stdout and everything else to stderr."
MODELS_HELP = "Model directories, GGUF files (dequantized first), built-in names (tiny, bb, their /standard, /diff …; smollm2, gemma3) or hub ids (org/name, org/name@revision)."

QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", help=JSON_HELP)]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, cuda:1, mps … or auto (the default: CUDA if available, else CPU).")]
FileForceOpt = Annotated[bool, typer.Option("--force", help="Replace existing output files that quantdiff did not write (it replaces its own without asking).")]
PartialOpt = Annotated[bool, typer.Option("--allow-partial", help="Accept models where some attention module or decoder layer is never reached (recorded in the JSON).")]
RemoteOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Run the model's own Python code (off by default; recorded in the JSON).")]
RevisionOpt = Annotated[Optional[str], typer.Option("--revision", help="Hub revision (branch, tag or commit); only for hub ids (an error otherwise).")]
BosOpt = Annotated[str, typer.Option("--bos", help="BOS first in every sequence cut from text: auto (as each model was trained: its recipe, its GGUF file's add_bos_token, else its tokenizer), always, never. input_ids records stay as given. Recorded in the JSON.")]
