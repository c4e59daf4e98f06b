# Shared by the hand-run smoke tests (services/smoke-test.sh, services/arm-smoke.sh), sourced
# once REPO, PY, LOG and SMOKE_NAME are set: output to the terminal and to $LOG, the timed log
# lines, the failure message, the root check, and the project's requirements for pip download.

exec > >(tee "$LOG") 2>&1

t0=$(date +%s)
log() { printf '\n==> [%4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
fail() { printf '\n%s FAILED: %s\n' "$SMOKE_NAME" "$*"; exit 1; }
# pip's notes about index locations configured on this machine but absent: noise here.
quiet_pip() { grep -v '^WARNING: Location' || true; }

require_root() {  # WHY: fails unless root
    [ "$(id -u)" = 0 ] || fail "run as root ($1)"
}

# The build and runtime requirements of pyproject.toml, one a line, plus wheel.
requirements() {
    "$PY" - "$REPO/pyproject.toml" <<'PYEOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))
for line in project["build-system"]["requires"] + project["project"]["dependencies"]:
    print(line)
print("wheel")
PYEOF
}
