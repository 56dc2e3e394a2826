#!/usr/bin/env bash
# The GPU check: one device command (one H200, Python 3.12, torch 2.11+cu130, nvcc 13.0, no network)
# that installs what it needs, precompiles FlashInfer, runs the CUDA tests and the GPU benchmarks, and
# brings every log back. Its dry run checks, here and without a GPU, everything up to the GPU.
#
#   ./scripts/gpu_wheels.sh                                  # here, once: the wheels the machine lacks, in .whl/
#   device run, carry [".whl"]:  bash scripts/gpu_check.sh   # about 5 to 9 minutes (FlashInfer's build decides)
#   again for some steps only:   STEPS=tests,decode bash scripts/gpu_check.sh   (a warm machine keeps
#                                /tmp/site and FlashInfer's build cache, so later steps need not rerun install/jit)
#   here, no GPU, no .whl/, no network:  scripts/gpu_check.sh --dry-run   (tests/test_gpu_check.py runs it)
#
# Steps on the device, in order (STEPS picks some; a step that fails never stops the next):
#   install    the carried wheels, then radixrt built from this tree (never a radixrt wheel in .whl/)
#   probe      nvidia-smi, nvcc, CUDA_HOME and the libraries FlashInfer links, torch, flashinfer
#   jit        every FlashInfer module the run needs (JIT_SHAPES below), in one parallel build
#   bandwidth  HBM bandwidth measured with a device copy (the decode bound uses it, not a datasheet)
#   tests      the tests marked `cuda` (pytest -m cuda), junit XML back
#   decode     bench/gpu_decode.py: decode tok/s at batch 1, 32, 128 against the measured bound
#   extend     bench/flashinfer_extend.py: ragged + paged + merge against one paged pass
#   modules    the compiled FlashInfer modules and their sizes, and any the jit list missed
# The benchmark models are built in the background from install on, and waited for before tests.
# Dry-run steps: install (the same recipe into a temporary target, on a radixrt wheel built here
# from a copy of what the device tool carries), jit (the spec list constructed, not compiled), tests
# (the `cuda` selection, collected), carry (what travels against the 64 MiB limit).
#
# Everything lands in $OUT (the device tool returns at most 8 files there, so: gpu_check.log, every
# step's output in order; summary.tsv; bandwidth.json; cuda_tests.xml; gpu_decode.json;
# flashinfer_extend.json; modules.txt). Exit status: 0 when every selected step passed.
# Inputs, each overridable from the environment: WHEELS, WHEEL_RECIPE, DEVICE_WHEELS, CUDA_MARK,
# JIT_SHAPES, CARRY, CARRY_LIMIT_MIB, BUDGET_S, PYTHON, RADIXRT_WHEEL (dry run: use this wheel).
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  "") MODE=run ;;
  --dry-run) MODE=dry ;;
  *) echo "usage: [STEPS=a,b] $0 [--dry-run]" >&2; exit 2 ;;
esac
if [ "$MODE" = dry ]; then ALL_STEPS=install,jit,tests,carry; else ALL_STEPS=install,probe,jit,bandwidth,tests,decode,extend,modules; fi
STEPS=${STEPS:-$ALL_STEPS}
for s in ${STEPS//,/ }; do
  case ",$ALL_STEPS," in *",$s,"*) ;; *) echo "gpu_check: unknown step '$s' for this mode; steps: $ALL_STEPS" >&2; exit 2 ;; esac
done

# -- inputs ----------------------------------------------------------------------------------------
WHEELS=${WHEELS:-.whl}                         # the carried wheels
WHEEL_RECIPE=${WHEEL_RECIPE:-scripts/gpu_wheels.sh}  # what fills $WHEELS (the dry run checks it names each wheel)
# What the device image lacks and the run imports: radixrt's [srt] and [cuda] needs and theirs.
DEVICE_WHEELS=${DEVICE_WHEELS:-"flashinfer-python apache-tvm-ffi msgspec pyzmq fastapi uvicorn starlette pydantic pydantic-core annotated-types typing-inspection"}
# What the image has (the device's package list, read 2026-11-17), of what radixrt and flashinfer import.
IMAGE_PACKAGES="torch transformers tokenizers safetensors requests tqdm uvloop sortedcontainers numpy prometheus-client
  pytest einops ninja nvidia-ml-py tabulate click packaging typing-extensions h11 setuptools wheel"
