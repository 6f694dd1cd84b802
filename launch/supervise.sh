# Sourced by lighthouses.sh and tunnel.sh (replica.sh keeps its own loop: it counts restarts
# against a limit). supervise WHAT CMD...: runs CMD in the background and waits for it; an
# exit with 0 (done, stopped) or 2 (a configuration error, which no restart fixes) ends the
# script with that code, any other is followed by a restart after RESTART_DELAY seconds
# (default 2), announced on stderr as "WHAT exited with RC; restart N in Ds". SIGTERM/SIGINT
# stop the child and end the script with 143.
supervise() {
  local what="$1"; shift
  child=0
  trap 'if [[ $child -ne 0 ]]; then kill -TERM "$child" 2>/dev/null; wait "$child"; fi; exit 143' TERM INT
  local restarts=0 rc
  while true; do
    "$@" & child=$!
    wait "$child"; rc=$?; child=0
    if [[ $rc -eq 0 || $rc -eq 2 ]]; then exit "$rc"; fi
    restarts=$((restarts + 1))
    echo "$what exited with $rc; restart $restarts in ${RESTART_DELAY:-2}s" >&2
    sleep "${RESTART_DELAY:-2}"
  done
}
