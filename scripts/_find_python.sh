# shellcheck shell=bash
# Sourced by scripts/quickstart and scripts/test: find a Python >= 3.12 (Django 6
# needs it) and keep .venv (and scripts/test's older-Django venvs) installed.
# Every candidate is run, not just looked up: a pyenv shim such as `python3.12`
# exists on PATH yet fails unless that version is selected.

# Usage: _rj_python_ok PYTHON [need_venv]: whether PYTHON runs and is >= 3.12 and,
# with need_venv, can create a virtualenv (Debian ships venv/ensurepip apart).
_rj_python_ok() {
    local modules="sys"
    [[ "${2:-}" == need_venv ]] && modules="sys, venv, ensurepip"
    "$1" -c "import $modules; sys.exit(sys.version_info < (3, 12))" >/dev/null 2>&1
}

# Usage: find_python [MINOR]: print the path of the first usable interpreter, newest
# kind first; with MINOR (e.g. 3.12), an interpreter of that version when there is
# one. $PYTHON, when set, is tried before the others.
find_python() {
    local prefer="${1:-}" candidate pyenv_root i pass
    local -a candidates=()
    [[ -n "${PYTHON:-}" ]] && candidates+=("$PYTHON")
    candidates+=(python3.13 python3.12 python3)
    pyenv_root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"
    # Globs sort ascending; walk them newest first. An unmatched glob stays literal and fails the test.
    local -a pyenv_pythons=("$pyenv_root"/versions/3.1[23]*/bin/python3.1[23])
    for ((i = ${#pyenv_pythons[@]} - 1; i >= 0; i--)); do candidates+=("${pyenv_pythons[i]}"); done
    candidates+=(/usr/bin/python3.1[3-9] /usr/bin/python3.12)
    # First pass: only the preferred version (when one is asked for); second: any.
    for pass in prefer any; do
        [[ "$pass" == prefer && -z "$prefer" ]] && continue
        for candidate in "${candidates[@]}"; do
            if [[ "$pass" == prefer ]] && ! "$candidate" -c \
                "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$prefer')" \
                >/dev/null 2>&1; then
                continue
            fi
            if _rj_python_ok "$candidate" need_venv; then
                # The real interpreter, not a shim whose choice could change under us.
                "$candidate" -c 'import sys; print(sys.executable)'
                return 0
            fi
        done
    done
    echo "error: no Python >= 3.12 with the venv module found (tried: ${candidates[*]})." >&2
    echo "Install one (e.g. apt-get install python3.12-venv, or pyenv install 3.12) or set PYTHON." >&2
    return 1
}

# Usage: ensure_venv ROOT EXTRAS [VENV [PYTHON_MINOR [REQUIREMENT...]]]: create VENV
# (default ROOT/.venv) when missing or unusable, with a Python of PYTHON_MINOR when
# there is one, and `pip install -e ROOT[EXTRAS] REQUIREMENT...` into it, skipping
# pip while setup.cfg, pyproject.toml and the arguments are unchanged since the
# last install with the same EXTRAS.
ensure_venv() {
    local root="$1" extras="$2" venv="${3:-$1/.venv}" minor="${4:-}"
    local -a requirements=("${@:5}")
    local python stamp want
    if [[ -e "$venv" ]] && ! _rj_python_ok "$venv/bin/python"; then
        echo "$venv is broken or older than Python 3.12; recreating it." >&2
        rm -rf "$venv"
    fi
    if [[ ! -e "$venv" ]]; then
        python="$(find_python "$minor")"
        echo "Creating $venv with $("$python" -V 2>&1) ($python)." >&2
        "$python" -m venv "$venv"
    fi
    stamp="$venv/.rj-installed-${extras//,/-}"
    want="$("$venv/bin/python" -c 'import hashlib, sys
print(hashlib.sha256(b"".join(open(p, "rb").read() for p in sys.argv[1:3])
                     + " ".join(sys.argv[3:]).encode()).hexdigest())' \
        "$root/setup.cfg" "$root/pyproject.toml" "${requirements[@]}")"
    if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
        echo "Installing reliable-jobs[$extras]${requirements[*]:+ ${requirements[*]}} into $venv" \
             "(quietly; the first time takes a minute)." >&2
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
            -e "${root}[${extras}]" "${requirements[@]}"
        echo "$want" >"$stamp"
    fi
}