# imported only by grammar-constrained requests (xgrammar), GGUF models (gguf) and compressed-tensors
# checkpoints (compressed-tensors), of which the CUDA run sends or loads none
LAZY_PACKAGES="xgrammar gguf compressed-tensors"
CUDA_MARK=${CUDA_MARK:-cuda}                   # pytest -m: the tests that need the GPU
REQUIRED_CUDA_TESTS=${REQUIRED_CUDA_TESTS:-"fp8 tensor_core graph"}  # each must name one of the selected tests
# The attention shapes the run plans, one a line: heads/kv_heads/head_dim q_dtype kv_dtype kinds
# (kinds: full, window, cap, window+cap). Most needed first: the build starts them first.
JIT_SHAPES=${JIT_SHAPES:-"
16/8/128 bf16 bf16 full          # llama-1b: bench/gpu_decode.py (and fa3 at 128: bench/flashinfer_extend.py)
12/4/64  bf16 bf16 full          # llama-100m: the engine tests; test_torch_backend (4, 4), retention
8/2/64   bf16 bf16 full          # tensor-core decode: test_torch_backend (8, 2), the graph tests
8/2/64   bf16 fp8_e4m3 full      # fp8 KV: test_cuda's tensor-core graphs, test_kv_quant
8/2/64   bf16 fp8_e5m2 full      # test_kv_quant
8/2/64   bf16 bf16 window+cap,window,cap   # test_attention_options' kinds, test_cuda's two kinds
"}
CARRY=${CARRY:-.whl}                           # carried besides the tree (the device call's carry)
CARRY_LIMIT_MIB=${CARRY_LIMIT_MIB:-64}
WHEELS_ESTIMATE_MIB=21  # the recipe's wheels when .whl/ is absent: 20.7 MiB for cp312, measured 2026-12
BUDGET_S=${BUDGET_S:-560}                      # the whole run; the device tool stops a command at 600 s
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ "$MODE" = dry ] && [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python
else PY=python3; fi

if [ "$MODE" = run ]; then
  SITE=/tmp/site WORK=/tmp/gpu_check  # fixed: a warm machine keeps them for a rerun of some steps
  OUT=${OUT:-/tmp/gpu_check_out}
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") SITE=$WORK/site
  trap 'rm -rf "$WORK"' EXIT
  OUT=${OUT:-$WORK/out}
fi
mkdir -p "$WORK" "$OUT"
LOG=$OUT/gpu_check.log SUMMARY=$OUT/summary.tsv
: >"$LOG"; : >"$SUMMARY"
export MODE WHEELS WHEEL_RECIPE DEVICE_WHEELS IMAGE_PACKAGES LAZY_PACKAGES CUDA_MARK REQUIRED_CUDA_TESTS JIT_SHAPES
export CARRY CARRY_LIMIT_MIB WHEELS_ESTIMATE_MIB PY SITE WORK OUT
export PYTHONUNBUFFERED=1
if [ "$MODE" = run ]; then
  export PYTHONPATH=$SITE FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
else
  export FLASHINFER_WORKSPACE_BASE=$WORK/flashinfer FLASHINFER_CUDA_ARCH_LIST=9.0a  # a constructed spec writes sources
fi

# -- the steps (each runs in its own bash under a time limit; a non-zero exit fails only that step) ---

step_install() {
  "$PY" -P - <<'PY' || return 1
# Every distribution radixrt needs on the device ([srt] and [cuda] in pyproject.toml) is in the image,
# carried as a wheel, or imported lazily; every carried wheel is in .whl/ (device) or named by the
# wheel recipe (dry run, without .whl/).
import os, re, sys, tomllib
from pathlib import Path

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = project["dependencies"] + [r for extra in ("srt", "cuda") for r in project["optional-dependencies"][extra]]
needs = {norm(re.match(r"\s*([A-Za-z0-9_.-]+)", r).group(1)) for r in reqs}
carried = {norm(n) for n in os.environ["DEVICE_WHEELS"].split()}
covered = carried | {norm(n) for n in (os.environ["IMAGE_PACKAGES"] + " " + os.environ["LAZY_PACKAGES"]).split()}
missing = sorted(needs - covered)
if missing:
    sys.exit(f"install: FAILED: radixrt needs {', '.join(missing)} on the device, which neither the image nor "
             "DEVICE_WHEELS provides; add it to DEVICE_WHEELS and to the wheel recipe")
print(f"install: radixrt's {len(needs)} requirements (base, [srt], [cuda]) are in the image, carried, or lazy ({os.environ['LAZY_PACKAGES']})")
whl_dir = Path(os.environ["WHEELS"])
if whl_dir.is_dir():
    have, where = {norm(p.name.split("-")[0]) for p in whl_dir.glob("*.whl")}, f"{whl_dir}/"
elif os.environ["MODE"] == "run":
    sys.exit(f"install: FAILED: no {whl_dir}/ here: run scripts/gpu_wheels.sh and carry .whl")
else:
    recipe = Path(os.environ["WHEEL_RECIPE"])
    text = norm("\n".join(ln.split("#")[0] for ln in recipe.read_text().splitlines())) if recipe.is_file() else ""
    have = {n for n in carried if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)}
    where = f"the wheel recipe {recipe}" + ("" if text else " (missing)")
absent = sorted(carried - have)
if absent:
    sys.exit(f"install: FAILED: no wheel for {', '.join(absent)} in {where}")
print(f"install: the {len(carried)} wheels the image lacks are each in {where}")
PY
  local tree=. wheel=${RADIXRT_WHEEL:-} wheels=() w
  if [ -n "$wheel" ]; then
    echo "install: radixrt wheel given (RADIXRT_WHEEL): $wheel"
  else
    if [ "$MODE" = dry ]; then  # a copy of what the device tool carries: tracked and untracked-not-ignored files
      tree=$WORK/tree && mkdir -p "$tree"
      git ls-files -z -co --exclude-standard | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$tree" \
        || { echo "install: FAILED to copy the tree"; return 1; }
    fi
    rm -rf "$WORK/radixrt_wheel"
    "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$WORK/radixrt_wheel" "$tree" \
      || { echo "install: FAILED to build radixrt from the tree"; return 1; }
    wheel=$(ls "$WORK"/radixrt_wheel/radixrt-*.whl)
    echo "install: radixrt wheel built from the tree: $(basename "$wheel")"
  fi
  if [ -d "$WHEELS" ]; then
    for w in "$WHEELS"/*.whl; do
      case $(basename "$w") in radixrt-*) echo "install: ignored $w: radixrt comes from this tree" ;; *) wheels+=("$w") ;; esac
    done
  fi
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" "$wheel" \
    || { echo "install: FAILED: pip could not install into $SITE"; return 1; }
  echo "install: ${#wheels[@]} carried wheels and radixrt installed into $SITE"
  PYTHONPATH=$SITE "$PY" -P -c '
import os, radixrt, radixrt.kernels.flashinfer_backend, radixrt.lang, radixrt.worker.model_runner
site = os.environ["SITE"]
for m in (radixrt, radixrt.kernels.flashinfer_backend, radixrt.lang):
    assert m.__file__.startswith(site), f"{m.__name__} imports from {m.__file__}, not from {site}"
print(f"install: radixrt, radixrt.kernels and radixrt.lang import from {site}")' || { echo "install: FAILED: the installed radixrt does not import"; return 1; }
}

step_probe() {
  local ok=0
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || { echo "probe: FAILED: nvidia-smi"; ok=1; }
  echo "probe: CUDA_HOME=${CUDA_HOME:-unset} (FlashInfer compiles with \$CUDA_HOME/bin/nvcc and links -L\$CUDA_HOME/lib64 -lcudart -lcuda)"
  echo "probe: FLASHINFER_EXTRA_LDFLAGS=${FLASHINFER_EXTRA_LDFLAGS:-unset} FLASHINFER_CUDA_ARCH_LIST=$FLASHINFER_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
  "${CUDA_HOME:-/nonexistent}/bin/nvcc" --version | tail -2 || { echo "probe: FAILED: no nvcc under CUDA_HOME"; ok=1; }
  "$PY" -P -c '
import torch, flashinfer
print("probe: torch", torch.__version__, "cuda", torch.version.cuda, "| flashinfer", flashinfer.__version__, "from", flashinfer.__file__)
print("probe: device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
      "memory %.0f GiB" % (torch.cuda.get_device_properties(0).total_memory / 2**30))' || ok=1
  return $ok
}

step_jit() {
  "$PY" -P - <<'PY'
# The modules the run's shapes need, by FlashInferBackend's own rule (radixrt/kernels/flashinfer_backend.py);
# dry run: the JitSpecs constructed where flashinfer-python is importable, never compiled.
import os, sys, time
import torch
from radixrt.kernels import LayerAttention
from radixrt.kernels.flashinfer_backend import jit_modules, jit_specs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KINDS = {"full": LayerAttention(1.0), "window": LayerAttention(1.0, window=128), "cap": LayerAttention(1.0, softcap=30.0),
         "window+cap": LayerAttention(1.0, window=128, softcap=30.0)}
dry = os.environ["MODE"] == "dry"
sm90 = True if dry else torch.cuda.get_device_capability()[0] == 9


def pick(table: dict, key: str, what: str):
    if key not in table:
        raise ValueError(f"{what} {key!r} is none of {', '.join(table)}")
    return table[key]


modules, shapes, bad = [], 0, []
for line in os.environ["JIT_SHAPES"].splitlines():
    fields = line.split("#")[0].split()
    if not fields:
        continue
    try:
        if len(fields) != 4 or fields[0].count("/") != 2:
            raise ValueError("want: heads/kv_heads/head_dim q_dtype kv_dtype kinds")
        heads, kv_heads, head_dim = (int(x) for x in fields[0].split("/"))
        dtype, kv_dtype = pick(DTYPES, fields[1], "dtype"), pick(DTYPES, fields[2], "kv dtype")
        kinds = [pick(KINDS, k, "kind") for k in fields[3].split(",")]
        found = jit_modules(heads, kv_heads, head_dim, dtype, kv_dtype, kinds, sm90=sm90)
    except ValueError as e:
        bad.append(f"jit: FAILED: shape {line.strip()!r}: {e}")
        continue
    shapes += 1
    modules += [m for m in found if m not in modules]
if bad or not modules:
    sys.exit("\n".join(bad) or "jit: FAILED: JIT_SHAPES lists no shape")
print(f"jit: {len(modules)} attention modules from {shapes} shapes, and cascade (merge_state, the extend bench):")
for m in modules:
    print(f"  {m.kind:<8}{m.backend or '-':<4} q {str(m.q_dtype)[6:]:<9} kv {str(m.kv_dtype)[6:]:<14} head_dim {m.head_dim:<4}"
          f"window {str(m.window):<6}softcap {m.softcap}")
try:
    import flashinfer
    from flashinfer.jit import build_jit_specs
    from flashinfer.jit.cascade import gen_cascade_module
except ImportError as e:
    if not dry:
        sys.exit(f"jit: FAILED: flashinfer does not import: {e}")
    print(f"jit: flashinfer-python is not installed here ({e}): its inputs were checked above; no JitSpec was constructed")
    sys.exit(0)
specs = jit_specs(modules) + [gen_cascade_module()]
with open(os.path.join(os.environ["WORK"], "jit_names.txt"), "w") as f:
    f.write("".join(s.name + "\n" for s in specs))
if dry:
    missing = [str(p) for s in specs for p in s.sources if not os.path.exists(p)]
    if missing:
        sys.exit(f"jit: FAILED: sources missing for the constructed specs: {missing[:3]}")
    print(f"jit: flashinfer {flashinfer.__version__}: {len(specs)} JitSpecs constructed (not compiled), "
          f"{sum(len(s.sources) for s in specs)} sources present")
    sys.exit(0)
todo = [s for s in specs if not s.is_compiled]
print(f"jit: {len(todo)} of {len(specs)} to build with MAX_JOBS={os.environ.get('MAX_JOBS')}", flush=True)
start = time.perf_counter()
build_jit_specs(todo, verbose=False)
left = [s.name for s in specs if not s.is_compiled]
print(f"jit: built in {time.perf_counter() - start:.0f} s; not compiled: {left or 'none'}")
sys.exit(1 if left else 0)
PY
}

step_bandwidth() {
  "$PY" -P - <<'PY'
import json, os, torch
n = 4 << 30  # bytes per buffer: far past the 60 MB L2
src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
for _ in range(3):
    dst.copy_(src)
start, end, iters = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), 20
start.record()
for _ in range(iters):
    dst.copy_(src)
end.record()
torch.cuda.synchronize()
seconds = start.elapsed_time(end) / 1e3 / iters
tbs = 2 * n / seconds / 1e12  # bytes read and written
print(f"bandwidth: a {n / 2**30:.0f} GiB device copy in {seconds * 1e3:.2f} ms: {tbs:.2f} TB/s (read + write)")
json.dump({"copy_bytes": n, "seconds": seconds, "tb_s": tbs, "gpu": torch.cuda.get_device_name()},
          open(os.path.join(os.environ["OUT"], "bandwidth.json"), "w"))
PY
}

step_tests() {
  "$PY" -P - <<'PY' || return 1
# The marker expression names only registered markers (a typo would select nothing, silently).
import os, re, sys, tomllib
registered = {m.split(":")[0].strip() for m in tomllib.load(open("pyproject.toml", "rb"))["tool"]["pytest"]["ini_options"].get("markers", [])}
expr = os.environ["CUDA_MARK"]
names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr)) - {"and", "or", "not"}
if not names or names - registered:
    sys.exit(f"tests: FAILED: CUDA_MARK {expr!r} names {', '.join(sorted(names - registered)) or 'no marker'}, "
             f"not registered in pyproject.toml ({', '.join(sorted(registered)) or 'none'})")
print(f"tests: marker expression {expr!r}, registered in pyproject.toml")
PY
  local pytest=("$PY" -P -m pytest -p no:cacheprovider --strict-markers -m "$CUDA_MARK")
  if [ "$MODE" = dry ]; then
    "${pytest[@]}" --collect-only -q tests/ >"$WORK/collected.txt" 2>&1
    local rc=$?
    grep -E "::" "$WORK/collected.txt" >"$WORK/selected.txt"
    local n
    n=$(wc -l <"$WORK/selected.txt")
    if [ "$rc" -ne 0 ] || [ "$n" -eq 0 ]; then
      tail -5 "$WORK/collected.txt"; echo "tests: FAILED: pytest -m '$CUDA_MARK' selects no test (rc $rc)"; return 1
    fi
    sed 's/^/  /' "$WORK/selected.txt"
    echo "tests: $(tail -1 "$WORK/collected.txt")"
    local word
    for word in $REQUIRED_CUDA_TESTS; do
      grep -q -- "$word" "$WORK/selected.txt" || { echo "tests: FAILED: no selected test names '$word'"; return 1; }
    done
    echo "tests: the selection has tests naming each of: $REQUIRED_CUDA_TESTS"
    return 0
  fi
  local timeout_opt=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout=240)
  "${pytest[@]}" -q -rs "${timeout_opt[@]}" --junitxml="$OUT/cuda_tests.xml" tests/
}

step_decode() {
  local hbm
  hbm=$("$PY" -c 'import json, os; print(round(json.load(open(os.environ["OUT"] + "/bandwidth.json"))["tb_s"], 3))' 2>/dev/null) \
    || { hbm=4.3; echo "decode: no bandwidth measured in this run: bound at the $hbm TB/s measured on these machines before"; }
  "$PY" -P bench/gpu_decode.py --hbm-tbs "$hbm" && cp bench/results/gpu_decode.json "$OUT/"
}

step_extend() {
  "$PY" -P bench/flashinfer_extend.py && cp bench/results/flashinfer_extend.json "$OUT/"
}

step_modules() {
  "$PY" -P - <<'PY'
import os
from pathlib import Path
from flashinfer.jit import env
root = Path(env.FLASHINFER_JIT_DIR)
built = {p.parent.name: p.stat().st_size for p in sorted(root.glob("*/*.so"))}
listed = Path(os.environ["WORK"], "jit_names.txt")
wanted = set(listed.read_text().split()) if listed.exists() else set()
lines = [f"{size / 2**20:8.1f} MiB  {name}{'' if name in wanted or not wanted else '   (not in the jit list)'}"
         for name, size in built.items()]
lines += [f"     not built  {name}" for name in sorted(wanted - built.keys())]
lines.append(f"{sum(built.values()) / 2**20:8.1f} MiB in {len(built)} modules under {root}")
text = "\n".join(lines)
print(text)
Path(os.environ["OUT"], "modules.txt").write_text(text + "\n")
PY
}

