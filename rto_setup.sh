#!/usr/bin/env bash
# Shorten TCP's minimum retransmission timeout (RTO) on this VM's IPv4 routes.
#
# Linux waits at least 200 ms before resending a lost TCP segment. Between the workers of a
# TPU slice (and across slices over DCN) round trips take well under a millisecond, so one
# lost packet can stall a collective for 200 ms; with rto_min 5ms it is resent after 5 ms.
# The setting lives on each route (`ip route change ... rto_min 5ms`) and lasts until reboot.
#
#   sudo bash rto_setup.sh               apply (needs root)
#   bash rto_setup.sh DRY_RUN=1          print what would change, change nothing (no root needed)
#   sudo bash rto_setup.sh RTO_MIN=10ms  use another value
#
# Safe to run again: routes that already carry the value are left alone. The recipes run it
# on PLATFORM=gce; on GKE the node image is configured by the cluster instead.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh rto_setup.sh` starts a POSIX shell: run under bash
set -euo pipefail

for arg in "$@"; do
  case "$arg" in
    DRY_RUN=*|RTO_MIN=*) export "$arg" ;;
    --dry-run) DRY_RUN=1 ;;
    *) echo "rto_setup.sh: unknown argument '$arg' (expected DRY_RUN=1, --dry-run or RTO_MIN=<n>ms)" >&2; exit 2 ;;
  esac
done
case "${DRY_RUN:-0}" in  # true/yes used to change the routes: only 1/0 and their words
  1|true|yes|TRUE|True|YES|Yes) DRY_RUN=1 ;;
  0|false|no|FALSE|False|NO|No|"") DRY_RUN=0 ;;
  *) echo "rto_setup.sh: DRY_RUN=$DRY_RUN is not 1 or 0 (nor true, yes, false or no; DRY_RUN=1 prints what" \
       "would change)" >&2; exit 2 ;;
esac
RTO_MIN=${RTO_MIN:-5ms}
if ! [[ "$RTO_MIN" =~ ^[0-9]+(ms|s)$ ]]; then
  echo "rto_setup.sh: RTO_MIN=$RTO_MIN is not a duration such as 5ms" >&2
  exit 2
fi
if [ "$DRY_RUN" != 1 ] && [ "$(id -u)" != 0 ]; then
  echo "rto_setup.sh: changing routes needs root; run 'sudo bash rto_setup.sh'" \
       "(or 'bash rto_setup.sh DRY_RUN=1' to see what it would change)" >&2
  exit 1
fi
if ! command -v ip >/dev/null 2>&1; then
  echo "rto_setup.sh: the 'ip' command (iproute2) is missing; install it (apt-get install iproute2)" >&2
  exit 1
fi

changed=0
unchanged=0
while IFS= read -r route; do
  [ -z "$route" ] && continue
  if [[ " $route " == *" rto_min $RTO_MIN "* ]]; then
    unchanged=$((unchanged + 1))
    continue
  fi
  # Drop words `ip route show` prints but `ip route change` does not accept, and any old rto_min.
  spec=$(sed -E 's/ (linkdown|dead|offload|trap|pervasive)( |$)/ /g; s/ expires [0-9]+sec//; s/ rto_min [0-9a-z]+//' <<<" $route")
  read -r -a words <<<"$spec"
  if [ "$DRY_RUN" = 1 ]; then
    echo "would run: ip route change ${words[*]} rto_min $RTO_MIN"
  else
    if ! ip route change "${words[@]}" rto_min "$RTO_MIN"; then  # ip's own line alone did not say what to do
      echo "rto_setup.sh: could not set rto_min $RTO_MIN on the route '${words[*]}' (ip's message above); in a" \
           "container (GKE, xpk) run the recipe with PLATFORM=gke, which leaves the network to the cluster" >&2
      exit 1
    fi
    echo "set rto_min $RTO_MIN: ${words[*]}"
  fi
  changed=$((changed + 1))
done < <(ip -4 route show)

verb=$([ "$DRY_RUN" = 1 ] && echo "would change" || echo "changed")
echo "rto_setup.sh: $verb $changed route(s); $unchanged already had rto_min $RTO_MIN"
