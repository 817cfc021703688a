#!/usr/bin/env bash
# Run a command with a private /tmp (its own mount namespace; root) that still has the GPU host's
# /tmp/site, /tmp/site_trl and /tmp/flashrl_home. verl names its weight-sync socket
# /tmp/rl-colocate-zmq-<Ray job id>-...: runs side by side, each with its own Ray cluster, get the
# same job id and would share it (on the H100 one run's sync hung). Usage: private_tmp.sh DIR CMD...
set -euo pipefail
dir=${1:?usage: private_tmp.sh DIR CMD...}; shift
mkdir -p "$dir"
exec unshare -m bash -c '
  dir=$1; shift
  for d in site site_trl flashrl_home; do
    if [ -d "/tmp/$d" ]; then mkdir -p "$dir/$d"; mount --bind "/tmp/$d" "$dir/$d"; fi
  done
  mount --rbind "$dir" /tmp
  exec "$@"' _ "$dir" "$@"