step_carry() {
  "$PY" -P - <<'PY'
# What the device tool sends: tracked and untracked-not-ignored files, plus the carried paths.
import os, subprocess, sys
from pathlib import Path
MiB = 2**20
files = [f for f in subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, check=True,
                                   text=True).stdout.split("\0") if f and os.path.isfile(f)]
sizes = {f: os.path.getsize(f) for f in files}
parts = [(f"the tree ({len(files)} files)", sum(sizes.values()))]
for path in os.environ["CARRY"].split():
    p = Path(path)
    if p.exists():
        inside = [q for q in ([p] if p.is_file() else p.rglob("*")) if q.is_file()]
        parts.append((f"{path} ({len(inside)} files)", sum(q.stat().st_size for q in inside)))
        sizes.update({str(q): q.stat().st_size for q in inside})
    elif path == ".whl":
        parts.append((f".whl (absent here: the recipe's wheels, about {os.environ['WHEELS_ESTIMATE_MIB']} MiB)",
                      int(os.environ["WHEELS_ESTIMATE_MIB"]) * MiB))
    else:
        sys.exit(f"carry: FAILED: {path} is to be carried but does not exist")
total, limit = sum(n for _, n in parts), int(os.environ["CARRY_LIMIT_MIB"]) * MiB
print("carry: " + " + ".join(f"{what} {n / MiB:.1f} MiB" for what, n in parts) + f" = {total / MiB:.1f} of {limit // MiB} MiB")
if total > limit:
    big = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    sys.exit(f"carry: FAILED: {total / MiB:.1f} MiB is over the {limit // MiB} MiB limit; largest: "
             + ", ".join(f"{f} ({n / MiB:.1f} MiB)" for f, n in big))
