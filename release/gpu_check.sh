#!/usr/bin/env bash
# devshim's check on a machine with one NVIDIA GPU (a few minutes), run from a checkout:
#
#     release/gpu_check.sh [OUT_DIR] [--dry-run]        # OUT_DIR defaults to $OUT, else ./gpu-check-results
#
# (a) the conformance kit, pytest --devshim-plugin=cuda; (b) `make demo` on the GPU: examples/train_gpt.py, ZeRO-2,
# through the deepspeed launcher on 1 rank, devshim standing aside and with DEVSHIM_CUDA_FACADE=1; (c) a 1-GPU ZeRO-2
# step with `import devshim_core.auto` against the same step without it, in paired rounds, judged against <= 1.01x.
# Results: OUT_DIR/gpu-check.json and gpu-check.txt, logs in OUT_DIR/logs (release/gpu_check.py has the details).
#
# The machine needs no internet: the venv is made from the machine's own Python whose torch sees a GPU
# (--system-site-packages, so its torch, DeepSpeed and pytest are used as they are; GPU_CHECK_PYTHON names one), and
# devshim's distributions are installed from this checkout with pip --no-deps --no-build-isolation --no-index -e,
# or, where pip cannot build them, linked in as sources. A part whose dependency is absent is skipped, saying so.
# --dry-run finds the Python and writes what each part would run, without installing or running anything.
# Exit status: 0 all parts passed, 1 a part failed, 2 a part was skipped (e.g. no GPU) and none failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY_RUN=0
OUT_ARG=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu_check.sh: unknown option $arg (try --help)" >&2; exit 64 ;;
        *) OUT_ARG="$arg" ;;
    esac
done
OUT_DIR="${OUT_ARG:-${OUT:-$PWD/gpu-check-results}}"
mkdir -p "$OUT_DIR/logs" || { echo "gpu_check.sh: cannot create $OUT_DIR" >&2; exit 64; }
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
say() { echo "[gpu_check] $*" >&2; }

# 1. the machine's Python whose torch sees a GPU
PROBE='import json, torch; print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}))'
BASE_PY=""
HELPER_PY=""  # any Python 3.10+, to write the results when no GPU is found
TRIED=()
for candidate in "${GPU_CHECK_PYTHON:-}" python3 python /usr/bin/python3 /usr/local/bin/python3 /opt/conda/bin/python; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    resolved="$(readlink -f "$(command -v "$candidate")")"
    case " ${SEEN:-} " in *" $resolved "*) continue ;; esac  # python, python3 and /usr/bin/python3 are often one
    SEEN="${SEEN:-} $resolved"
    "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || continue
    [ -n "$HELPER_PY" ] || HELPER_PY="$candidate"
    facts="$("$candidate" -c "$PROBE" 2>>"$OUT_DIR/logs/find-python.log")"
    echo "$candidate: ${facts:-torch does not import}" >>"$OUT_DIR/logs/find-python.log"
    TRIED+=("$candidate: ${facts:-no torch}")
    devices=0
    [ -z "$facts" ] || devices="$("$candidate" -c 'import json, sys; print(json.loads(sys.argv[1])["devices"])' "$facts" 2>/dev/null)"
    if [ "${devices:-0}" -ge 1 ] 2>/dev/null; then
        BASE_PY="$(command -v "$candidate")"
        break
    fi
done

if [ -z "$BASE_PY" ]; then
    reason="no Python here has a torch that sees a GPU (tried: $(IFS=';'; echo "${TRIED[*]:-none}")); nothing was installed or run"
    say "$reason"
    if [ -z "$HELPER_PY" ]; then
        printf '{"outcome": "incomplete", "parts": [], "reason": "%s"}\n' "no Python 3.10+ found" >"$OUT_DIR/gpu-check.json"
        echo "devshim GPU check: incomplete: no Python 3.10+ found" | tee "$OUT_DIR/gpu-check.txt"
        exit 2
    fi
    "$HELPER_PY" "$ROOT/release/gpu_check.py" --out "$OUT_DIR" --skip-reason "$reason"
    exit $?
fi
say "using $BASE_PY"

if [ "$DRY_RUN" = 1 ]; then
    "$BASE_PY" "$ROOT/release/gpu_check.py" --out "$OUT_DIR" --python "$BASE_PY" --install "dry run: nothing installed" --dry-run
    exit $?
fi

# 2. a venv on top of it, with devshim from this checkout
VENV="${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/devshim-gpu-check-venv}"
if [ ! -x "$VENV/bin/python" ]; then
    "$BASE_PY" -m venv --system-site-packages "$VENV" >"$OUT_DIR/logs/venv.log" 2>&1 \
        || "$BASE_PY" -m venv --system-site-packages --without-pip "$VENV" >>"$OUT_DIR/logs/venv.log" 2>&1 \
        || { "$BASE_PY" "$ROOT/release/gpu_check.py" --out "$OUT_DIR" --skip-reason "could not create a venv from $BASE_PY (logs/venv.log)"; exit $?; }
fi
VPY="$VENV/bin/python"
if "$VPY" -m pip install --quiet --no-deps --no-build-isolation --no-index \
        -e "$ROOT" -e "$ROOT/kernels" -e "$ROOT/plugins/cpu_reference" -e "$ROOT/plugins/cuda" \
        >"$OUT_DIR/logs/install.log" 2>&1; then
    INSTALL="pip install --no-deps --no-build-isolation -e (editable, native libraries built)"
else
    say "pip could not install devshim from the checkout (logs/install.log); linking the sources instead"
    INSTALL="$("$VPY" "$ROOT/release/gpu_check.py" link-sources --venv "$VENV" 2>>"$OUT_DIR/logs/install.log") (pip failed: logs/install.log; no native libraries)" \
        || { "$BASE_PY" "$ROOT/release/gpu_check.py" --out "$OUT_DIR" --skip-reason "devshim could not be installed into $VENV (logs/install.log)"; exit $?; }
fi
say "devshim installed: $INSTALL"

# 3. the checks
"$VPY" "$ROOT/release/gpu_check.py" --out "$OUT_DIR" --python "$VPY" --install "$INSTALL"
