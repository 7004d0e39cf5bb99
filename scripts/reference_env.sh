#!/usr/bin/env bash
# An A/B environment (--opt-ab): a virtual environment built from the dependency files of a git ref
# (origin/main, a tag, HEAD), not from the work tree, so that two refs' stacks can be measured side by side.
#
#   scripts/reference_env.sh REF DEST [PIP_ARGS...]
#
# Run it inside the repository. It prints the new interpreter's path (DEST/bin/python, absolute) as the only
# line on standard output, for --opt-ab=...; pip and git talk on standard error. Read at REF, each when present:
#   pyproject.toml                 [project] dependencies, and the optional ones of the extras named in EXTRAS;
#   requirements*.txt, requirements*.lock (top level; pip's requirement format, as rye's lock files are): -r;
#   constraints*.txt (top level) and the paths at REF named in CONSTRAINTS (space-separated): -c.
# Nested requirements and constraints files are copied too, for the -r / -c lines of those.
# The project itself is not installed: the A/B worker imports this checkout's pytest_transformers_opt, so only
# the stack differs (for the side that runs pytest, add `pip install --no-deps -e .` after it).
# PIP_ARGS go to the one pip call (e.g. --no-deps, --extra-index-url URL, one more requirement).
# Environment: PYTHON, the interpreter the venv is made from (python3); EXTRAS, comma-separated extras of
# pyproject.toml; CONSTRAINTS; SYSTEM_SITE_PACKAGES=1, a venv that also sees PYTHON's own packages, so
# that what the files do not change comes from there (a GPU runner's CUDA torch, flash-attn) and only
# what they change is installed into the venv.
set -euo pipefail
shopt -s nullglob

if [ "$#" -lt 2 ]; then
    echo "usage: scripts/reference_env.sh REF DEST [PIP_ARGS...]" >&2
    exit 2
fi
ref=$1
dest=$2
shift 2
python=${PYTHON:-python3}

commit=$(git rev-parse --verify --quiet "${ref}^{commit}") || {
    echo "reference_env.sh: ${ref} is not a commit of this repository (fetch it first)" >&2
    exit 2
}
# DEST is emptied by venv --clear: only when it is a venv already, or an empty or new folder
if [ -e "$dest" ] && [ ! -f "$dest/pyvenv.cfg" ] && [ -n "$(ls -A "$dest")" ]; then
    echo "reference_env.sh: ${dest} exists and is not a virtual environment; pick another DEST" >&2
    exit 2
fi

# read before DEST is touched, so that a ref without the extras asked for changes nothing
files=$(mktemp -d)
trap 'rm -rf "$files"' EXIT

# REF's dependency files under their own paths: the top-level ones are installed, and the nested ones are
# there for their -r / -c lines (requirements/gpu.txt, ci/constraints.txt)
while IFS= read -r path; do
    case "$path" in
        pyproject.toml | requirements*.txt | */requirements*.txt | requirements/*.txt | */requirements/*.txt | \
            requirements*.lock | */requirements*.lock | *constraints*.txt)
            mkdir -p "$files/$(dirname "$path")"
            git show "${commit}:${path}" > "$files/$path" ;;
    esac
done < <(git ls-tree -r --name-only "$commit")

install=()
if [ -f "$files/pyproject.toml" ]; then
    "$python" - "$files/pyproject.toml" "${EXTRAS:-}" > "$files/project-requirements.txt" <<'PY'
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

with open(sys.argv[1], "rb") as handle:
    project = tomllib.load(handle).get("project", {})
optional = project.get("optional-dependencies", {})
extras = [extra.strip() for extra in sys.argv[2].split(",") if extra.strip()]
missing = [extra for extra in extras if extra not in optional]
if missing:
    sys.exit(f"reference_env.sh: pyproject.toml at the ref has no extra {', '.join(missing)} "
             f"(it has: {', '.join(optional) or 'none'})")
for requirement in [*project.get("dependencies", []), *(r for extra in extras for r in optional[extra])]:
    print(requirement)
PY
    install+=(-r "$files/project-requirements.txt")
fi
for requirements in "$files"/requirements*.txt "$files"/requirements*.lock; do
    install+=(-r "$requirements")
done
for constraints in "$files"/constraints*.txt; do
    install+=(-c "$constraints")
done
for path in ${CONSTRAINTS:-}; do
    if [ ! -f "$files/$path" ]; then
        mkdir -p "$files/$(dirname "$path")"
        git show "${commit}:${path}" > "$files/$path" || {
            echo "reference_env.sh: ${ref} has no constraints file ${path}" >&2
            exit 2
        }
    fi
    install+=(-c "$files/$path")
done

if [ "${#install[@]}" -eq 0 ] && [ "$#" -eq 0 ]; then
    echo "reference_env.sh: ${ref} has no dependency file (pyproject.toml, requirements*.txt, requirements*.lock)" >&2
    exit 2
fi
venv_args=(--clear)
if [ "${SYSTEM_SITE_PACKAGES:-0}" = 1 ]; then
    venv_args+=(--system-site-packages)
fi
"$python" -m venv "${venv_args[@]}" "$dest" >&2
dest=$(cd "$dest" && pwd)
cp -R "$files" "$dest/dependency-files"  # a record of what it was built from

echo "reference_env.sh: ${ref} (${commit:0:12}) -> ${dest}" >&2
"$dest/bin/python" -m pip install --disable-pip-version-check "${install[@]}" "$@" >&2
"$dest/bin/python" -m pip list --disable-pip-version-check --format=freeze >&2
printf '%s\n' "$dest/bin/python"