PY
}

# -- the CUDA toolchain FlashInfer compiles with (before any step, so that every step sees it) -----

cuda_env() {
  # FlashInfer finds the toolkit through CUDA_HOME, else as dirname(dirname(which nvcc)), which is
  # wrong where nvcc is a wrapper script (/usr/local/bin/nvcc exec'ing the real one): ask nvcc itself.
  local home=${CUDA_HOME:-${CUDA_PATH:-}} how="CUDA_HOME/CUDA_PATH"
  if [ -z "$home" ] && command -v nvcc >/dev/null; then
    home=$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
    [ -n "$home" ] && home=$(readlink -f "$home") how="nvcc --dryrun's TOP"
  fi
  if [ -z "$home" ] && [ -x /usr/local/cuda/bin/nvcc ]; then home=/usr/local/cuda how="/usr/local/cuda"; fi
  if [ -z "$home" ]; then echo "cuda: FAILED: no CUDA toolkit found (no CUDA_HOME, no nvcc): FlashInfer cannot compile"; return 0; fi
  export CUDA_HOME=$home
  echo "cuda: CUDA_HOME=$home (from $how)"
  # It links -lcudart -lcuda from $CUDA_HOME/lib64: a toolkit laid out otherwise fails only at the
  # link, minutes into the build; point the linker at the libraries where they are instead.
  local libs=$WORK/cuda_libs lib found
  rm -rf "$libs" && mkdir -p "$libs"
  for lib in cudart cuda; do
    ls "$home"/lib64/lib$lib.so "$home"/lib64/stubs/lib$lib.so >/dev/null 2>&1 && continue
    found=$(find "$home"/ /usr/local/nvidia/ /usr/lib/x86_64-linux-gnu/ -name "lib$lib.so*" 2>/dev/null | sort | head -1)
    [ -n "$found" ] && ln -sf "$found" "$libs/lib$lib.so" && echo "cuda: lib$lib.so is not in $home/lib64: linking $found"
  done
  if [ -n "$(ls "$libs")" ]; then export FLASHINFER_EXTRA_LDFLAGS="-L$libs"; fi
  return 0
}

# -- the runner --------------------------------------------------------------------------------------

export -f step_install step_probe step_jit step_bandwidth step_tests step_decode step_extend step_modules step_carry
START=$(date +%s) DEADLINE=$(( $(date +%s) + BUDGET_S ))

record() {  # step status seconds
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$SUMMARY"
  printf '%s: %s (%s s)\n' "$1" "$2" "$3" | tee -a "$LOG"
}

selected() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

step() {  # name cap_s reserve_s: run step_<name> for at most cap_s, and never into the time later steps keep
  local name=$1 cap=$2 reserve=$3 left t start rc
  selected "$name" || return 0
  left=$(( DEADLINE - $(date +%s) - reserve ))
  t=$(( cap < left ? cap : left ))
  if [ "$t" -lt 10 ]; then record "$name" "skipped: BUDGET_S=$BUDGET_S spent" 0; return 0; fi
  printf '\n==== %s (limit %d s) ====\n' "$name" "$t" | tee -a "$LOG"
  start=$(date +%s)
  timeout --kill-after=10 "$t" bash -c "step_$name" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) record "$name" ok $(( $(date +%s) - start )) ;;
    124|137) record "$name" "FAILED: out of time after $t s" $(( $(date +%s) - start )) ;;
    *) record "$name" "FAILED (exit $rc)" $(( $(date +%s) - start )) ;;
  esac
}

run_plan() {  # "name:cap:floor ...", in order; floor: the time each later selected step keeps back
  local -a plan=($1)
  local i e name cap floor n f later
  for i in "${!plan[@]}"; do
    IFS=: read -r name cap floor <<<"${plan[$i]}"
    later=0
    for e in "${plan[@]:i+1}"; do
      IFS=: read -r n _ f <<<"$e"
      if selected "$n"; then later=$(( later + f )); fi
    done
    if [ "$name" = models ]; then wait_models; else step "$name" "$cap" "$later"; fi
    if [ "$name" = install ] && [ "$MODE" = run ]; then start_models; fi
  done
}

models_pid=""
start_models() {  # the benchmark models, built on the CPU while FlashInfer compiles
  selected tests || selected decode || return 0
  "$PY" -P -c "import sys; sys.path.insert(0, 'scripts'); from make_tiny_model import ensure_model
for family, size in [('llama', 'tiny'), ('qwen2', 'tiny'), ('llama', '100m'), ('llama', '1b')]: print(ensure_model(family, size), flush=True)" \
    >"$WORK/models.log" 2>&1 &
  models_pid=$!
}
wait_models() {
  [ -n "$models_pid" ] || return 0
  local t0 rc; t0=$(date +%s)
  wait "$models_pid"; rc=$?
  { printf '\n==== models (built in the background) ====\n'; cat "$WORK/models.log"; } | tee -a "$LOG"
  record models "$([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)")" "waited $(( $(date +%s) - t0 ))"
  models_pid=""
}

echo "gpu_check ($MODE): steps $STEPS; python $PY; out $OUT" | tee -a "$LOG"
if [ "$MODE" = run ]; then
  cuda_env >"$WORK/cuda_env.log" 2>&1  # not in a pipeline: its exports must reach the steps
  tee -a "$LOG" <"$WORK/cuda_env.log"
  run_plan "install:120:20 probe:30:10 jit:330:60 bandwidth:60:15 models:0:0 tests:330:120 decode:180:90 extend:90:40 modules:30:10"
else
  run_plan "install:120:0 jit:60:0 tests:120:0 carry:30:0"
fi

failed=$(awk -F'\t' '$2 != "ok" {print $1}' "$SUMMARY" | paste -sd, -)
n=$(wc -l <"$SUMMARY")
echo "gpu_check ($MODE): $(( n - $(awk -F'\t' '$2 != "ok"' "$SUMMARY" | wc -l) )) of $n steps ok in $(( $(date +%s) - START )) s${failed:+; FAILED: $failed}" | tee -a "$LOG"
[ -z "$failed" ]
